"""edgebuild's own fp32 linear for x86-64 CPUs with AVX2 + FMA (``kernels/f32_linear.cpp``).

Why: fp32 is the runtime's compute dtype on every CPU without native bf16 (most laptops, AVX2
only). There, MKL / oneDNN made a DSpark verify pass of a few rows cost much more than a decode
(2 rows 1.57x, 8 rows 1.96x one row, ``edgebuild/data/step_costs.json``), so fp32 DSpark was
slower than target-only (x0.88, issue 26), and a row's bits changed with the number of rows in
the call, so fp32 DSpark's output could differ from target-only's at near-ties.

This kernel packs the weight once at load into blocks of 16 output features, k-major
(``[ceil(out / 16), in, 16]``, :func:`pack`), reads each block once for up to six rows and
computes every row with the same instruction sequence whatever the rows beside it (per output,
each chunk of 32 k summed by FMAs in increasing k, then added to the running total, then
``+ bias``: more accurate than one long chain, and than MKL's sgemm on these shapes; where the
CPU has AVX-512, each chunk in two chains, its even and its odd k, added at its end:
:func:`avx512`).
A row's result therefore never depends on the other rows of the call or on the thread count:
fp32 DSpark's verify rows equal target-only's decode rows bit for bit.

The C++ source is compiled at first use (:mod:`edgebuild.ops.cpu_build`: g++ and ninja, ~10 s
once, then cached). ``EDGEBUILD_FP32_KERNEL=auto|avx2|torch`` picks the kernel: ``auto`` (the
default) uses it where the CPU has AVX2 and FMA and it builds, else torch's (MKL / oneDNN) with
one log line saying why; ``avx2`` means this kernel or an error; ``torch`` never uses it.
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

SOURCE = Path(__file__).resolve().parent / "kernels" / "f32_linear.cpp"
ENV = "EDGEBUILD_FP32_KERNEL"
WEIGHTS_ENV = "EDGEBUILD_FP32_WEIGHTS"  # auto | fp32: how pack stores weights (weight_storage)
ACT_ENV = "EDGEBUILD_INT4_ACTIVATIONS"  # int8 | fp32: int4 linears' inputs (int4_activations)
DEFAULT_INT4_ACTIVATIONS = "int8"
BLOCK = 16  # output features per packed block
# every x86-64 CPU that has AVX-512 has AVX2 + FMA too. -falign-loops=64: every inner loop starts
# a 64-byte line, so its speed does not hang on where unrelated code happens to place it (one
# build ran 4-row calls 14% slower than 5-row ones; bench/README.md, run of 2026-12-06)
ISA_FLAGS = ["-mavx2", "-mfma", "-falign-loops=64"]
NEEDS = {"avx2", "fma"}  # in /proc/cpuinfo


def _why_not() -> str | None:
    """None when the kernel can be tried here, else why not (one line)."""
    return cpu_build.why_not_x86(SOURCE, ISA_FLAGS, NEEDS)


@functools.cache
def _load() -> bool:
    """True when the kernel runs here, as ``EDGEBUILD_FP32_KERNEL`` says.

    Raises:
        MissingDependencyError: the switch is ``avx2`` and the kernel cannot run here, or the
            switch is not one of auto / avx2 / torch.
    """
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "avx2", "torch"):
        raise MissingDependencyError(f"{ENV}={mode!r}: use auto, avx2 or torch")
    if mode == "torch":
        return False
    why, fixable = cpu_build.try_library(
        SOURCE,
        ISA_FLAGS,
        NEEDS,
        lambda: None if torch.ops.edgebuild_f32.f32_available() else "the CPU reports no AVX2",
    )
    if why is None:
        log.info("fp32: edgebuild's kernel (row-invariant, %s)", SOURCE.name)
        return True
    if mode == "avx2":
        raise MissingDependencyError(f"{ENV}=avx2: edgebuild's fp32 kernel cannot run here: {why}")
    log.log(
        logging.WARNING if fixable else logging.INFO,
        "fp32: torch's linear (edgebuild's kernel: %s)", why,
    )  # fmt: skip
    return False


def available() -> bool:
    """Whether :func:`linear` runs here (``EDGEBUILD_FP32_KERNEL`` and the CPU decide).

    Raises:
        MissingDependencyError: ``EDGEBUILD_FP32_KERNEL`` is ``avx2`` and the kernel cannot
            run here, or it is not one of auto / avx2 / torch.
    """
    return _load()


@functools.cache
def int4_activations() -> str:
    """``"int8"`` or ``"fp32"``: how an int4 linear on an fp32 runtime treats its inputs, as
    ``EDGEBUILD_INT4_ACTIVATIONS`` says (read once). ``int8`` (the default): quantized per row
    and group of 32 to int8 in the kernel (:func:`linear_int4` with ``int8_inputs=True``, integer dot products);
    ``fp32``: used as they are (:func:`linear_int4`, the codes widened to fp32).

    Raises:
        MissingDependencyError: the switch is not int8 or fp32.
    """
    mode = os.environ.get(ACT_ENV, DEFAULT_INT4_ACTIVATIONS).strip().lower()
    mode = mode or DEFAULT_INT4_ACTIVATIONS
    if mode not in ("int8", "fp32"):
        raise MissingDependencyError(f"{ACT_ENV}={mode!r}: use int8 or fp32")
    return mode


def _reset() -> None:
    """Forget what was decided (tests that change the switches)."""
    _load.cache_clear()
    int4_activations.cache_clear()
    weight_storage.cache_clear()
    from edgebuild.ops import linear  # decides from this switch too (imports this module)

    linear.bf16_on_f32_kernel.cache_clear()


@functools.cache
def weight_storage() -> str:
    """``"auto"`` or ``"fp32"``: how :func:`pack` stores a weight, as
    ``EDGEBUILD_FP32_WEIGHTS`` says (read once). ``auto`` (the default): as bf16 where every
    value of the weight is exactly a bf16 (a bf16 checkpoint run in fp32), else fp32; ``fp32``:
    always fp32 (twice the bytes, the same results: for comparisons).

    Raises:
        MissingDependencyError: the switch is not auto or fp32.
    """
    mode = os.environ.get(WEIGHTS_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "fp32"):
        raise MissingDependencyError(f"{WEIGHTS_ENV}={mode!r}: use auto or fp32")
    return mode


def exactly_bf16(weight: torch.Tensor) -> bool:
    """Whether every value of ``weight`` (any shape, any float dtype) is exactly a bf16: its
    fp32 value's low 16 bits are all zero, so storing it as bf16 loses nothing (bf16 is the
    high half of fp32). A bf16 tensor is; an fp32 copy of a bf16 checkpoint is. One pass over
    the values (at packing, once)."""
    w = weight.detach()
    if w.dtype == torch.bfloat16:
        return True
    w = w.float().contiguous()
    return not bool((w.view(torch.int32) & 0xFFFF).any())


def pack(weight: torch.Tensor, storage: str | None = None) -> torch.Tensor:
    """The kernel's layout of a weight ``[out, in]`` (any float dtype, taken as fp32):
    ``[ceil(out / 16), in, 16]``, element ``[b, k, j] = weight[16 b + j, k]``; outputs past
    ``out`` (padding to a whole block) are zero. The layout is this project's own
    (``kernels/f32_linear.cpp`` reads it).

    Stored as fp32, or, where every value is exactly a bf16 (:func:`exactly_bf16`: any bf16
    checkpoint's weights run in fp32) and ``storage`` (default :func:`weight_storage`) is
    ``auto``, as bf16 with the 16 values of each ``[b, k]`` in the order of outputs 0-3, 8-11,
    4-7, 12-15 (the kernel widens them to fp32 with two in-lane unpacks). The kernel computes
    the same fp32 products from either (widening a bf16 is exact), so :func:`linear` gives the
    same bits (a NaN weight's payload aside: a NaN result either way); the bf16 copy is half the
    bytes a 1-row call streams from memory.
    """
    n, k = weight.shape
    nb = -(-n // BLOCK)
    storage = storage or weight_storage()
    bf16 = storage == "auto" and exactly_bf16(weight)
    w = weight.detach().to(torch.bfloat16 if bf16 else torch.float32)
    if nb * BLOCK != n:
        w = torch.cat([w, w.new_zeros(nb * BLOCK - n, k)])
    w = w.reshape(nb, BLOCK, k).transpose(1, 2)
    if bf16:  # [b, k, (half, quad, i)] -> [b, k, (quad, half, i)]: outputs 0-3, 8-11, 4-7, 12-15
        w = w.reshape(nb, k, 2, 2, 4).transpose(2, 3).reshape(nb, k, BLOCK)
    return w.contiguous()


def pack_bias(bias: torch.Tensor | None, packed: torch.Tensor) -> torch.Tensor | None:
    """``bias [out]`` as the kernels read it: fp32 ``[16 * blocks]`` (blocks =
    ``packed.shape[0]``, a :func:`pack` / :func:`pack_int4` weight), zero past ``out``; None
    for no bias."""
    if bias is None:
        return None
    b = bias.detach().float().reshape(-1)
    return torch.cat([b, b.new_zeros(packed.shape[0] * BLOCK - b.numel())])


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x fp32 [rows, in] @ W.T (+ bias)`` for a :func:`pack`-ed W (bias from
    :func:`pack_bias`): fp32 ``[rows, out_features]`` (any leading dims: ``x [..., in]`` gives
    ``[..., out_features]``; so for the other ops of this module).

    Optional steps run in the same call (a decoder layer's small ops, each row on its own):

    * ``norm_weight`` fp32 ``[in]``, ``eps``: the rows are first RMS-normalized as Hugging
      Face's ``LlamaRMSNorm`` does in fp32 (``w * (x * rsqrt(mean(x^2) + eps))``; the mean of
      squares summed in fp64, so it may differ from torch's fp32 sum in the last bit);
    * ``swiglu``: ``x`` is ``[rows, 2 * in]`` = gate | up and ``silu(gate) * up`` is multiplied
      (``silu(g) = g / (1 + exp(-g))``, exp by a Cephes polynomial, relative error < 2e-7);
    * ``residual`` fp32 of the result's shape: returns ``residual + x @ W.T (+ bias)``.

    Row-invariant: row i of the result does not depend on the other rows of ``x`` nor on the
    thread count. Call only when :func:`available` is True.

    Raises:
        RuntimeError: x is not fp32 [rows, in] (``2 * in`` with swiglu), w not a packed fp32 or bf16
            [blocks, in, 16], ``out_features`` does not fill the last block, the bias is not
            [16 * blocks], norm_weight not fp32 [in], residual not fp32 [rows, out_features],
            or both norm_weight and swiglu (the kernel's checks name the argument).
    """
    return torch.ops.edgebuild_f32.f32_linear(
        x, w, bias, out_features, norm_weight, eps, swiglu, residual
    )


def pack_int4(
    codes: torch.Tensor, scale_and_zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 kernel's layout of :func:`~edgebuild.ops.linear.quantize_int4`'s output.

    Args:
        codes: int [out, in] values 0..15 (``in`` a multiple of 32).
        scale_and_zero: fp32 [in / 32, out, 2] (scale, zero) per group and output feature.

    Returns:
        (codes uint8 [ceil(out / 16), in, 8]: byte j of block b and input k holds
        ``code[16 b + j, k]`` in its low nibble and ``code[16 b + 8 + j, k]`` in its high one;
        sl fp32 [ceil(out / 16), in / 32, 2, 16]: per block and group the 16 scales, then the
        16 ``lo = zero - 8 * scale``, so the weight is ``code * scale + lo``). Outputs past
        ``out`` (padding to a whole block) have zero codes, scales and lo.

    Raises:
        ValueError: ``in`` is not a multiple of 32, or the scales do not match the codes.
    """
    n, k = codes.shape
    if k % 32 or tuple(scale_and_zero.shape) != (k // 32, n, 2):
        raise ValueError(
            f"pack_int4: codes {tuple(codes.shape)} need in % 32 == 0 and scale_and_zero "
            f"[{k // 32}, {n}, 2], got {tuple(scale_and_zero.shape)}"
        )
    nb = -(-n // BLOCK)
    pad = nb * BLOCK - n
    c = codes.to(torch.uint8)
    s, z = scale_and_zero[..., 0].t().float(), scale_and_zero[..., 1].t().float()  # [out, G]
    lo = z - 8.0 * s
    if pad:
        c = torch.cat([c, c.new_zeros(pad, k)])
        s, lo = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (s, lo))
    c = c.reshape(nb, 2, 8, k).permute(0, 3, 1, 2)  # [block, k, half, j]
    packed = (c[:, :, 0, :] | (c[:, :, 1, :] << 4)).contiguous()
    sl = torch.stack([s, lo], 0).reshape(2, nb, BLOCK, k // 32).permute(1, 3, 0, 2)
    return packed, sl.contiguous()


def linear_int4(
    x: torch.Tensor,
    codes: torch.Tensor,
    sl: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    *,
    int8_inputs: bool = False,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x fp32 [rows, in] @ W.T (+ bias)`` for an int4 W (``W = code * scale + lo``):
    fp32 ``[rows, out_features]``, with the same optional ``norm_weight`` / ``eps``,
    ``swiglu`` and ``residual`` steps as :func:`linear` (before / after the product).

    * ``int8_inputs=False``: W packed by :func:`pack_int4`; its codes widened to fp32 in the
      kernel, the inputs used as they are.
    * ``int8_inputs=True``: W packed by :func:`pack_int4_a8`; each row of the (normalized /
      SwiGLU'ed) input quantized to int8 per group of 32 in the kernel (``sx = max|x| / 127``,
      ``xq = round(x / sx)``; integer dot products, as llama.cpp's Q4_1 x Q8_1 and
      onnxruntime's MatMulNBits at accuracy_level 4; AVX-512 VNNI ``vpdpbusd`` where the CPU
      has avx512_vnni / bw / vl, else AVX2 ``vpmaddubsw``: the same integer sums and fp32
      steps, so the same bits; :func:`a8_vnni`): the result equals within fp32 rounding
      ``sum_g sx_g * sum_k (code * scale + lo) * xq`` (+ bias).

    Row-invariant like :func:`linear`. Call only when :func:`available` is True.

    Raises:
        RuntimeError: x is not fp32 [rows, in] (``2 * in`` with swiglu) with ``in`` a positive
            multiple of 32, or the codes / scales / bias / norm_weight / residual do not have
            the pack function's shapes for it (the kernel's checks name the argument).
    """
    op = (
        torch.ops.edgebuild_f32.int4_a8_linear
        if int8_inputs
        else torch.ops.edgebuild_f32.int4_f32_linear
    )
    return op(x, codes, sl, bias, out_features, norm_weight, eps, swiglu, residual)


def a8_vnni(on: bool | None = None) -> bool:
    """Whether :func:`linear_int4` with ``int8_inputs=True`` (every W4A8 call, the C++ layer
    steps' too) runs its AVX-512 VNNI group loop (``vpdpbusd`` on a block's 16 outputs in one
    zmm) rather than the AVX2 one (``vpmaddubsw``): the same integer sums and fp32 steps, so
    the same bits, a 4-row linear ~22% faster on Zen 4 (bench/README.md, 2026-12-06). The
    default is the CPU's support (avx512_vnni, avx512bw, avx512vl) unless ``EDGEBUILD_A8_VNNI=0``
    (read once, at the kernel's first W4A8 call). ``on`` True / False switches it for the
    process (True only where the CPU has it); None only reads it. Call only when
    :func:`available` is True."""
    return bool(torch.ops.edgebuild_f32.a8_vnni(-1 if on is None else int(bool(on))))


def avx512(on: bool | None = None) -> bool:
    """Whether :func:`linear` (fp32 and bf16 weights, the C++ layer steps' too) runs its
    AVX-512 loop rather than the AVX2 one: a block's 16 outputs in one zmm and two FMA chains
    per output and chunk (the chunk's even and odd k, added at its end), so 1-3 rows are no
    longer bound by the FMA latency; all linears of a SmolLM2 token 6-29% faster at 2-8 rows
    on a Zen 4 core, 6-28% at two (``bench/f32_linears.py``, bench/README.md, 2026-12-06), one
    row not slower. The two loops sum in a different order, so their results differ in the
    last bits; each is row-invariant and thread-invariant. The default
    is the CPU's support (avx512f) unless ``EDGEBUILD_FP32_AVX512=0`` (read once, at the
    kernel's first fp32 call). ``on`` True / False switches it for the process (True only
    where the CPU has it); None only reads it. Call only when :func:`available` is True."""
    return bool(torch.ops.edgebuild_f32.f32_avx512(-1 if on is None else int(bool(on))))


def pack_int4_a8(
    codes: torch.Tensor, scale_and_zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8-activation int4 kernel's layout (:func:`linear_int4` with ``int8_inputs=True``) of
    :func:`~edgebuild.ops.linear.quantize_int4`'s output.

    Args:
        codes: int [out, in] values 0..15 (``in`` a multiple of 32).
        scale_and_zero: fp32 [in / 32, out, 2] (scale, zero) per group and output feature.

    Returns:
        (codes uint8 [ceil(out / 16), in / 32, 2, 128]: per block b of 16 outputs, group g
        of 32 inputs and half h, byte ``32 s + 4 j + i`` holds ``code[16 b + 8 h + j, 32 g +
        8 s + i]`` in its low nibble and ``code[16 b + 8 h + j, 32 g + 8 s + 4 + i]`` in its high one
        (h 0..1, s 0..3, j 0..7, i 0..3: one 32-byte load is 8 outputs x 8 inputs, each 32-bit
        lane one output's 4 consecutive inputs per nibble); sl fp32 [ceil(out / 16), in / 32,
        32]: per block and group, for half 0 then half 1, :func:`pack_int4`'s 8 scales, then
        the 8 ``lo = zero - 8 * scale``). Outputs past ``out`` have zero codes, scales and lo.

    Raises:
        ValueError: ``in`` is not a multiple of 32, or the scales do not match the codes.
    """
    n, k = codes.shape
    _, sl = pack_int4(codes, scale_and_zero)  # checks the shapes; the same scales and lo
    # [block, g, scale / lo, h, j] -> [block, g, h, scale / lo, j]
    sl = sl.reshape(sl.shape[0], k // 32, 2, 2, 8).permute(0, 1, 3, 2, 4)
    sl = sl.reshape(sl.shape[0], k // 32, 2 * BLOCK).contiguous()
    nb = sl.shape[0]
    c = codes.to(torch.uint8)
    if nb * BLOCK != n:
        c = torch.cat([c, c.new_zeros(nb * BLOCK - n, k)])
    # [block, h, j, g, s, nibble, i] -> [block, g, h, s, j, i, nibble]
    c = c.reshape(nb, 2, 8, k // 32, 4, 2, 4).permute(0, 3, 1, 4, 2, 6, 5)
    packed = (c[..., 0] | (c[..., 1] << 4)).reshape(nb, k // 32, 2, 128).contiguous()
    return packed, sl


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's own int8 quantization of ``x`` fp32 [rows, in] (``in`` a multiple of 32),
    as :func:`linear_int4` with ``int8_inputs=True`` does it: (xq int8 [rows, in], sx fp32 [rows, in / 32], ms fp32
    [rows, in / 32] = ``sx * sum(xq)`` per group). For tests and tools.

    Raises:
        RuntimeError: x is not fp32 [rows, in] with ``in`` a multiple of 32.
    """
    return torch.ops.edgebuild_f32.int8_rows(x)


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries along the last dim of fp32 ``x [..., V]``: (values fp32
    ``[..., k]``, indices int64 ``[..., k]``), best first.

    Order: larger values first, equal values by smaller index (a stable descending sort's
    order: ``torch.sort(x, descending=True, stable=True)`` cut to k), NaN above every number.
    edgebuild's kernel where it runs (one pass a row, ~27 us over a 49152-token vocabulary
    against ~90 us for ``torch.topk`` at one thread, bench/README.md); elsewhere ``torch.topk`` with its k
    entries put in that order (the same result, except which of several values tied at the
    k-th place are kept). The DSpark draft's top-k lattice uses it
    (:meth:`edgebuild.models.dspark.DSparkDraft.lattice`); the exported draft graph keeps
    ``TopK`` (its order among tied logits is TensorRT's), so the torch and engine drafts may
    propose differently at exact ties (verification keeps the output the target's).

    Raises:
        ValueError: ``k`` outside ``1..V``.
    """
    vocab = x.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"topk: k must be in 1..{vocab}, got {k}")
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.numel() and available():
        vals, idx = torch.ops.edgebuild_f32.topk_rows(x.reshape(-1, vocab), k)
        return vals.view(*x.shape[:-1], k), idx.view(*x.shape[:-1], k)
    vals, idx = x.topk(k, dim=-1)
    idx, order = idx.sort(dim=-1)  # ascending index, then a stable sort by value
    vals, order2 = vals.gather(-1, order).sort(dim=-1, descending=True, stable=True)
    return vals, idx.gather(-1, order2)


def markov_greedy(
    base: torch.Tensor,
    anchors: torch.Tensor,
    counts: torch.Tensor,
    k: int,
    token_map: torch.Tensor | None = None,
    w1: torch.Tensor | None = None,
    w2: torch.Tensor | None = None,
    gate: tuple[torch.Tensor, torch.Tensor] | None = None,
    h: torch.Tensor | None = None,
    conf: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The greedy Markov walk of DSpark blocks over their top-k candidates, in one call
    (spec §3 "Drafting" and "Top-k pruning"); None where edgebuild's kernel does not run.

    For request b and slot ``s < counts[b]``: the candidates are :func:`topk` of
    ``base[b, s]`` (best first, ties by lower index), mapped through ``token_map``; with
    ``prev`` the anchor (slot 0) or the token chosen at slot s - 1 and ``e = w1[prev]``, the
    score of candidate j is ``top_j + w2[cand_j] . u`` with ``u = e`` (vanilla) or
    ``sigmoid(gate_w [h_s; e] + gate_b) * e`` (gated), no bias without ``w1``; the choice is
    the first j of the largest score (NaN above every number), and the confidence
    ``sigmoid(h_s . cw[:d] (+ e . cw[d:]) + cb)``. Products and sums run in double: a choice is
    the argmax of its scores at double precision (the fp32 lattice of
    :meth:`edgebuild.models.dspark.DSparkDraft.lattice` may choose otherwise at scores tied
    within its rounding).

    Args:
        base: fp32 ``[B, n, V]`` base logits (over the token map's columns with one).
        anchors: int ``[B]`` each block's anchor token; counts: int ``[B]`` slots to walk
            (0..n).
        k: candidates per slot (1..V).
        token_map: int64 ``[V]`` column -> token id, or None (column j is token j).
        w1, w2: fp32 / bf16 ``[vocab, r]`` ``markov_w1`` / ``markov_w2`` weights, or None.
        gate: a gated head's fp32 ``(weight [r, d + r], bias [r])``, or None.
        h: ``[B, >= n, d]`` fp32 / bf16 post-norm hidden (for the gate and confidence).
        conf: the confidence head's ``(weight fp32 [d] or [d + r], bias)``, or None.

    Returns:
        ``(cand int64 [B, n, k], choice int64 [B, n], confidence fp32 [B, n])``: slots past
        ``counts[b]`` hold zeros (cand, choice) and ones (confidence).

    Raises:
        RuntimeError: from the kernel, on shapes or token ids that do not fit (named).
    """
    if not available() or base.dtype != torch.float32 or base.device.type != "cpu":
        return None
    w1, w2, gw, gb, cw, cb = markov_head_args(w1, w2, gate, conf)
    return torch.ops.edgebuild_f32.markov_greedy(
        base, anchors, counts, int(k), token_map, w1, w2, gw, gb, _flat(h), cw, cb
    )


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.is_contiguous() else t.contiguous()


def markov_head_args(
    w1: torch.Tensor | None,
    w2: torch.Tensor | None,
    gate: tuple[torch.Tensor, torch.Tensor] | None,
    conf: tuple[torch.Tensor, float] | None,
) -> tuple:
    """The head arguments of ``edgebuild_f32::markov_greedy`` as :func:`markov_greedy` passes
    them (also bound once by :meth:`edgebuild.models.dspark.DSparkDraft.draft_pass`'s
    arguments): ``(w1, w2, gate_w, gate_b, conf_w, conf_b)``, the tensors contiguous, the gate
    and confidence weights fp32, ``conf_b`` a float (0.0 without a confidence head). Inputs
    as :func:`markov_greedy`'s."""
    gw, gb = (None, None) if gate is None else (_flat(gate[0].float()), _flat(gate[1].float()))
    cw, cb = (None, 0.0) if conf is None else (_flat(conf[0].float()), float(conf[1]))
    return _flat(w1), _flat(w2), gw, gb, cw, cb


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of fp32 ``x [..., V]`` (int64 ``[...]``): the first index of the
    largest value, of the first NaN where there is one (torch's rule).

    Where edgebuild's kernel runs, :func:`topk` with k = 1 (the same rule: a stable descending
    order, NaN first): a SmolLM2 logits row in ~17 us against torch's ~55, and on edgebuild's
    thread pool, where torch's reduction ran an OpenMP region at two threads whose spinning
    worker then competed with the pool for the next pass's core (bench/README.md). Elsewhere
    ``torch.argmax``.
    """
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.numel() and available():
        return topk(x, 1)[1][..., 0]
    return x.argmax(-1)
