"""What this CPU can do for the torch runtime: native bf16 detection and the compute dtype.

The torch backend computes in bf16 by default where the CPU has native bf16 arithmetic
(x86: the ``avx512_bf16`` or ``amx_bf16`` flags of ``/proc/cpuinfo``; Arm: the ``bf16``
feature), and in fp32 elsewhere (emulated bf16 would be slower than fp32). ``--dtype`` on
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


def default_compute_dtype() -> torch.dtype:
    """bf16 where :func:`cpu_bf16_support` finds native bf16, else fp32."""
    import torch

    return torch.bfloat16 if cpu_bf16_support().native else torch.float32


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
    bf16 = cpu_bf16_support()
    dtype = "bfloat16" if bf16.native else "float32"
    return f"{platform.machine()}: {bf16.reason}; default compute dtype {dtype}"
