"""The `visual` role exports the vision tower (traced on meta weights, weights streamed from the
checkpoint) to a standard-op ONNX graph that onnxruntime runs to the torch tower's output
(<= 1e-4, fp32) for image sets of other sizes and counts than the traced example (dynamic
patch, token, segment and window axes). The bundle side is in test_bundle_visual.py."""

from __future__ import annotations

import json

import pytest
import torch
from serve_fixtures import torch_threads
from vlm_fixtures import noise_image, write_tiny_vlm

from edgebuild.checkpoint.source import WeightSource
from edgebuild.models.image_processing import ImageProcessor
from edgebuild.models.vision import VisionPlan, VisionTower

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
pytest.importorskip("PIL")
TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: the CPU here is shared, and oversubscription is very slow."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from edgebuild.export import ExportOptions, export_visual

    root = tmp_path_factory.mktemp("visual")
    ckpt = write_tiny_vlm(root / "vlm")
    options = ExportOptions(dtype="float32")
    exported = export_visual(WeightSource(ckpt), root / "bundle" / "visual", options)
    assert exported.role == "visual" and exported.kind.value == "portable"
    return ckpt, exported.onnx_path


def test_the_role_directory_holds_graph_weights_and_configs(exported):
    ckpt, path = exported
    folder = path.parent
    assert {p.name for p in folder.iterdir()} >= {
        "model.onnx",
        "model.onnx.data",
        "config.json",
        "preprocessor_config.json",
    }
    model = onnx.load(str(path), load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    assert not {n.domain for n in model.graph.node} - {""}  # standard ops only
    assert "Conv" not in ops  # the patch Conv3d is a MatMul
    names = {i.name for i in model.graph.initializer}
    assert "visual.blocks.0.attn.qkv.weight" in names
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["role"] == "visual" and cfg["image_token_id"] == 261
    assert [i["name"] for i in cfg["inputs"]][:2] == ["pixel_values", "patch_order"]


@pytest.mark.parametrize(
    "sizes", [[(196, 140)], [(60, 90), (250, 170), (28, 28)]], ids=["one", "three"]
)
def test_onnxruntime_matches_the_torch_tower(exported, sizes):
    from edgebuild.export.visual import plan_inputs

    ckpt, path = exported
    tower = VisionTower.from_source(WeightSource(ckpt))
    proc = ImageProcessor.from_dir(ckpt, tower.config)
    images = [proc(noise_image(w, h, seed=i)) for i, (w, h) in enumerate(sizes)]
    pixels = torch.cat([im.pixel_values for im in images])
    plan = VisionPlan.build(tower.config, [im.grid_thw for im in images])
    with torch.no_grad():
        ref = tower(pixels, plan)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {k: v.numpy() for k, v in plan_inputs(plan, pixels).items()}
    (out,) = session.run(["image_embeds"], feeds)
    assert out.shape == tuple(ref.shape)
    assert (torch.from_numpy(out) - ref).abs().max() <= TOL
