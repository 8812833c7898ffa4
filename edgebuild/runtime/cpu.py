"""What this CPU can do for the torch runtime: native bf16 detection and the compute dtype.

The torch backend computes in bf16 by default where the CPU has native bf16 arithmetic and bf16
is the faster choice (x86 with ``amx_bf16`` in ``/proc/cpuinfo``; Arm: the ``bf16`` feature),
and in fp32 elsewhere: emulated bf16 would be slower than fp32, and on x86 CPUs with
``avx512_bf16`` but no AMX edgebuild's fp32 kernel, which keeps a bf16 checkpoint's weights in
bf16, is faster than oneDNN's bf16 linear (:func:`default_dtype_choice`). ``--dtype`` on
``edgebuild run`` and ``edgellm-serve`` overrides the choice; parity checks use float32.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgebuild.errors import ConfigError

if TYPE_CHECKING:  # torch is imported lazily: the CLI imports this module for its choices
    import torch

DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}
DTYPE_CHOICES = ("auto", "bfloat16", "float32")
_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


@dataclass(frozen=True)
class CpuBf16:
    """Native bf16 support: ``native`` and the evidence (``flags`` found, or why not)."""

    native: bool
    flags: tuple[str, ...]
    reason: str


def cpu_bf16_support(cpuinfo: str | None = None) -> CpuBf16:
    """Whether this CPU computes bf16 natively, from the flags in ``/proc/cpuinfo``.

    Args:
        cpuinfo: the text of ``/proc/cpuinfo`` (read from the system when None; tests pass
            their own).

    Returns:
        CpuBf16 with the bf16 flags found (``avx512_bf16``, ``amx_bf16``, Arm ``bf16``).
    """
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        try:
            cpuinfo = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            return CpuBf16(False, (), f"cannot read {path} ({exc}); assuming no native bf16")
    words: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            words.update(value.split())
    found = tuple(f for f in _BF16_FLAGS if f in words)
    if found:
        return CpuBf16(True, found, f"native bf16 ({', '.join(found)})")
    return CpuBf16(False, (), f"no native bf16 flag ({'/'.join(_BF16_FLAGS)}) on this CPU")


def default_dtype_choice(
    info: CpuBf16 | None = None, fp32_kernel: bool | None = None
) -> tuple[torch.dtype, str]:
    """The runtime's default compute dtype here, and why (one line).

    bf16 where the CPU computes it natively and bf16 is the faster choice: AMX-BF16 (edgebuild's
    AMX bf16 kernel, :mod:`edgebuild.ops.amx_linear`) or Arm's ``bf16``. fp32 on CPUs without
    native bf16, and also on x86 CPUs with ``avx512_bf16`` but no AMX (AMD Zen 4 / 5, Intel
    Cooper Lake) where edgebuild's fp32 kernel runs: there a bf16 step runs its layers' small
    ops as torch ops in a Python loop (its linears on that kernel too,
    :func:`edgebuild.ops.linear.bf16_on_f32_kernel`), while fp32 runs the fused C++ layer loop
    and keeps a bf16 checkpoint's weights in bf16 (the same bytes, exact fp32 math):
    SmolLM2-135M decoded at 62.8-69.6 tok/s in fp32 against 47.2 in bf16 (24.4 on oneDNN's
    bf16 linears) on a Zen 4 core at one thread (bench/README.md, 2026-12-05).

    Args:
        info: the CPU's bf16 support (:func:`cpu_bf16_support` of this machine when None).
        fp32_kernel: whether edgebuild's fp32 kernel runs here
            (:func:`edgebuild.ops.f32_linear.available`, asked only when it decides: the first
            such call builds the kernel, ~10 s once; a bad ``EDGEBUILD_FP32_KERNEL`` counts as
            no kernel here). Never raises.
    """
    import torch

    info = info or cpu_bf16_support()
    if not info.native:
        return torch.float32, info.reason
    if "avx512_bf16" in info.flags and "amx_bf16" not in info.flags:
        if fp32_kernel is None:
            from edgebuild.errors import MissingDependencyError
            from edgebuild.ops import f32_linear

            try:
                fp32_kernel = f32_linear.available()
            except MissingDependencyError:  # a bad EDGEBUILD_FP32_KERNEL: the kernel's own
                fp32_kernel = False  # error comes when a linear is packed, not from here
        if fp32_kernel:
            return torch.float32, (
                f"{info.reason} without AMX: fp32 on edgebuild's kernels (bf16 weights kept as "
                "bf16, fp32 math, the fused layer loop) is faster than bf16 here"
            )
    return torch.bfloat16, info.reason


def default_compute_dtype() -> torch.dtype:
    """The runtime's default compute dtype on this machine (:func:`default_dtype_choice`)."""
    return default_dtype_choice()[0]


def resolve_dtype(value: str | torch.dtype | None) -> torch.dtype:
    """A compute dtype from a flag value: ``auto`` / None (:func:`default_compute_dtype`),
    ``bfloat16`` / ``bf16``, ``float32`` / ``fp32``, or a torch dtype.

    Raises:
        ConfigError: any other name or dtype (lists the choices).
    """
    import torch

    if value is None or value == "auto":
        return default_compute_dtype()
    if isinstance(value, torch.dtype):
        if value in (torch.bfloat16, torch.float32):
            return value
        raise ConfigError(f"compute dtype {value} is not supported; use bfloat16 or float32")
    name = DTYPE_NAMES.get(str(value).lower())
    if name is None:
        raise ConfigError(f"--dtype {value!r} is not supported; choose one of {DTYPE_CHOICES}")
    return getattr(torch, name)


def default_cpu_threads() -> int:
    """Intra-op threads when none are asked for: the usable cores minus one, at least 1.

    Measured on the 2-core host (bench/README.md): with one core busy elsewhere, two OpenMP
    threads collapse (DSpark 0.45 tok/s against 9 with one thread), while one thread loses
    little on a quiet machine; leaving a core free also keeps the server's event loop live.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


def set_cpu_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (``threads`` or :func:`default_cpu_threads`); returns it.

    Raises:
        ConfigError: threads < 1.
    """
    import torch

    n = default_cpu_threads() if threads is None else int(threads)
    if n < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(n)
    return n


def describe_cpu() -> str:
    """One line for logs and ``edgebuild doctor``: machine, bf16 support, default dtype."""
    dtype, why = default_dtype_choice()
    name = str(dtype).removeprefix("torch.")
    return f"{platform.machine()}: {why}; default compute dtype {name}"
