"""Linear layers packed once at load for the CPU runtime (fused, oneDNN-blocked, row-invariant).

The models keep their ``nn.Linear`` modules, named as the checkpoint (``q_proj``, ``gate_proj``,
...), for loading, ``state_dict`` and export. For eager CPU inference a model may additionally
hold :class:`PackedLinear` copies: several linears that read the same input fused along their
output features (q/k/v, gate/up), with the weight reordered once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the format inductor's CPU freezing pass uses).

Why, measured on the 2-core AVX512-BF16 host (bench/README.md): a bf16 ``F.linear`` with one
row reads its weight at about half the bandwidth of the packed kernel, and ``F.linear``'s
result for a row changes with the number of rows in the call (above 32 rows in bf16) while the
packed bf16 kernel's does not up to ``MAX_INVARIANT_ROWS`` (from 2 rows up: on an AMD EPYC
AVX512-BF16 host oneDNN reduces a lone row in another order, so one row runs as the first
row of a 2-row call). Calls with more rows are split into
chunks of at most that many rows, so in bf16 the bits of a row never depend on how many rows
share a pass (tests/test_batch_invariance.py checks this for every packed shape of the real
model). On CPUs with AMX-BF16 a bf16 linear runs edgebuild's own kernel instead
(:mod:`edgebuild.ops.amx_linear`, ``EDGEBUILD_BF16_KERNEL``): row-invariant for every row
count, no padded single row, no chunking, and 1.2-1.8x faster per decode linear than oneDNN
on the AMX host (bench/README.md). Without AMX, where edgebuild's fp32 kernel runs, a bf16
linear runs that kernel on its bf16 weights (:func:`bf16_on_f32_kernel`: fp32 accumulation,
one rounding to bf16, row-invariant; a bf16 decode ~2x faster than on oneDNN on a Zen 4 core).
fp32 runs edgebuild's own kernel on every x86-64 CPU with AVX2 + FMA
(:mod:`edgebuild.ops.f32_linear`, ``EDGEBUILD_FP32_KERNEL``): row-invariant for every row
count, and one weight read serves up to 6 rows. Without it (other CPUs, or the
switch at ``torch``) fp32 is not row-invariant (MKL's and oneDNN's fp32 results for a row both
change with the row count): a 1-row fp32 call runs ``F.linear`` on the fused weight (faster
than the packed kernel for one row), more rows the packed kernel (faster for 8 rows).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from edgebuild.ops import amx_linear, f32_linear
from edgebuild.ops.threads import converted

MAX_INVARIANT_ROWS = 64  # rows per oneDNN call (checked row-invariant at 1 and 2 threads)
QUANT_MODES = ("int8", "int4")  # weight-only modes of PackedLinear (opt-in: `--quant ...`)
INT4_GROUP_SIZE = 32  # input features per int4 scale / zero (onnxruntime-genai's block size)


@functools.cache
def packing_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN packed linears can run here for ``dtype`` (fp32 / bf16 on mkldnn builds).

    Probed once per dtype by packing and running a tiny weight: oneDNN's bf16 path needs
    AVX512-BW/VL/DQ or AVX-NE-CONVERT, which a torch build with mkldnn does not guarantee
    (``mkldnn_reorder_linear_weight: bf16 path needs the cpu support ...`` on AVX2 hosts).
    Without it the linears run ``F.linear`` (correct, but not row-invariant in bf16).
    """
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype), 1)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), w, None, "none", [], "")
    except RuntimeError:
        return False
    return True


class PackedLinear:
    """One or more linears over the same input, fused along out features and packed.

    Args:
        linears: modules with ``weight [out_i, in]`` (all the same ``in`` and dtype) and
            optional ``bias [out_i]``.
        quant: None (the weights as they are) or ``"int8"``: weight-only symmetric int8 with
            one scale per output feature (``scale = max|w| / 127``, ``w_q = round(w / scale)``),
            run by ``torch.ops.aten._weight_int8pack_mm`` (half the bytes of bf16; outputs
            differ from the unquantized model's, so it is opt-in); or ``"int4"``: weight-only
            asymmetric 4-bit, one scale and zero per ``INT4_GROUP_SIZE`` input features of each
            output feature (:func:`quantize_int4`), run for fp32 inputs on CPUs with AVX2 +
            FMA by edgebuild's kernels (:func:`edgebuild.ops.f32_linear.linear_int4`, by
            default: each input row quantized to int8 per group of 32 in the kernel, integer
            dot products; or, with ``EDGEBUILD_INT4_ACTIVATIONS=fp32``, :func:`~edgebuild.ops.
            f32_linear.linear_int4`, fp32 inputs: on an AVX2 host torch's int4 kernel took
            97 ms for SmolLM2's lm_head row, this one 2.9),
            for bf16 inputs on CPUs with AMX by edgebuild's own kernel
            (:mod:`edgebuild.ops.amx_linear`: an 8-row verify costs about what one row does),
            else by ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (a quarter of bf16's
            bytes). All give a row the same bits whatever the rows beside it, so DSpark equals
            int4 target-only.

    ``int4_activations`` (``"int8"`` or ``"fp32"``): for ``"int4"`` on edgebuild's AVX2 kernel,
    how this linear treats its inputs whatever ``EDGEBUILD_INT4_ACTIVATIONS`` says (a DSpark
    draft's ``fc`` takes target features of any range: fp32).

    Calling it maps ``x [..., in]`` to ``[..., sum(out_i)]`` in x's dtype, the concatenation
    of each module's output, in order (equal within rounding to ``torch.cat([m(x) ...])``).
    Holds its own copy of the weights (the modules keep theirs for state_dict and export).

    Raises:
        ValueError: modules whose input width or dtype differ, an unknown ``quant``, or
            ``"int4"`` with an input width that is not a multiple of ``INT4_GROUP_SIZE``.
        MissingDependencyError: ``"int4"`` on an fp32 runtime with a bad
            ``EDGEBUILD_INT4_ACTIVATIONS`` (not int8 or fp32).
    """

    def __init__(
        self,
        linears: list[nn.Linear],
        quant: str | None = None,
        int4_activations: str | None = None,
    ):
        weights = [m.weight.detach() for m in linears]
        if len({w.shape[1] for w in weights}) != 1 or len({w.dtype for w in weights}) != 1:
            raise ValueError(
                "PackedLinear: fused linears must share the input width and dtype, got "
                f"{[(tuple(w.shape), w.dtype) for w in weights]}"
            )
        fused = torch.cat(weights, dim=0).contiguous()
        self.in_features, self.out_features = fused.shape[1], fused.shape[0]
        self.splits = [w.shape[0] for w in weights]
        self.dtype = fused.dtype
        biases = [m.bias for m in linears]
        if any(b is not None for b in biases):
            self.bias = torch.cat(
                [
                    b.detach() if b is not None else fused.new_zeros(w.shape[0])
                    for b, w in zip(biases, weights, strict=True)
                ]
            )
        else:
            self.bias = None
        if int4_activations not in (None, "int8", "fp32"):
            raise ValueError(
                f"PackedLinear: int4_activations {int4_activations!r} is not int8 or fp32"
            )
        if quant is not None and quant not in QUANT_MODES:
            raise ValueError(f"PackedLinear: quant {quant!r} is not one of {QUANT_MODES}")
        self.quant = quant
        self.single_row = None
        self.pad_single = False
        self._scales_as: dict[torch.dtype, torch.Tensor] = {}  # the scales in each input dtype
        self.int4_amx = self.bf16_amx = False  # edgebuild's AMX kernels (ops/amx_linear.py)
        self.f32_kernel = self.int4_f32 = False  # edgebuild's AVX2 kernels (ops/f32_linear.py)
        self.int4_a8 = False  # the AVX2 int4 kernel with int8-quantized inputs
        self.bf16_f32 = False  # bf16 weights and activations on the fp32 kernel (no AMX)
        self._int4_act = int4_activations  # None: as EDGEBUILD_INT4_ACTIVATIONS says
        if quant == "int8":
            scale = fused.float().abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [out]
            q = (fused.float() / scale[:, None]).round().clamp(-127, 127)
            self.weight, self.scales, self.packed = q.to(torch.int8).contiguous(), scale, True
            return
        if quant == "int4":
            self._init_int4(fused)
            return
        self.bf16_amx = (
            fused.dtype == torch.bfloat16
            and self.in_features % amx_linear.GROUP == 0
            and amx_linear.bf16_available()
        )
        if self.bf16_amx:  # edgebuild's AMX bf16 kernel: row-invariant for any row count
            self.weight, self.packed = amx_linear.pack_bf16(fused), True
            if self.bias is not None:
                pad = self.weight.shape[0] * amx_linear.BLOCK - self.out_features
                self._amx_bias = torch.cat([self.bias.float(), self.bias.new_zeros(pad).float()])
            else:
                self._amx_bias = None
            return
        # bf16 without AMX: edgebuild's fp32 kernel on the bf16 weights (fp32 accumulation,
        # rounded to bf16 once per output, as oneDNN's bf16 linear; row-invariant)
        self.bf16_f32 = fused.dtype == torch.bfloat16 and bf16_on_f32_kernel()
        self.f32_kernel = fused.dtype == torch.float32 and f32_linear.available()
        if self.f32_kernel or self.bf16_f32:  # edgebuild's fp32 kernel: row-invariant
            self.weight, self.packed = f32_linear.pack(fused), True
            self._f32_bias = f32_linear.pack_bias(self.bias, self.weight)
            return
        self.packed = packing_available(fused.dtype)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(fused, 1) if self.packed else fused
        # fp32 is not row-invariant either way: one row is faster through F.linear (MKL gemv)
        self.single_row = fused if self.packed and fused.dtype == torch.float32 else None
        # bf16: oneDNN may take another reduction order for a 1-row call than for 2..64 rows
        # (seen on an AMD EPYC AVX512-BF16 host for in=1536: M=1 differs from M>=8 while M=2
        # equals every M up to 64), so a single row runs as the first row of a 2-row call.
        self.pad_single = self.packed and fused.dtype == torch.bfloat16

    def _init_int4(self, fused: torch.Tensor) -> None:
        """Quantize ``fused`` to int4 and pack it for the kernel that will run it: edgebuild's
        AVX2 kernel for fp32 inputs (with the inputs quantized to int8 in the kernel, or as
        they are: ``EDGEBUILD_INT4_ACTIVATIONS``), its AMX kernel for bf16 inputs, else
        torch's.

        Raises:
            MissingDependencyError: ``EDGEBUILD_INT4_ACTIVATIONS`` is not int8 or fp32.
        """
        codes, self.scales = quantize_int4(fused)
        self.packed = True
        if fused.dtype == torch.float32 and f32_linear.available():
            act = self._int4_act or f32_linear.int4_activations()
            self.int4_a8 = act == "int8"
            pack = f32_linear.pack_int4_a8 if self.int4_a8 else f32_linear.pack_int4
            self.weight, self._int4_sl = pack(codes, self.scales)
            self._f32_bias = f32_linear.pack_bias(self.bias, self.weight)
            self.int4_f32 = True  # edgebuild's AVX2 int4 kernel, fp32 runtime
            return
        if fused.dtype == torch.bfloat16 and amx_linear.available():
            self.weight, self._amx_scales = amx_linear.pack(codes, self.scales)
            self.int4_amx = True  # edgebuild's AMX kernel (ops/amx_linear.py)
            return
        pad = -codes.shape[0] % 16  # torch's packing takes whole blocks of 16 outputs
        if pad:
            codes = torch.cat([codes, codes.new_zeros(pad, codes.shape[1])])
            self.scales = torch.cat(
                [self.scales, self.scales.new_zeros(self.scales.shape[0], pad, 2)], dim=1
            )
        self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)

    def __call__(
        self,
        x: torch.Tensor,
        norm: nn.Module | None = None,
        *,
        swiglu: bool = False,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[..., in]`` -> ``[..., out]``, with a decoder layer's small ops around it.

        Args:
            x: ``[..., in]`` (``[..., 2 * in]`` with ``swiglu``).
            norm: an RMSNorm module (``weight [in]``, ``eps``) applied to ``x`` first.
            swiglu: ``x`` is gate | up; ``silu(gate) * up`` is multiplied.
            residual: ``[..., out]``, the result's shape and dtype (the fused kernels refuse
                another; they do not broadcast); returns ``residual + linear(x)``.

        With edgebuild's fp32 / int4 kernels (:mod:`edgebuild.ops.f32_linear`) these steps
        run inside the kernel's call (one call for what were ~10 torch ops); otherwise as the
        torch ops :class:`~edgebuild.models.common.RMSNorm`, ``F.silu`` and ``+``.
        """
        if self.f32_kernel or self.int4_f32:  # fp32 weights / runtime: the kernels' own path
            return self._fused(x.float(), norm, swiglu, residual)
        if norm is not None:
            x = norm(x)
        if swiglu:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        y = self._linear(x)
        return y if residual is None else residual + y

    def _fused(
        self,
        x: torch.Tensor,
        norm: nn.Module | None,
        swiglu: bool,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:
        """The fp32 / int4 kernels' call with the norm / swiglu / residual steps inside."""
        nw, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
        op, lead = self.kernel_call()
        return op(x, *lead, nw, eps, swiglu, residual)

    def kernel_call(self) -> tuple[object, tuple] | None:
        """``(op, lead)`` such that ``op(x, *lead, norm_weight, eps, swiglu, residual)`` is this
        linear's fused call (:meth:`__call__` with fp32 ``x [..., in]``), or None when its
        weights do not run on edgebuild's fp32 / int4 kernels.

        The op is :func:`edgebuild.ops.f32_linear.linear` / ``linear_int4``'s registered
        operator, called directly: it takes ``x [..., in]`` and returns ``[..., out]`` (no
        reshapes, ~3 us a call). A decode step's layer loop binds these once
        (:class:`edgebuild.models.common.FusedLayers`).
        """
        ops = torch.ops.edgebuild_f32
        if self.bf16_f32:  # bf16 activations: not the fp32 layer loop's
            return None
        if self.f32_kernel:
            return ops.f32_linear, (self.weight, self._f32_bias, self.out_features)
        if self.int4_f32:
            op = ops.int4_a8_linear if self.int4_a8 else ops.int4_f32_linear
            return op, (self.weight, self._int4_sl, self._f32_bias, self.out_features)
        return None

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if not self.packed:
            return F.linear(x2, self.weight, self.bias).reshape(*lead, self.out_features)
        if x2.dtype != self.dtype:
            x2 = x2.to(self.dtype)
        rows = x2.shape[0]
        if self.bf16_f32:  # bf16 in and out, the fp32 kernel between (one rounding)
            y = f32_linear.linear(x2.float(), self.weight, self._f32_bias, self.out_features)
            y = converted(y, self.dtype)  # a head's rows: no OpenMP region (ops/threads.py)
        elif self.bf16_amx:
            y = amx_linear.linear_bf16(x2, self.weight, self._amx_bias)
            if y.shape[1] != self.out_features:  # padded to a whole block of 16
                y = y[:, : self.out_features]
        elif rows == 1 and self.single_row is not None:
            y = F.linear(x2, self.single_row, self.bias)
        elif rows == 1 and self.pad_single:
            y = self._mm(x2.repeat(2, 1))[:1]
        elif rows <= MAX_INVARIANT_ROWS:
            y = self._mm(x2)
        else:
            y = torch.cat(
                [
                    self._mm(x2[i : i + MAX_INVARIANT_ROWS])
                    for i in range(0, rows, MAX_INVARIANT_ROWS)
                ]
            )
        return y.reshape(*lead, self.out_features)

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        if self.quant == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, self._scales(x2.dtype))
            return y if self.bias is None else y + self.bias.to(y.dtype)
        if self.int4_amx:
            y = amx_linear.linear(x2, self.weight, self._amx_scales)
            if y.shape[1] != self.out_features:
                y = y[:, : self.out_features]
            return y if self.bias is None else y + self.bias.to(y.dtype)
        if self.quant == "int4":
            sz = self._scales(x2.dtype)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.weight, INT4_GROUP_SIZE, sz)
            if y.shape[1] != self.out_features:  # padded to a whole block of 16
                y = y[:, : self.out_features]
            return y if self.bias is None else y + self.bias.to(y.dtype)
        return torch.ops.mkldnn._linear_pointwise(x2, self.weight, self.bias, "none", [], "")

    def _scales(self, dtype: torch.dtype) -> torch.Tensor:
        """The fp32 scales (int8 [out]; int4 scale_and_zero [in / group, out, 2]) in
        ``dtype``, converted once: a bf16 decode step converted every layer's scales on
        every call (15% of an int4 step, the lm_head's 1.8M alone; bench/README.md)."""
        sz = self._scales_as.get(dtype)
        if sz is None:
            sz = self._scales_as[dtype] = self.scales.to(dtype)
        return sz


def quantize_int4(
    weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise 4-bit codes of ``weight [out, in]`` (any float dtype).

    Per output feature and group of ``group_size`` input features: ``scale = (max - min) / 15``,
    ``code = round((w - min) / scale)`` in 0..15, ``zero = min + 8 * scale``; the weight the
    kernel uses is ``(code - 8) * scale + zero`` (:func:`dequantize_int4`).

    Returns:
        (codes int32 [out, in], scale_and_zero fp32 [in / group_size, out, 2]), the layout of
        ``torch.ops.aten._convert_weight_to_int4pack_for_cpu`` / ``_weight_int4pack_mm_for_cpu``.

    Raises:
        ValueError: ``in`` is not a multiple of ``group_size`` (names the width and the fix).
    """
    out, k = weight.shape
    if k % group_size:
        raise ValueError(
            f"--quant int4: input width {k} is not a multiple of the group size {group_size}; "
            "use --quant int8 (or no --quant) for this model"
        )
    w = weight.detach().float().reshape(out, k // group_size, group_size)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    codes = ((w - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    zero = lo + 8.0 * scale
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()
    return codes.reshape(out, k), sz


def dequantize_int4(
    codes: torch.Tensor, scale_and_zero: torch.Tensor, group_size: int = INT4_GROUP_SIZE
) -> torch.Tensor:
    """fp32 [out, in] weight of :func:`quantize_int4`'s ``codes`` and ``scale_and_zero``."""
    out, k = codes.shape
    sz = scale_and_zero.transpose(0, 1)  # [out, groups, 2]
    c = codes.float().reshape(out, k // group_size, group_size)
    return ((c - 8.0) * sz[..., :1] + sz[..., 1:]).reshape(out, k)


@functools.cache
def bf16_on_f32_kernel() -> bool:
    """Whether bf16 linears run edgebuild's fp32 kernel on their bf16 weights here: where
    AMX's bf16 kernel does not run (:func:`edgebuild.ops.amx_linear.bf16_available`), the fp32
    kernel does (:func:`edgebuild.ops.f32_linear.available`) and ``EDGEBUILD_BF16_KERNEL`` is
    not ``onednn``. Each output is accumulated in fp32 over the exact products of bf16 inputs
    and weights and rounded to bf16 once, as oneDNN's bf16 linear does (in another order), and
    a row's bits never depend on the rows beside it. Why: on a Zen 4 core (``avx512_bf16``,
    no AMX) SmolLM2-135M's bf16 decode ran at 24.4 tok/s on oneDNN's bf16 linears, 47.2 on
    this kernel (15.5 / 48.7 at two threads; bench/README.md).
    """
    if amx_linear.switch("bf16") == "onednn":
        return False
    return not amx_linear.bf16_available() and f32_linear.available()


def use_packed(packed: PackedLinear | None) -> bool:
    """True when an eager CPU forward should run ``packed`` (never under export / compile)."""
    return packed is not None and not (
        torch.compiler.is_exporting() or torch.compiler.is_compiling()
    )
