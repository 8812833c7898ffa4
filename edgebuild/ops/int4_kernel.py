"""edgebuild's own int4 x bf16 linear for CPUs with Intel AMX (``kernels/int4_amx.cpp``).

Why: torch's ``_weight_int4pack_mm_for_cpu`` widens the 4-bit codes once per row group, so an
8-row DSpark verify cost 3.5x a 1-row decode in the linears (0.34 ms against 0.09 ms for the
3072 x 576 gate/up projection, bench/README.md) and int4 DSpark was slower than int4
target-only. This kernel widens each group of 32 codes once into an AMX tile and multiplies
up to 16 rows by it with one ``TDPBF16PS``: 8 rows cost ~1.3x one row, and one row is ~15%
faster than torch's kernel. Its result for a row does not depend on the other rows of the call
(a tile row depends only on its own input row), so DSpark stays bit-exact against target-only.

The C++ source is compiled at first use (:mod:`edgebuild.ops.cpu_build`: g++ and ninja, ~10 s
once, then cached). ``EDGEBUILD_INT4_KERNEL`` picks the kernel: ``auto`` (the
default: this one where the CPU has AMX-BF16 and it builds, else torch's, with one log line
saying why), ``amx`` (this one or an error) or ``torch`` (always torch's).

Weight format (:func:`pack`, from :func:`edgebuild.ops.linear.quantize_int4`'s codes): the
weight is ``code * scale + lo`` with ``lo = zero - 8 * scale`` (the same weight as torch's
``(code - 8) * scale + zero``), scales and ``lo`` in bf16 as torch's kernel uses them for
bf16 inputs.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import shutil
from pathlib import Path

import torch

from edgebuild.errors import MissingDependencyError
from edgebuild.ops import cpu_build

log = logging.getLogger("edgebuild.runtime")

SOURCE = Path(__file__).resolve().parent / "kernels" / "int4_amx.cpp"
ENV = "EDGEBUILD_INT4_KERNEL"
BLOCK = 16  # output features per column block of the packed layout
GROUP = 32  # input features per scale (INT4_GROUP_SIZE)
ISA_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]
# (built only where /proc/cpuinfo lists these: see _why_not)


def _why_not() -> str | None:
    """None when the AMX kernel can be tried here, else why not (one line)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"not an x86-64 Linux host ({platform.system()} {platform.machine()})"
    missing = {"amx_tile", "amx_bf16", "avx512_bf16", "avx512bw"} - cpu_build.cpu_flags()
    if missing:
        return f"the CPU lacks {', '.join(sorted(missing))}"
    if (
        shutil.which("g++") is None
        and shutil.which("c++") is None
        and cpu_build.prebuilt(SOURCE, ISA_FLAGS) is None
    ):
        return "no C++ compiler (g++) on PATH to build it"
    return None


@functools.cache
def _load() -> bool:
    """Build (once) and load the kernel library; True when ``edgebuild_cpu::int4_linear``
    runs here. Raises MissingDependencyError when ``EDGEBUILD_INT4_KERNEL=amx`` and it cannot."""
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "amx", "torch"):
        raise MissingDependencyError(f"{ENV}={mode!r}: use auto, amx or torch")
    if mode == "torch":
        return False
    why = _why_not()
    fixable = why is not None and "compiler" in why  # the CPU could run it: say so louder
    if why is None:
        try:
            cpu_build.build_and_load(SOURCE, ISA_FLAGS)
            if not torch.ops.edgebuild_cpu.int4_available():
                why = "the kernel refused AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
        except Exception as exc:  # a compiler or torch extension failure: fall back
            why = f"it could not be built or loaded ({cpu_build.first_error(exc)})"
            fixable = True
    if why is None:
        log.info("int4: edgebuild's AMX kernel (row-invariant, %s)", SOURCE.name)
        return True
    if mode == "amx":
        raise MissingDependencyError(f"{ENV}=amx: the AMX int4 kernel cannot run here: {why}")
    log.log(
        logging.WARNING if fixable else logging.INFO,
        "int4: torch's _weight_int4pack_mm_for_cpu (edgebuild's AMX kernel: %s)", why,
    )  # fmt: skip
    return False


def available() -> bool:
    """Whether :func:`linear` runs here (``EDGEBUILD_INT4_KERNEL`` and the CPU decide).

    Raises:
        MissingDependencyError: ``EDGEBUILD_INT4_KERNEL`` is ``amx`` and the kernel cannot
            run here, or it is not one of auto / amx / torch.
    """
    return _load()


def pack(codes: torch.Tensor, scale_and_zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout of :func:`~edgebuild.ops.linear.quantize_int4`'s output.

    Args:
        codes: int [N, K] values 0..15 (K a multiple of 32).
        scale_and_zero: fp32 [K / 32, N, 2] (scale, zero) per group and output feature.

    Returns:
        (w uint8 [ceil(N / 16), K / 4, 32], sc bf16 [ceil(N / 16), K / 32, 2, 16]); output
        features past N (padding to a whole block of 16) have zero codes and scales.
    """
    n, k = codes.shape
    nb = -(-n // BLOCK)
    pad = nb * BLOCK - n
    c = codes.to(torch.uint8)
    s, z = scale_and_zero[..., 0].t(), scale_and_zero[..., 1].t()  # [N, G]
    lo = z - 8.0 * s
    if pad:
        c = torch.cat([c, c.new_zeros(pad, k)])
        s, lo = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (s, lo))
    c = c.reshape(nb, BLOCK, k // 4, 2, 2)  # [block, column, quad, pair half, k in pair]
    w = (c[:, :, :, 0, :] | (c[:, :, :, 1, :] << 4)).permute(0, 2, 1, 3)  # byte = column*2 + k%2
    w = w.reshape(nb, k // 4, 2 * BLOCK).contiguous()
    g = k // GROUP
    sc = torch.stack([s, lo], 0).to(torch.bfloat16).reshape(2, nb, BLOCK, g)
    return w, sc.permute(1, 3, 0, 2).contiguous()


def linear(x: torch.Tensor, w: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """``x bf16 [rows, K] @ W.T`` for a :func:`pack`-ed W: bf16 [rows, 16 * w.shape[0]].

    Row-invariant: row i of the result does not depend on the other rows of ``x``.
    Call only when :func:`available` is True.
    """
    return torch.ops.edgebuild_cpu.int4_linear(x, w, sc)
