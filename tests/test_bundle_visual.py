"""The ``visual`` role in bundles: a VLM target's vision tower is exported into ``visual/``.

One tiny random Qwen2.5-VL (written by transformers) is built into a portable bundle once:
with real TensorRT-RTX engines when ``tensorrt_rtx`` is installed, else ``--onnx-only`` (the
engine test then skips and prints why). Checked against independent oracles: the manifest's
hashes against ``hashlib`` over the files, the bundle's ``visual/model.onnx`` in onnxruntime
against the transformers vision tower on images preprocessed by transformers' own image
processor, corrupt visual files against ``verify``. A text-only target gets no visual role;
the VLM's base role takes the image table and 3-axis positions (test_trt_vlm.py runs it).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from export_fixtures import make_tiny_target
from serve_fixtures import torch_threads
from vlm_fixtures import IMAGE_PAD, hf_image_processor, hf_model, noise_image, write_tiny_vlm

from edgebuild.bundle import verify_bundle
from edgebuild.bundle.build import BuildOptions, build_bundle, recipe_from_flags
from edgebuild.cli import main
from edgebuild.engine import VisualGeometry, profiles, visual_axis_ranges
from edgebuild.errors import BundleError, ConfigError
from edgebuild.recipe import BuildSettings

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
pytest.importorskip("PIL")
TOL = 1e-4
LIMITS = dict(max_input_len=128, max_kv_cache_capacity=256, max_image_tokens=64, max_images=3)
VISUAL_FILES = ("model.onnx", "model.onnx.data", "config.json", "preprocessor_config.json")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: the CPU here is shared, and oversubscription is very slow."""
    with torch_threads(1):
        yield


def _rtx():
    try:
        return importlib.import_module("tensorrt_rtx")
    except ImportError:
        return None


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    return write_tiny_vlm(tmp_path_factory.mktemp("ckpt") / "vlm")


@pytest.fixture(scope="module")
def bundle(vlm, tmp_path_factory) -> Path:
    """Portable graphs (fp32), engines by TensorRT-RTX when it is installed."""
    out = tmp_path_factory.mktemp("bundles") / "vlm"
    have_rtx = _rtx() is not None
    if not have_rtx:
        print("tensorrt_rtx is not installed: building the VLM bundle --onnx-only")
    options = BuildOptions(
        onnx_only=not have_rtx,
        portable=True,
        builder="tensorrt_rtx",
        dtype="float32",
        progress=False,
    )
    build_bundle(recipe_from_flags(vlm, None, **LIMITS), out, options)
    return out


def _manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def test_the_manifest_lists_the_visual_role_and_hashes_its_files(bundle, vlm):
    m = _manifest(bundle)
    assert set(m["roles"]) == {"base", "visual"}
    visual = m["roles"]["visual"]
    assert visual["onnx"] == "visual/model.onnx" and visual["onnx_data"] == "visual/model.onnx.data"
    assert visual["config"] == "visual/config.json"
    assert visual["preprocessor_config"] == "visual/preprocessor_config.json"
    assert visual["graph_kind"] == "portable" and visual["dtype"] == "float32"
    assert [i["name"] for i in visual["inputs"]] == [
        "pixel_values", "patch_order", "rope_cos_sin", "full_index", "full_valid", "full_slot",
        "window_index", "window_valid", "window_slot", "merge_order",
    ]  # fmt: skip
    assert visual["outputs"] == [
        {"name": "image_embeds", "dtype": "float32", "dims": ["tokens", 64]}
    ]
    # window_size 56 px / (2 x 14 px) = 2 merged tokens per side -> 4 tokens per window
    vision = visual["vision"]
    assert (vision["merge_unit"], vision["window_tokens"], vision["patch_dim"]) == (4, 4, 1176)
    assert vision["image_token_id"] == IMAGE_PAD
    for name in VISUAL_FILES:
        data = (bundle / "visual" / name).read_bytes()
        record = m["files"][f"visual/{name}"]
        assert record == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    pre = (vlm / "preprocessor_config.json").read_bytes()
    assert (bundle / "visual" / "preprocessor_config.json").read_bytes() == pre
    assert m["sources"]["target"]["files"]["preprocessor_config.json"]["sha256"] == (
        hashlib.sha256(pre).hexdigest()
    )
    config = json.loads((bundle / "visual" / "config.json").read_text())
    assert config["role"] == "visual" and config["image_token_id"] == IMAGE_PAD
    assert config["vision_config"]["depth"] == 3
    assert m["build"]["max_image_tokens"] == 64 and m["build"]["max_images"] == 3


def test_the_bundles_visual_graph_in_onnxruntime_equals_the_transformers_vision_tower(bundle, vlm):
    from edgebuild.export.visual import plan_inputs
    from edgebuild.models.vision import VisionConfig, VisionPlan

    # the oracle's own preprocessing: transformers' image processor on two real PIL images
    images = [noise_image(196, 140, seed=1), noise_image(60, 90, seed=2)]
    batch = hf_image_processor()(images=images, return_tensors="pt")
    pixels, grids = batch["pixel_values"], batch["image_grid_thw"]
    with torch.no_grad():
        ref = hf_model(vlm).model.visual(pixels, grid_thw=grids).pooler_output
    cfg = VisionConfig.from_model_config(json.loads((vlm / "config.json").read_text()))
    plan = VisionPlan.build(cfg, grids.tolist())
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(
        str(bundle / "visual" / "model.onnx"), options, providers=["CPUExecutionProvider"]
    )
    feeds = {k: v.numpy() for k, v in plan_inputs(plan, pixels).items()}
    (out,) = session.run(["image_embeds"], feeds)
    assert out.shape == tuple(ref.shape) == (35 + 6, 64)  # 10x14 and 6x4 patch grids
    assert (torch.from_numpy(out) - ref).abs().max() <= TOL
    assert ref.abs().max() > 0.1  # the random tower really transforms the image


def test_tensorrt_rtx_builds_the_visual_engine_with_the_image_profile(bundle):
    rtx = _rtx()
    if rtx is None:
        print("SKIP: tensorrt_rtx is not installed (pip install tensorrt-rtx-cu13)")
        pytest.skip("tensorrt_rtx is not installed: pip install tensorrt-rtx-cu13")
    from edgebuild.runtime.trt_plan import role_profiles

    m = _manifest(bundle)
    assert m["engines"]["status"] == "built" and m["engines"]["builder_version"] == rtx.__version__
    engine = bundle / "visual" / "model.engine"
    assert m["roles"]["visual"]["engine"] == "visual/model.engine"
    assert m["files"]["visual/model.engine"]["size"] == engine.stat().st_size > 10_000
    (profile,) = role_profiles(m, "visual")  # what the runtime derives from the manifest
    assert profile.name == "all"
    assert profile.shapes["pixel_values"] == ((4, 1176), (256, 1176), (256, 1176))
    assert profile.shapes["merge_order"] == ((1,), (64,), (64,))
    assert profile.shapes["full_index"] == ((1, 4), (1, 256), (3, 256))
    assert profile.shapes["window_index"] == ((1, 4), (16, 16), (64, 16))
    verify_bundle(bundle)


def test_the_vlm_bundles_base_role_takes_the_image_table_and_3_axis_positions(bundle):
    from edgebuild.runtime.trt_plan import role_profiles

    m = _manifest(bundle)
    inputs = m["roles"]["base"]["inputs"]
    assert [i["name"] for i in inputs][:3] == ["input_ids", "image_embeds", "mrope_positions"]
    assert "positions" not in [i["name"] for i in inputs]
    assert inputs[1] == {"name": "image_embeds", "dtype": "float32", "dims": ["image_tokens", 64]}
    prefill, generate = role_profiles(m, "base")
    assert prefill.shapes["image_embeds"] == ((1, 64), (64, 64), (64, 64))  # max_image_tokens
    assert generate.shapes["image_embeds"] == ((1, 64), (1, 64), (1, 64))  # text rows only
    if m["engines"]["status"] == "built":  # TensorRT-RTX parsed and built it with them
        assert m["files"]["base/model.engine"]["size"] > 10_000


def test_profiles_of_the_visual_role_follow_the_recipe_and_the_tower():
    build = BuildSettings(device="thor", precision="bf16", max_image_tokens=1024, max_images=2)
    ranges = visual_axis_ranges(build, VisualGeometry(merge_unit=4, window_tokens=16))
    assert ranges["patches"] == (4, 4096, 4096) and ranges["tokens"] == (1, 1024, 1024)
    assert ranges["full_segments"] == (1, 1, 2) and ranges["window_len"] == (4, 64, 64)
    assert ranges["windows"] == (1, 64, 1024)
    few = visual_axis_ranges(
        build.model_copy(update={"max_image_tokens": 8}), VisualGeometry(4, 16)
    )
    assert few["window_len"] == (4, 32, 32)  # a window never holds more than all the tokens
    with pytest.raises(ConfigError, match="VisualGeometry"):
        profiles("visual", [{"name": "merge_order", "dims": ["tokens"]}], build, 0)
    with pytest.raises(ConfigError, match="roles.visual.vision records merge_unit None"):
        VisualGeometry.from_role({"vision": {}})


@pytest.mark.parametrize(
    ("damage", "pattern"),
    [
        ("flip:model.onnx.data", r"visual/model\.onnx\.data: sha256 .* changed after the build"),
        ("drop:preprocessor_config.json", r"visual/preprocessor_config\.json: missing"),
        ("flip:config.json", r"visual/config\.json: sha256 .* changed after the build"),
    ],
)
def test_a_corrupt_visual_file_is_refused_by_verify_naming_it(bundle, tmp_path, damage, pattern):
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    action, name = damage.split(":")
    path = copy / "visual" / name
    if action == "drop":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=pattern):
        verify_bundle(copy, check_sources=False)
    result = CliRunner().invoke(main, ["verify", str(copy), "--no-sources"])
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and f"visual/{name}" in result.output


def test_a_text_only_target_builds_without_a_visual_role(tmp_path):
    target = make_tiny_target(tmp_path / "qwen3", "qwen3", num_hidden_layers=2)
    recipe = recipe_from_flags(target, None, max_input_len=64, max_kv_cache_capacity=128)
    result = build_bundle(recipe, tmp_path / "bundle", BuildOptions(onnx_only=True, progress=False))
    assert set(result.manifest["roles"]) == {"base"}
    assert not (tmp_path / "bundle" / "visual").exists()
    assert not [f for f in result.manifest["files"] if f.startswith("visual/")]


def test_image_limits_are_checked_before_any_export(vlm, tmp_path, monkeypatch):
    import edgebuild.export as export

    def must_not_run(*args, **kwargs):
        raise AssertionError("export started before validation finished")

    monkeypatch.setattr(export, "export_base", must_not_run)
    recipe = recipe_from_flags(vlm, None, max_input_len=64, max_kv_cache_capacity=128)
    with pytest.raises(ConfigError, match=r"'build\.max_image_tokens' is 1024, more than .*64"):
        build_bundle(recipe, tmp_path / "out", BuildOptions(onnx_only=True, progress=False))
    assert not (tmp_path / "out").exists()
    args = ["build", str(vlm), "-o", str(tmp_path / "cli"), "--max-images", "0", "--onnx-only"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert "'build.max_images' is 0; fix: use a positive integer" in result.output
    result = CliRunner().invoke(main, [*args[:4], "--visual", str(vlm)])
    assert result.exit_code == 2 and "No such option '--visual'" in result.output
