"""ONNX -> engine: profiles, device rules, and real engine builds with TensorRT-RTX on the CPU.

TensorRT-RTX (``pip install tensorrt-rtx-cu13``) parses and builds the *portable* graphs on a
CPU-only machine: a real parser and builder, not a mock. Tests that need it are skipped, with
the reason printed, only when the package is missing. The plugin graphs need the real
TensorRT and the plugin library (Jetson); here we check that they are refused cleanly.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from dspark_fixtures import make_random_draft
from export_fixtures import make_tiny_target

from edgebuild.bundle.build import BuildOptions, build_bundle, recipe_from_flags
from edgebuild.checkpoint.source import WeightSource
from edgebuild.engine import axis_ranges, build_engine, check_device_formats, profiles
from edgebuild.errors import ConfigError
from edgebuild.export import ExportOptions, GraphKind, export_base
from edgebuild.recipe import BuildSettings

BUILD = BuildSettings(
    device="thor", precision="bf16", max_batch_size=2, max_input_len=64, max_kv_cache_capacity=128
)


@pytest.fixture(scope="module")
def rtx():
    try:
        return importlib.import_module("tensorrt_rtx")
    except ImportError:
        print(
            "SKIP: tensorrt_rtx is not installed (pip install -c constraints.txt tensorrt-rtx-cu13)"
        )
        pytest.skip("tensorrt_rtx is not installed: pip install tensorrt-rtx-cu13")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("ckpt") / "qwen3", "qwen3", num_hidden_layers=2)


def test_base_profiles_cover_prefill_and_generate_and_the_draft_one_profile():
    inputs = [
        {"name": "input_ids", "dims": ["batch", "seq"]},
        {"name": "page_table", "dims": ["batch", "max_pages"]},
        {"name": "kv_cache_0", "dims": ["num_pages", 2, 2, 32, 16]},
        {"name": "logits_rows", "dims": ["batch", "logits_rows"]},
    ]
    prefill, generate = profiles("base", inputs, BUILD, num_speculative_tokens=7)
    assert prefill["input_ids"] == ((1, 1), (2, 64), (2, 64))
    assert generate["input_ids"] == ((1, 1), (2, 8), (2, 8))  # verify = 7 drafts + anchor
    assert prefill["page_table"][2] == (2, 4)  # 128 rows / 32 per page
    assert prefill["kv_cache_0"][2] == (8, 2, 2, 32, 16)  # 2 sequences x 4 pages
    assert generate["logits_rows"][2] == (2, 8)
    (only,) = profiles(
        "draft", [{"name": "context_features", "dims": ["batch", "context_len", 64]}], BUILD, 7
    )
    assert only["context_features"] == ((1, 1, 64), (2, 8, 64), (2, 64, 64))
    assert axis_ranges(BUILD, 0, "generate")["seq"] == (1, 1, 1)


def test_an_axis_without_a_range_is_refused():
    with pytest.raises(ConfigError, match="axis 'mystery'"):
        profiles("base", [{"name": "x", "dims": ["mystery"]}], BUILD, 1)


def test_nvfp4_and_fp8_weights_are_refused_for_orin():
    with pytest.raises(ConfigError, match=r"NVFP4 weights cannot run on orin \(sm_87"):
        check_device_formats("orin", ["NVFP4"], "ckpt")
    with pytest.raises(ConfigError, match="FP8, FP8_BLOCK"):
        check_device_formats("orin", ["FP8_BLOCK", "FP8"], "ckpt")
    check_device_formats("thor", ["NVFP4", "FP8"], "ckpt")
    check_device_formats("orin", [], "ckpt")


def test_an_nvfp4_checkpoint_for_orin_is_refused_before_any_export(tmp_path, monkeypatch):
    modelopt_fixtures = pytest.importorskip("modelopt_fixtures")
    pytest.importorskip("modelopt")
    ckpt = modelopt_fixtures.make_tiny_nvfp4_qwen3(tmp_path, quantize_lm_head=False)
    with pytest.raises(ConfigError, match="orin.*sm_87.*(FP4|NVFP4)|nvfp4.*orin"):
        recipe_from_flags(ckpt, None, device="orin")
    # a bf16 engine from the same weights is allowed: they are dequantized at export
    recipe = recipe_from_flags(ckpt, None, device="orin", precision="bf16")
    from edgebuild.bundle.build import plan_build

    assert plan_build(recipe, BuildOptions(onnx_only=True)).weights == "dense"


def test_plugin_graphs_are_refused_by_tensorrt_rtx(target, tmp_path, rtx):
    exported = export_base(WeightSource(target), tmp_path, ExportOptions(dtype="float32"))
    # it loads the library and creates the plugin (test_engine_rtx_plugin.py), but cannot add
    # plugin layers: the message says both
    with pytest.raises(ConfigError, match="loads the plugin library.*cannot add plugin layers"):
        build_engine(
            exported.onnx_path,
            tmp_path / "x.engine",
            "base",
            exported.inputs,
            BUILD,
            3,
            builder="tensorrt_rtx",
            needs_plugin=True,
        )


def test_without_tensorrt_the_build_stops_after_onnx_and_says_so(target, tmp_path, monkeypatch):
    real = importlib.import_module

    def no_tensorrt(name, *args, **kwargs):
        if name == "tensorrt":
            raise ImportError("No module named 'tensorrt'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", no_tensorrt)
    recipe = recipe_from_flags(target, None, max_input_len=64, max_kv_cache_capacity=128)
    result = build_bundle(recipe, tmp_path / "bundle", BuildOptions(progress=False))
    assert result.manifest["engines"]["status"].startswith("not built: tensorrt is not installed")
    assert (tmp_path / "bundle" / "base" / "model.onnx").is_file()
    assert not (tmp_path / "bundle" / "base" / "model.engine").exists()


def test_tiny_portable_target_and_draft_build_real_rtx_engines(target, tmp_path, rtx):
    draft = make_random_draft(tmp_path / "draft", target, num_layers=1, block_size=4)
    recipe = recipe_from_flags(
        target, draft, max_batch_size=2, max_input_len=64, max_kv_cache_capacity=128
    )
    options = BuildOptions(
        portable=True,
        builder="tensorrt_rtx",
        dtype="float32",
        timing_cache=tmp_path / "timing.cache",
        progress=False,
    )
    result = build_bundle(recipe, tmp_path / "bundle", options)
    engines = result.manifest["engines"]
    assert engines["status"] == "built" and engines["builder_version"] == rtx.__version__
    for role in ("base", "draft"):
        engine = tmp_path / "bundle" / role / "model.engine"
        assert engine.stat().st_size > 100_000
        assert result.manifest["roles"][role]["engine"] == f"{role}/model.engine"
        assert result.manifest["files"][f"{role}/model.engine"]["size"] == engine.stat().st_size
    assert not (tmp_path / "timing.cache").exists()  # TensorRT-RTX has no timing cache
    check_stripped_draft_refusals(tmp_path / "bundle", result.manifest, tmp_path)


def check_stripped_draft_refusals(bundle: Path, manifest: dict, tmp_path: Path) -> None:
    """Issue 27 (head once in the engines): the draft's shared head / embedding can be marked
    refittable and stripped from the plan; a name the graph lacks is refused by name, and on a
    CPU-only host the build is refused before TensorRT-RTX fails in its JIT (every REFIT /
    REFIT_INDIVIDUAL / REFIT_IDENTICAL / STRIP_PLAN build failed here with MyelinCheckException
    ... CUDA_SUCCESS; the device check is scripts/gpu_check_refit.py)."""
    import torch

    from edgebuild.errors import EngineError

    if torch.cuda.is_available():
        return  # a CUDA GPU: the stripped build would run (the device check covers it)
    role = manifest["roles"]["draft"]
    args = (bundle / role["onnx"], tmp_path / "d.engine", "draft", role["inputs"], BUILD, 3)
    with pytest.raises(EngineError, match=r"cannot strip \['no_such.weight'\]"):
        build_engine(*args, builder="tensorrt_rtx", strip_weights=["no_such.weight"])
    assert role["shared_initializers"] == ["embed_tokens.weight", "lm_head.weight"]
    with pytest.raises(ConfigError, match="weight-stripped, refittable engine .* CUDA GPU"):
        build_engine(*args, builder="tensorrt_rtx", strip_weights=role["shared_initializers"])
    assert not (tmp_path / "d.engine").exists()


def test_modelopt_nvfp4_portable_graph_with_dequantize_chains_builds_with_rtx(tmp_path, rtx):
    pytest.importorskip("modelopt")
    from modelopt_fixtures import make_tiny_nvfp4_qwen3

    ckpt = make_tiny_nvfp4_qwen3(tmp_path / "ckpt", quantize_lm_head=True)
    options = ExportOptions(kind=GraphKind.PORTABLE, dtype="bfloat16")
    exported = export_base(WeightSource(ckpt), tmp_path / "out", options)
    assert len(exported.weights.quantized) == 15  # every linear and the head stay NVFP4
    report = build_engine(
        exported.onnx_path,
        tmp_path / "out" / "model.engine",
        "base",
        exported.inputs,
        BUILD,
        3,
        builder="tensorrt_rtx",
    )
    assert report.engine_path.stat().st_size > 100_000
    assert len(report.profiles) == 2
