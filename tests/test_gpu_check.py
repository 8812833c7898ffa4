"""``scripts/gpu_check.sh --dry-run``: the GPU check's every non-device part, on this CPU.

The dry run builds the real kernel sources and ``plugins/tests/cuda_check.cu`` with g++ on the
CUDA CPU emulation and runs the same steps the device run does (kernels vs host build on every
phase, quick set; the decode-attention bandwidth benchmark on tiny shapes, which has no clock
here). Checked against independent numbers: the correctness count, the bandwidth benchmark's
byte accounting (K and V of every visible slot once, the new row's K/V, qkv and out), the plan's
step caps within the 8-minute budget, and the argument errors.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(*args: str, out: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def _decode_bytes(batch, context, hq, hkv, d, kv_bytes, io_bytes) -> int:
    cache = batch * (context + 1) * 2 * hkv * d * kv_bytes
    return cache + batch * (hq + 2 * hkv) * d * io_bytes + batch * hq * d * io_bytes


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> subprocess.CompletedProcess:
    if shutil.which("g++") is None:
        pytest.skip("g++ not found: the dry run builds the emulated kernels with it")
    out = tmp_path_factory.mktemp("gpu_check")
    return _run("--dry-run", "--build-dir", str(out / "build"), out=out)


def test_the_dry_run_passes_every_non_device_step(dry_run):
    log = dry_run.stdout
    assert dry_run.returncode == 0, log[-3000:] + dry_run.stderr[-2000:]
    assert "DRY no GPU queried" in log and "ALL PASS (dry run" in log
    passed = re.search(r"correctness: (\d+) passed, (\d+) failed", log)
    assert passed and int(passed.group(1)) >= 300 and passed.group(2) == "0"
    assert "FAIL" not in log.replace("0 failed", "")


def test_the_dry_run_checks_the_builder_api_of_the_refit_step(dry_run):
    """Issue 27: the refit step's plan names what the installed builder has, checked against
    the module itself."""
    log = dry_run.stdout
    assert "PLAN export -> build-embedded -> build-stripped -> refit" in log
    try:
        import tensorrt_rtx as trt
    except ImportError:
        assert "SKIP refit-api" in log or "PASS refit-api: tensorrt " in log
        return
    has = all(hasattr(trt.BuilderFlag, f) for f in ("REFIT_INDIVIDUAL", "STRIP_PLAN"))
    has &= hasattr(trt, "OnnxParserRefitter") and hasattr(trt, "Refitter")
    expected = "PASS refit-api" if has else "FAIL refit-api"
    assert expected in log and "PASS refit plan" in log


def test_the_dry_run_bandwidth_accounting_matches_the_kv_bytes(dry_run):
    lines = [x for x in dry_run.stdout.splitlines() if x.startswith("BANDWIDTH")]
    got = [float(re.search(r"bytes/call=(\S+)", x).group(1)) for x in lines]
    expected = [_decode_bytes(2, 40, 4, 2, 16, 2, 2), _decode_bytes(2, 40, 4, 2, 16, 1, 2)]
    assert got == pytest.approx(expected, rel=1e-3)


def test_the_step_caps_fit_the_8_minute_budget(dry_run):
    plan = re.search(
        r"build (\d+), kernels vs host build (\d+),\s+timings \+ bandwidth (\d+)", dry_run.stdout
    )
    assert plan, dry_run.stdout[:2000]
    assert sum(int(x) for x in plan.groups()) <= 480
    assert "budget 480 s" in dry_run.stdout


@pytest.mark.parametrize("args", [("--budget", "10"), ("--frobnicate",)])
def test_bad_arguments_exit_2(args, tmp_path):
    result = _run(*args, out=tmp_path, timeout=60)
    assert result.returncode == 2


def test_without_a_gpu_the_device_run_says_so(tmp_path):
    if shutil.which("nvidia-smi") is not None:
        pytest.skip("this machine has nvidia-smi: the device run would start")
    result = _run("--build-dir", str(tmp_path / "b"), out=tmp_path, timeout=60)
    assert result.returncode == 1
    assert "use --dry-run without one" in result.stdout
