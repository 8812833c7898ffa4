"""edgebuild's own linears for CPUs with Intel AMX (``kernels/amx_linear.cpp``): int4 and bf16
weights, bf16 activations, both row-invariant.

**int4** (:func:`pack` / :func:`linear`). Why: torch's ``_weight_int4pack_mm_for_cpu`` widens
the 4-bit codes once per row group, so an 8-row DSpark verify cost 3.5x a 1-row decode in the
linears (0.34 ms against 0.09 ms for the 3072 x 576 gate/up projection, bench/README.md) and
int4 DSpark was slower than int4 target-only. This kernel widens each group of 32 codes once
into an AMX tile and multiplies up to 16 rows by it with one ``TDPBF16PS``: 8 rows cost ~1.3x
one row. Weight format: ``code * scale + lo`` with ``lo = zero - 8 * scale`` (the same weight
as torch's ``(code - 8) * scale + zero``), scales and ``lo`` in bf16 as torch's kernel uses
them for bf16 inputs.

**bf16** (:func:`pack_bf16` / :func:`linear_bf16`). Why: oneDNN's packed bf16 linear read a
decode step's weights at 8.5-11.5 GB/s on one core of the AMX host, this kernel at 11-19 GB/s
(1.2-1.8x faster per linear, ``bench/amx_linear.py``), and oneDNN's result for a row changed
with the row count of the call (on an AMD host even between 1 and 2 rows), which cost a padded
second row per decode and a 64-row chunking. Here the weight is pre-arranged into AMX B tiles
(VNNI pairs) once at load and the C tile accumulates over all of K: one rounding per output.

A row's result never depends on the other rows of the call (an AMX tile row depends only on
its own input row), so DSpark's verify rows equal target-only's decode rows bit for bit.

The C++ source is compiled at first use (:mod:`edgebuild.ops.cpu_build`: g++ and ninja, ~10 s
once, then cached). Two switches pick the kernels, each ``auto`` by default (this library where
the CPU has AMX-BF16 and it builds, else the fallback, with one log line saying why):
``EDGEBUILD_INT4_KERNEL=auto|amx|torch`` (fallback: torch's int4 kernel) and
``EDGEBUILD_BF16_KERNEL=auto|amx|onednn`` (fallback under ``auto``: edgebuild's fp32 kernel on
the bf16 weights where it runs, :func:`edgebuild.ops.linear.bf16_on_f32_kernel`, else oneDNN's
packed linear; ``onednn``: always oneDNN's). ``amx`` means this kernel or an error.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

from edgebuild.errors import MissingDependencyError
from edgebuild.ops import cpu_build

log = logging.getLogger("edgebuild.runtime")

SOURCE = Path(__file__).resolve().parent / "kernels" / "amx_linear.cpp"
ENV = "EDGEBUILD_INT4_KERNEL"
BF16_ENV = "EDGEBUILD_BF16_KERNEL"
BLOCK = 16  # output features per column block of the packed layout
GROUP = 32  # input features per scale (INT4_GROUP_SIZE)
ISA_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]
NEEDS = {"amx_tile", "amx_bf16", "avx512_bf16", "avx512bw"}  # in /proc/cpuinfo
# (built only where /proc/cpuinfo lists these: see _why_not)


def _why_not() -> str | None:
    """None when the AMX kernel can be tried here, else why not (one line)."""
    return cpu_build.why_not_x86(SOURCE, ISA_FLAGS, NEEDS)


@functools.cache
def _library() -> tuple[str | None, bool]:
    """Build (once) and load the kernel library: (None, False) when it runs here, else (why
    not, whether the user can fix it, e.g. by installing g++)."""

    def probe() -> str | None:
        if torch.ops.edgebuild_cpu.int4_available():
            return None
        return "the kernel refused AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"

    return cpu_build.try_library(SOURCE, ISA_FLAGS, NEEDS, probe)


# kind -> (switch, the fallback's mode name, what runs instead)
_KINDS = {
    "int4": (ENV, "torch", "torch's _weight_int4pack_mm_for_cpu"),
    "bf16": (
        BF16_ENV,
        "onednn",
        "edgebuild's fp32 kernel on the bf16 weights where it runs "
        "(ops/linear.py bf16_on_f32_kernel), else oneDNN's packed linear",
    ),
}


def switch(kind: str) -> str:
    """The mode ``kind``'s switch asks for (int4: ``EDGEBUILD_INT4_KERNEL``, bf16:
    ``EDGEBUILD_BF16_KERNEL``): ``auto``, ``amx`` or the fallback's name (``torch`` /
    ``onednn``).

    Raises:
        MissingDependencyError: the switch holds another value (names it and the choices).
    """
    env, fallback, _ = _KINDS[kind]
    mode = os.environ.get(env, "auto").strip().lower() or "auto"
    if mode not in ("auto", "amx", fallback):
        raise MissingDependencyError(f"{env}={mode!r}: use auto, amx or {fallback}")
    return mode


@functools.cache
def _load(kind: str = "int4") -> bool:
    """True when this library's ``kind`` linear (int4 / bf16) runs here, as its switch says.
    Raises MissingDependencyError when the switch is ``amx`` and it cannot, or is unknown."""
    env, fallback, instead = _KINDS[kind]
    mode = switch(kind)
    if mode == fallback:
        return False
    why, fixable = _library()
    if why is None:
        log.info("%s: edgebuild's AMX kernel (row-invariant, %s)", kind, SOURCE.name)
        return True
    if mode == "amx":
        raise MissingDependencyError(f"{env}=amx: the AMX {kind} kernel cannot run here: {why}")
    log.log(
        logging.WARNING if fixable else logging.INFO,
        "%s: %s (edgebuild's AMX kernel: %s)", kind, instead, why,
    )  # fmt: skip
    return False


def _reset() -> None:
    """Forget what was decided (tests that change the switches or the CPU flags)."""
    _library.cache_clear()
    _load.cache_clear()
    from edgebuild.ops import linear  # decides from these switches (imports this module)

    linear.bf16_on_f32_kernel.cache_clear()


def available() -> bool:
    """Whether :func:`linear` (int4) runs here (``EDGEBUILD_INT4_KERNEL`` and the CPU decide).

    Raises:
        MissingDependencyError: ``EDGEBUILD_INT4_KERNEL`` is ``amx`` and the kernel cannot
            run here, or it is not one of auto / amx / torch.
    """
    return _load("int4")


def bf16_available() -> bool:
    """Whether :func:`linear_bf16` runs here (``EDGEBUILD_BF16_KERNEL`` and the CPU decide).

    Raises:
        MissingDependencyError: ``EDGEBUILD_BF16_KERNEL`` is ``amx`` and the kernel cannot
            run here, or it is not one of auto / amx / onednn.
    """
    return _load("bf16")


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


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """The bf16 kernel's layout of ``weight [N, K]`` (any float dtype, rounded to bf16).

    Returns:
        bf16 [ceil(N / 16), K / 32, 16, 32]: column block b, k chunk c, tile row r holds the
        VNNI pairs ``w[16b + j, 32c + 2r], w[16b + j, 32c + 2r + 1]`` at words 2j, 2j + 1;
        output features past N (padding to a whole block of 16) are zero.

    Raises:
        ValueError: K is not a multiple of 32 (callers fall back to oneDNN then).
    """
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"pack_bf16: input width {k} is not a multiple of {GROUP}")
    w = weight.detach().to(torch.bfloat16)
    nb = -(-n // BLOCK)
    if nb * BLOCK != n:
        w = torch.cat([w, w.new_zeros(nb * BLOCK - n, k)])
    w = w.reshape(nb, BLOCK, k // GROUP, 16, 2).permute(0, 2, 3, 1, 4)
    return w.reshape(nb, k // GROUP, 16, 2 * BLOCK).contiguous()


def linear_bf16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x bf16 [rows, K] @ W.T + bias`` for a :func:`pack_bf16`-ed W: bf16 [rows, 16 * w.shape[0]].

    fp32 accumulation over all of K, plus the fp32 bias, then one rounding to bf16. ``bias``:
    [16 * w.shape[0]] (padded to the packed width) or None. Row-invariant: row i of the result
    does not depend on the other rows of ``x``. Call only when :func:`bf16_available` is True.
    """
    return torch.ops.edgebuild_cpu.bf16_linear(x, w, bias)
