"""The Qwen2.5-VL vision side matches transformers on a tiny random-weight checkpoint.

Oracles (transformers 5.14, fp32): `Qwen2VLImageProcessorPil` (pixels and grids),
`model.model.visual` (vision tower output), `Qwen2_5_VLModel.get_rope_index` (3-axis
positions and rope delta), `Qwen2_5_VLRotaryEmbedding` + `apply_multimodal_rotary_pos_emb`
(cos/sin rows). Tolerance 1e-4 (fp32; see spec/qwen25vl-facts.md).
"""

from __future__ import annotations

import json

import pytest
import torch
from serve_fixtures import torch_threads
from vlm_fixtures import (
    IMAGE_PAD,
    MROPE_SECTION,
    VISION_END,
    VISION_START,
    hf_image_processor,
    hf_model,
    noise_image,
    write_tiny_vlm,
)

from edgebuild.checkpoint.config import ModelConfig
from edgebuild.checkpoint.source import WeightSource
from edgebuild.errors import CheckpointError, ConfigError
from edgebuild.models.image_processing import ImageProcessor, ImageSizeError, smart_resize
from edgebuild.models.vision import VisionConfig, VisionPlan, VisionTower
from edgebuild.ops.mrope import mrope_cos_sin_rows, mrope_position_ids, parse_mrope
from edgebuild.ops.rope import RopeScaling, apply_rope, rope_cos_sin_table

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: the CPU here is shared, and oversubscription is very slow."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    nested = write_tiny_vlm(root / "nested")
    flat = write_tiny_vlm(root / "flat", layout="flat")
    return nested, flat, hf_model(nested)


@pytest.fixture(scope="module")
def tower(vlm):
    return VisionTower.from_source(WeightSource(vlm[0]))


IMAGES = {
    "small-rgb": dict(width=90, height=50),
    "tall-grayscale": dict(width=40, height=150, mode="L"),
    "rgba-odd": dict(width=133, height=97, mode="RGBA"),
    "large-downscaled": dict(width=700, height=420),
    "tiny-upscaled": dict(width=9, height=13),
    "palette": dict(width=64, height=64, mode="P"),
}


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_pixels_and_grid_equal_the_transformers_image_processor(vlm, tower, name):
    image = noise_image(seed=3, **IMAGES[name])
    ref = hf_image_processor()(images=[image], return_tensors="pt")
    mine = ImageProcessor.from_dir(vlm[0], tower.config)(image)
    assert list(mine.grid_thw) == ref["image_grid_thw"][0].tolist()
    assert mine.pixel_values.dtype == torch.float32
    assert torch.equal(mine.pixel_values, ref["pixel_values"])
    t, h, w = mine.grid_thw
    assert mine.num_tokens == t * h * w // 4


def test_vision_tower_output_matches_transformers_for_several_images(vlm, tower):
    proc = ImageProcessor.from_dir(vlm[0], tower.config)
    # 10x14 patches: windows of 2x2 merged tokens with ragged edges; then a small second image
    images = [proc(noise_image(196, 140, seed=1)), proc(noise_image(60, 90, seed=2))]
    pixels = torch.cat([im.pixel_values for im in images])
    grids = torch.tensor([im.grid_thw for im in images])
    with torch.no_grad():
        ref = vlm[2].model.visual(pixels, grid_thw=grids).pooler_output
        out = tower(pixels, VisionPlan.build(tower.config, grids.tolist()))
    assert out.shape == ref.shape == (sum(im.num_tokens for im in images), 64)
    assert (out - ref).abs().max() <= TOL
    per_image = tower.encode(images)
    assert [e.shape[0] for e in per_image] == [im.num_tokens for im in images]
    assert (torch.cat(per_image) - ref).abs().max() <= TOL


def test_window_plan_covers_every_patch_once_and_merge_order_inverts_it(tower):
    plan = VisionPlan.build(tower.config, [(1, 10, 14), (1, 4, 6)])
    n = plan.num_patches
    assert n == 10 * 14 + 4 * 6
    assert sorted(plan.patch_order.tolist()) == list(range(n))
    for seg in (plan.full, plan.windows):
        rows = seg.index[seg.valid]
        assert sorted(rows.tolist()) == list(range(n))
        assert torch.equal(seg.index.reshape(-1)[seg.slot], torch.arange(n))
    assert plan.full.index.shape[0] == 2  # one segment per image
    assert plan.windows.valid.sum(1).max() == 16  # 2x2 merged tokens x 4 patches
    assert plan.cu_tokens == (0, 35, 41)


def test_mrope_positions_and_delta_equal_get_rope_index(vlm):
    grids = [(1, 4, 6), (1, 10, 14)]
    ids = [1, 2, VISION_START] + [IMAGE_PAD] * 6 + [VISION_END, 5, 6, VISION_START]
    ids += [IMAGE_PAD] * 35 + [VISION_END, 9, 10, 11]
    mine, delta = mrope_position_ids(ids, IMAGE_PAD, grids, 2)
    input_ids = torch.tensor([ids])
    types = (input_ids == IMAGE_PAD).long()
    ref, ref_delta = vlm[2].model.get_rope_index(
        input_ids, types, image_grid_thw=torch.tensor(grids)
    )
    assert torch.equal(mine, ref[:, 0]) and delta == int(ref_delta)
    assert delta < 0  # text after an image resumes at p + max(h, w), not p + h*w


def test_mrope_rows_rotate_q_like_transformers_multimodal_rotary(vlm):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        apply_multimodal_rotary_pos_emb,
    )

    cfg = ModelConfig.from_file(vlm[0])
    positions = torch.tensor([[0, 1, 2, 2, 2, 5, 9], [0, 1, 2, 3, 3, 5, 9], [0, 1, 2, 2, 4, 5, 9]])
    rows = mrope_cos_sin_rows(positions, cfg.head_dim, cfg.rope, cfg.mrope_section)  # [7, D]
    q = torch.randn(1, 2, 7, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    cos, sin = vlm[2].model.language_model.rotary_emb(q, positions[:, None, :])
    ref, _ = apply_multimodal_rotary_pos_emb(q, q, cos, sin, list(cfg.mrope_section))
    mine = apply_rope(q[0].transpose(0, 1), torch.arange(7), rows)  # [S, H, D] token-major
    assert (mine.transpose(0, 1)[None] - ref).abs().max() <= 1e-6
    text = torch.arange(7).expand(3, -1)  # equal axes: the 1-D table, bit for bit
    table = rope_cos_sin_table(cfg.head_dim, 7, cfg.rope)
    assert torch.equal(mrope_cos_sin_rows(text, cfg.head_dim, cfg.rope, cfg.mrope_section), table)


def test_flat_hub_and_nested_configs_parse_to_the_same_language_model(vlm):
    nested, flat = ModelConfig.from_file(vlm[0]), ModelConfig.from_file(vlm[1])
    for name in ("family", "hidden_size", "num_hidden_layers", "head_dim", "vocab_size", "rope"):
        assert getattr(nested, name) == getattr(flat, name)
    assert nested.mrope_section == flat.mrope_section == tuple(MROPE_SECTION)
    assert nested.vision_config is not None and flat.vision_config is not None
    assert nested.architecture == "Qwen2_5_VLForConditionalGeneration"


def test_mrope_configs_are_read_from_both_layouts_and_bad_sections_are_named():
    flat = {"rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}
    rope, section = parse_mrope(flat)
    assert rope == RopeScaling(rope_theta=1e6) and section == (16, 24, 24)
    with pytest.raises(ConfigError, match="mrope_section"):
        parse_mrope({"rope_parameters": {"rope_type": "default"}}, "x/config.json")
    with pytest.raises(ConfigError, match="three positive integers"):
        parse_mrope({"rope_scaling": {"type": "mrope", "mrope_section": [16, 24]}})
    with pytest.raises(ConfigError, match="interleaved"):
        parse_mrope({"rope_parameters": {"mrope_section": [1, 1, 1], "mrope_interleaved": True}})


def test_a_section_that_does_not_fill_the_head_is_refused(vlm):
    cfg = json.loads((vlm[0] / "config.json").read_text())
    cfg["text_config"]["rope_parameters"]["mrope_section"] = [4, 2, 1]
    with pytest.raises(ConfigError, match="mrope_section"):
        ModelConfig.from_dict(cfg, "vlm/config.json")


def test_vision_config_and_checkpoint_errors_name_the_field(vlm, tmp_path):
    cfg = json.loads((vlm[0] / "config.json").read_text())
    bad = {**cfg, "vision_config": {**cfg["vision_config"], "num_heads": 3}}
    with pytest.raises(ConfigError, match="head_dim"):
        VisionConfig.from_model_config(bad, "vlm/config.json")
    bad = {**cfg, "vision_config": {**cfg["vision_config"], "fullatt_block_indexes": [5]}}
    with pytest.raises(ConfigError, match="fullatt_block_indexes"):
        VisionConfig.from_model_config(bad)
    import shutil

    copy = tmp_path / "deeper"
    shutil.copytree(vlm[0], copy)
    cfg["vision_config"]["depth"] = 4
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="visual.blocks.3"):
        VisionTower.from_source(WeightSource(copy))


def test_smart_resize_limits_and_refusals():
    assert smart_resize(50, 90, 28, 3136, 50176) == (56, 84)
    h, w = smart_resize(4000, 3000, 28, 3136, 50176)
    assert h * w <= 50176 and h % 28 == 0 and w % 28 == 0
    with pytest.raises(ImageSizeError, match="aspect ratio"):
        smart_resize(10, 3000, 28, 3136, 50176)
    with pytest.raises(ImageSizeError, match="zero size"):
        smart_resize(0, 30, 28, 3136, 50176)
