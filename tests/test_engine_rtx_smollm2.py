"""The real example model (SmolLM2-135M, BF16) as a portable graph builds a TensorRT-RTX engine.

A full-size check of the parser and builder path (30 layers, GQA, tied head, bf16 strongly
typed network) on the CPU; skipped with the reason printed when tensorrt_rtx is missing.
"""

from __future__ import annotations

import importlib

import pytest

from edgebuild.checkpoint.source import WeightSource
from edgebuild.engine import build_engine
from edgebuild.export import ExportOptions, GraphKind, export_base
from edgebuild.recipe import BuildSettings

pytestmark = pytest.mark.slow


def test_smollm2_bf16_portable_base_builds_a_real_rtx_engine(smollm2_dir, tmp_path):
    try:
        rtx = importlib.import_module("tensorrt_rtx")
    except ImportError:
        print(
            "SKIP: tensorrt_rtx is not installed (pip install -c constraints.txt tensorrt-rtx-cu13)"
        )
        pytest.skip("tensorrt_rtx is not installed")
    options = ExportOptions(kind=GraphKind.PORTABLE, dtype="bfloat16", rope_rows=512)
    exported = export_base(WeightSource(smollm2_dir), tmp_path, options)
    assert exported.dtype == "bfloat16"
    build = BuildSettings(
        device="thor", precision="bf16", max_input_len=128, max_kv_cache_capacity=256
    )
    report = build_engine(
        exported.onnx_path, tmp_path / "model.engine", "base", exported.inputs, build, 7,
        builder="tensorrt_rtx",
    )  # fmt: skip
    assert report.builder_version == rtx.__version__
    assert report.engine_path.stat().st_size > exported.data_path.stat().st_size // 2
