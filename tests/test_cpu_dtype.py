"""The compute dtype: bf16 where the CPU has native bf16 and it is the faster choice (AMX, Arm),
fp32 elsewhere; flags name choices."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from edgebuild.errors import ConfigError
from edgebuild.runtime import cpu

REAL_DEFAULT = cpu.default_compute_dtype  # captured at collection, before conftest's fp32 patch

SAPPHIRE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 avx512_vnni\n"
SKYLAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n"
ARM_V86 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
ORIN = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics\n"


@pytest.mark.parametrize(
    "text,native", [(SAPPHIRE, True), (SKYLAKE, False), (ARM_V86, True), (ORIN, False), ("", False)]
)
def test_native_bf16_is_read_from_the_cpu_flags(text, native):
    info = cpu.cpu_bf16_support(text)
    assert info.native is native
    assert info.reason.startswith("native bf16") is native


@pytest.mark.parametrize(
    "text,kernel,dtype",
    [
        (SAPPHIRE, True, torch.bfloat16),  # AMX: edgebuild's AMX bf16 kernel
        (ZEN4, True, torch.float32),  # avx512_bf16 without AMX: the fp32 kernel, bf16 weights
        (ZEN4, False, torch.bfloat16),  # ... unless that kernel cannot run
        (ARM_V86, False, torch.bfloat16),
        (SKYLAKE, True, torch.float32),
        (ORIN, False, torch.float32),
    ],
)
def test_the_default_dtype_is_the_faster_native_one(text, kernel, dtype):
    got, why = cpu.default_dtype_choice(cpu.cpu_bf16_support(text), fp32_kernel=kernel)
    assert got is dtype
    assert ("without AMX" in why) is (text == ZEN4 and kernel)


def test_the_default_dtype_never_raises_on_a_bad_kernel_switch(monkeypatch):
    from edgebuild.ops import f32_linear

    monkeypatch.setenv(f32_linear.ENV, "sse9")
    f32_linear._reset()
    try:
        got, why = cpu.default_dtype_choice(cpu.cpu_bf16_support(ZEN4))
        assert got is torch.bfloat16 and "without AMX" not in why  # no kernel: bf16
    finally:
        monkeypatch.delenv(f32_linear.ENV)
        f32_linear._reset()


def test_resolve_dtype_names_and_refusals():
    assert cpu.resolve_dtype("bf16") is torch.bfloat16
    assert cpu.resolve_dtype("float32") is torch.float32
    assert cpu.resolve_dtype(torch.bfloat16) is torch.bfloat16
    with pytest.raises(ConfigError, match="float16"):
        cpu.resolve_dtype("float16")
    with pytest.raises(ConfigError, match="not supported"):
        cpu.resolve_dtype(torch.float16)


def test_auto_follows_the_detection(monkeypatch):
    monkeypatch.setattr(cpu, "default_compute_dtype", REAL_DEFAULT)
    monkeypatch.setattr(cpu, "cpu_bf16_support", lambda text=None: cpu.CpuBf16(True, ("x",), ""))
    assert cpu.resolve_dtype("auto") is torch.bfloat16
    monkeypatch.setattr(cpu, "cpu_bf16_support", lambda text=None: cpu.CpuBf16(False, (), ""))
    assert cpu.resolve_dtype(None) is torch.float32


def test_default_threads_leave_one_core(monkeypatch):
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert cpu.default_cpu_threads() == 1
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert cpu.default_cpu_threads() == 7
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert cpu.default_cpu_threads() == 1


def test_run_refuses_an_unknown_dtype_by_name(tmp_path):
    from edgebuild.cli import main

    res = CliRunner().invoke(main, ["run", str(tmp_path), "--prompt", "x", "--dtype", "fp16"])
    assert res.exit_code == 2 and "fp16" in res.output
