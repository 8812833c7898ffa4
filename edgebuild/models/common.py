"""Pieces shared by the model definitions: the paged-batch metadata, the attention call, the
pre-norm decoder block and its SwiGLU MLP (the target's and the draft's), weight helpers.

Models never import the runtime: the runtime builds a :class:`PagedBatch` and passes per-layer
KV pools in; models call :mod:`edgebuild.ops` for attention, RoPE and norms.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from edgebuild.checkpoint.quant import QuantizedWeight
from edgebuild.checkpoint.shapes import check_shape, layer_linear_shapes  # noqa: F401 (re-export)
from edgebuild.ops.attention import AttentionSpec
from edgebuild.ops.linear import PackedLinear, use_packed


@dataclass
class PagedBatch:
    """Where the new rows of a step go in the paged KV cache.

    Attributes:
        page_table: int32 [B, max_pages_per_seq], physical page ids per sequence.
        past_lengths: int32 [B], rows already valid in the cache per sequence.
        input_lengths: int32 [B], valid new rows per sequence (the rest of S is padding).
        positions: int32 [B, S], RoPE position of each new row.
        prefill: the new rows are prompt rows: the attention takes the chunk-invariant
            prefill path (ops/attention_fast.py), whatever their count.
    """

    page_table: torch.Tensor
    past_lengths: torch.Tensor
    input_lengths: torch.Tensor
    positions: torch.Tensor
    prefill: bool = False
    _plans: dict = field(default_factory=dict, repr=False)
    flat_valid: torch.Tensor | None = field(default=None, repr=False)

    def packed_rows(self) -> torch.Tensor | None:
        """bool [B, S] valid rows when this step is worth running unpadded, else None.

        A step whose sequences have unequal row counts (a verify pass with per-request
        lengths, prompt chunks of different lengths batched together) runs its linears over
        the valid rows only (``[1, N, d]``, N = sum of input_lengths), so it costs what its
        rows cost, not B x the longest row count; the attention pads them back to
        ``[B, S]`` for its plan, the layout it always sees. Row results are the same either
        way (the packed linears are row-invariant), so this is a speed choice only.
        """
        bsz, rows = self.positions.shape
        n = int(self.input_lengths.sum())
        if bsz < 2 or n == bsz * rows:
            return None
        return torch.arange(rows)[None, :] < self.input_lengths.long()[:, None]

    def plan(self, rows: int, page_size: int, causal: bool, write_kv: bool):
        """The eager fast path's DensePlan for this step (built once, shared by all layers)."""
        from edgebuild.ops.attention_fast import DensePlan

        key = (rows, page_size, causal, write_kv)
        if key not in self._plans:
            self._plans[key] = DensePlan.build(
                self.page_table,
                self.past_lengths,
                self.input_lengths,
                rows,
                page_size,
                causal,
                write_kv,
                self.prefill,
            )
        return self._plans[key]

    def kernel_plan(self, rows: int, page_size: int, causal: bool, write_kv: bool):
        """The step's :class:`~edgebuild.ops.attention_fast.KernelPlan` (what the C++ steps
        read; built once, shared by all layers)."""
        from edgebuild.ops.attention_fast import KernelPlan

        key = ("kernel", rows, page_size, causal, write_kv)
        if key not in self._plans:
            self._plans[key] = KernelPlan.build(self, rows, page_size, causal, write_kv)
        return self._plans[key]


def attention(
    qkv: torch.Tensor,  # [B, S, (Hq + 2*Hkv) * D], or [1, N, ...] unpadded (batch.flat_valid)
    kv_cache: torch.Tensor,  # [num_pages, 2, Hkv, page_size, D]
    batch: PagedBatch,
    rope_table: torch.Tensor,  # fp32 [max_position, rotary_dim]
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    spec: AttentionSpec,
    want_output: bool = True,
) -> torch.Tensor | None:
    """Attention of the contract in :mod:`edgebuild.ops.attention`, run the fast way.

    `spec`: the call's settings (:class:`~edgebuild.ops.attention.AttentionSpec`; its
    rotary_dim / page_size come from `rope_table` / `kv_cache` when unset).

    Under torch.export / compile the custom op `edgebuild::paged_attention` is emitted (it
    becomes the plugin node); eagerly the vectorized path runs (same results, tested against
    the reference op), planned by a :class:`~edgebuild.ops.attention_fast.KernelPlan` where the
    step goes to the C++ step (:func:`~edgebuild.ops.attention_fast.kernel_route`), else by a
    DensePlan. Returns [B, S, Hq * D] (None if not want_output).
    """
    if torch.compiler.is_exporting() or torch.compiler.is_compiling():
        from edgebuild.ops.attention import paged_attention

        return paged_attention(
            qkv,
            kv_cache,
            batch.page_table,
            batch.past_lengths,
            batch.input_lengths,
            batch.positions,
            rope_table,
            q_norm_weight,
            k_norm_weight,
            None,
            **spec.bind(rope_table, kv_cache).attributes(),
        )
    from edgebuild.ops.attention_fast import kernel_route, paged_attention_planned

    valid = batch.flat_valid
    if valid is not None:  # rows arrive unpadded [1, N, W]: pad for the plan, unpad after
        padded = qkv.new_zeros(*valid.shape, qkv.shape[-1])
        padded[valid] = qkv[0]
        qkv = padded
    rows, how = qkv.shape[1], (kv_cache.shape[3], spec.causal, spec.write_kv)
    if kernel_route(qkv, kv_cache, spec.head_dim, rows, *how[1:], batch.prefill, want_output):
        plan = batch.kernel_plan(rows, *how)  # the C++ step's inputs only
    else:
        plan = batch.plan(rows, *how)
    out = paged_attention_planned(
        qkv, kv_cache, plan, batch.positions, rope_table, q_norm_weight, k_norm_weight, spec,
        want_output,
    )  # fmt: skip
    if valid is not None and out is not None:
        out = out[valid].unsqueeze(0)
    return out


class RMSNorm(nn.Module):
    """RMSNorm with HF parameter name `weight` [dim]; math in :func:`edgebuild.ops.norm.rms_norm`."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from edgebuild.ops.norm import rms_norm

        return rms_norm(x, self.weight, self.eps)


def dense(value: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """A weight as a dense tensor of `dtype` (NVFP4/FP8 dequantized: the CPU path)."""
    if isinstance(value, QuantizedWeight):
        return value.dequantize(dtype)
    return value.to(dtype)


class GatedMLP(nn.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))`` (HF ``LlamaMLP`` / ``Qwen3MLP`` names:
    ``gate_proj``, ``up_proj``, ``down_proj``), shared by the target and the DSpark draft.

    Args:
        hidden: model width d; intermediate: MLP width; bias: linears with biases.
    """

    def __init__(self, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.packed_gate_up: PackedLinear | None = None  # set by pack_for_cpu
        self.packed_down: PackedLinear | None = None

    def forward(
        self,
        x: torch.Tensor,  # [..., d]
        norm: nn.Module | None = None,
        residual: torch.Tensor | None = None,  # [..., d]
    ) -> torch.Tensor:  # [..., d]
        """``residual + down(silu(gate(h)) * up(h))`` with ``h = norm(x)`` (each part optional:
        no norm, h = x; no residual, nothing added). Packed, the norm, SwiGLU and residual run
        inside the linears' calls (:class:`~edgebuild.ops.linear.PackedLinear`)."""
        if use_packed(self.packed_gate_up):
            gate_up = self.packed_gate_up(x, norm)
            return self.packed_down(gate_up, swiglu=True, residual=residual)
        h = x if norm is None else norm(x)
        y = self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return y if residual is None else residual + y

    def pack_for_cpu(self, quant: str | None = None) -> None:
        """Fuse gate/up and pack them and down_proj for eager CPU inference (ops/linear.py)."""
        self.packed_gate_up = PackedLinear([self.gate_proj, self.up_proj], quant)
        self.packed_down = PackedLinear([self.down_proj], quant)


class PreNormDecoderLayer(nn.Module):
    """The pre-norm residual decoder block of the target and the DSpark draft:
    ``x + self_attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``
    (HF ``LlamaDecoderLayer`` / ``Qwen3DecoderLayer`` names).

    What the rows attend to is the attention module's: the target's causal self-attention
    over its own cache, the draft's non-causal block attention over the cached context K/V
    (which its ``write_context`` stores). Both take ``(x, kv_cache, batch, rope_table, norm,
    residual=)`` and return ``residual + o_proj(attention(qkv(norm(x))))``; the MLP takes
    ``(x, norm, residual=)``: the norms and residual adds run inside the packed linears' calls
    on the CPU (:class:`~edgebuild.ops.linear.PackedLinear`), as torch ops otherwise.

    Args:
        self_attn: the attention module (with ``pack_for_cpu``); mlp: the MLP (same);
        hidden: model width d; eps: the two norms' epsilon.
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(
        self,
        x: torch.Tensor,  # [B, S, d]
        kv_cache: torch.Tensor,  # [num_pages, 2, Hkv, page_size, D]
        batch: PagedBatch,
        rope_table: torch.Tensor,  # fp32 [max_position, rotary_dim]
    ) -> torch.Tensor:  # [B, S, d]
        x = self.self_attn(x, kv_cache, batch, rope_table, self.input_layernorm, residual=x)
        return self.mlp(x, self.post_attention_layernorm, residual=x)

    def pack_for_cpu(self, quant: str | None = None) -> None:
        """Pack the attention's and the MLP's linears for eager CPU inference."""
        self.self_attn.pack_for_cpu(quant)
        self.mlp.pack_for_cpu(quant)


# FusedLayers runs its loop as one C++ call (edgebuild_attn::decoder_layers) where it can;
# False keeps the Python loop over the same op calls (same bits, tests/test_fused_layers.py).
CPP_LAYERS = True


LINEAR_KINDS = {"f32_linear": 0, "int4_f32_linear": 1, "int4_a8_linear": 2}  # the C++ kinds


def add_linear_args(lists: dict, op, lead: tuple) -> None:
    """Append a kernel linear's arguments (``op``: the default overload of :meth:`~edgebuild.
    ops.linear.PackedLinear.kernel_call`'s op; ``lead``: its lead arguments) to the
    per-linear lists ``w``, ``sl``, ``bias``, ``n`` and ``kind`` of the C++ loops
    (``edgebuild_attn::decoder_layers`` / ``context_layers``: kind 0 ``f32_linear(x, w)`` with
    an empty ``sl``, 1 ``int4_f32_linear(x, w, sl)``, 2 ``int4_a8_linear(x, w, sl)``)."""
    kind = LINEAR_KINDS[op.name().split("::")[1].split(".")[0]]
    w, sl, bias, n = (lead[0], torch.empty(0), *lead[1:]) if kind == 0 else lead
    for key, v in zip(("w", "sl", "bias", "n", "kind"), (w, sl, bias, n, kind), strict=True):
        lists[key].append(v)


class FusedLayers:
    """A decode / verify step's pre-norm decoder layers as flat kernel calls (or, built with
    ``block=True``, a DSpark draft's block pass: :meth:`build`).

    What :class:`PreNormDecoderLayer` computes through its modules, for a step whose every
    linear runs on edgebuild's fp32 / int4 kernels (:meth:`~edgebuild.ops.linear.PackedLinear.
    kernel_call`) and whose attention is the fused C++ decode step (with the layer's q/k
    norms, if any; a row-invariant plan: causal, cache written, <= 16 new rows per sequence).
    Per layer::

        qkv = qkv_op(x, *qkv_w, input_layernorm.weight, eps, False, None)
        a   = decode_step(qkv, cache, *step_args)   # RoPE, K/V write, attention (C++)
        h   = o_op(a, *o_w, None, 0, False, x)                    # x + o_proj(a)
        gu  = gate_up_op(h, *gu_w, post_attention_layernorm.weight, eps, False, None)
        x   = down_op(gu, *down_w, None, 0, True, h)              # h + down(silu(g) * u)

    ``step_args`` are the step's (:func:`edgebuild.ops.attention_fast.fused_step_args`, built
    once per step and window). The same ops with the same inputs in the same order as the
    modules' path, so the same bits (tests/test_fused_layers.py); what goes is the Python
    between them: ~100 us a layer of module calls, argument checks and plan lookups (an int4
    SmolLM2 token at one thread: 10.1 -> 8.0 ms, bench/README.md).
    """

    def __init__(self, layers: list[tuple], block: bool = False):
        # per layer: (qkv op, its lead args, input_layernorm, o op, lead, gate_up op, lead,
        # post_attention_layernorm, down op, lead,
        # (Hq, Hkv, D, sliding_window, scale, (q_norm weight, k_norm weight, eps)))
        self.layers = layers
        self.block = block  # a DSpark draft's block pass (build)
        self.flat = self._flat(layers)  # decoder_layers' arguments, or None

    @staticmethod
    def _flat(layers: list[tuple]) -> dict | None:
        """The per-layer lists of ``edgebuild_attn::decoder_layers`` (the whole loop in one C++
        call, the same op calls), when every layer shares its attention's heads, window, scale
        and q/k-norm eps (one set of step inputs); else None (the Python loop runs)."""
        shared = {(h[:5], h[5][2]) for *_, h in layers}
        if len(shared) != 1:
            return None
        flat = {k: [] for k in ("w", "sl", "bias", "n", "kind", "norm", "eps", "qk_norm")}
        for qkv, qkv_w, n1, o, o_w, gu, gu_w, n2, down, down_w, heads in layers:
            for op, lead in ((qkv, qkv_w), (o, o_w), (gu, gu_w), (down, down_w)):
                add_linear_args(flat, op, lead)
            flat["norm"] += [n1.weight, n2.weight]
            flat["eps"] += [float(n1.eps), float(n2.eps)]
            flat["qk_norm"] += list(heads[5][:2])
        flat["qk_eps"] = float(layers[0][-1][5][2])
        return flat

    @classmethod
    def build(cls, layers: nn.ModuleList, block: bool = False) -> FusedLayers | None:
        """The program of ``layers`` (packed :class:`PreNormDecoderLayer` s), or None when one
        of them has a part it cannot run (a linear off the fp32 / int4 kernels, an attention
        that is not causal self-attention writing its cache).

        ``block``: the program of a DSpark draft's block pass instead (the attentions'
        ``block_spec``: non-causal, nothing written; :meth:`edgebuild.models.dspark.
        DSparkDraft.block_forward`): each layer's attention is ``decode_step`` with the
        block's masks (:func:`edgebuild.ops.attention_fast.block_step_args`).

        The program binds the layers' packed weights and attention settings (heads, window,
        scale, norms) as they are now: rebuild it after changing a layer's spec or packing."""
        program = []
        for layer in layers:
            sa, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            spec = getattr(sa, "block_spec" if block else "spec", None)
            if (
                not isinstance(layer, PreNormDecoderLayer)
                or spec is None
                or (spec.causal, spec.write_kv) != ((False, False) if block else (True, True))
            ):
                return None
            qn, kn = getattr(sa, "q_norm", None), getattr(sa, "k_norm", None)
            norms = (
                None if qn is None else qn.weight, None if kn is None else kn.weight,
                spec.rms_norm_eps,
            )  # fmt: skip
            parts = [sa.packed_qkv, sa.packed_o, mlp.packed_gate_up, mlp.packed_down]
            bound = [None if p is None else p.kernel_call() for p in parts]
            if any(b is None for b in bound):
                return None
            (qkv, qkv_w), (o, o_w), (gu, gu_w), (down, down_w) = bound
            heads = (spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.sliding_window,
                     spec.scale, norms)  # fmt: skip
            program.append(
                (qkv.default, qkv_w, layer.input_layernorm, o.default, o_w, gu.default, gu_w,
                 layer.post_attention_layernorm, down.default, down_w, heads)
            )  # fmt: skip
        return cls(program, block) if program else None

    def plan_for(self, x: torch.Tensor, kv_caches: list[torch.Tensor], batch: PagedBatch):
        """The step's :class:`~edgebuild.ops.attention_fast.KernelPlan` when this program can
        run it, else None: eager,
        fp32 ``x [B, S, d]`` contiguous, all rows of the batch laid out ``[B, S]`` (no
        ``flat_valid``), the decode kernel usable on these caches, <= 16 rows a sequence."""
        from edgebuild.ops import attention_fast, attention_kernel

        if (
            x.dtype != torch.float32
            or not x.is_contiguous()
            or x.dim() != 3
            or batch.flat_valid is not None
            or not attention_fast.FUSED_STEP
            or torch.compiler.is_exporting()
            or torch.compiler.is_compiling()
        ):
            return None
        head_dim = self.layers[0][-1][2]
        if not attention_kernel.usable(torch.float32, kv_caches[0], head_dim):
            return None
        bsz, rows = x.shape[:2]
        if (
            bsz == 0
            or rows > attention_fast.ROW_INVARIANT_MAX_ROWS
            or (batch.prefill and not self.block)
            or int(batch.input_lengths.min()) < rows
        ):
            return None  # the program runs few-row steps whose every row is valid
        causal = not self.block  # the block pass: non-causal, nothing written
        return batch.kernel_plan(rows, kv_caches[0].shape[3], causal, causal)

    def _step_args(self, plan, positions, rope_table, window) -> tuple[tuple, torch.Tensor | None]:
        """``decode_step``'s step inputs after the cache, and the block's ``new_mask`` (None
        for a decode / verify step)."""
        from edgebuild.ops.attention_fast import block_step_args, fused_step_args

        if self.block:
            *args, new_mask = block_step_args(plan, positions, rope_table, window)
            return tuple(args), new_mask
        return fused_step_args(plan, positions, rope_table, window), None

    def run(
        self,
        x: torch.Tensor,  # fp32 [B, S, d]
        kv_caches: list[torch.Tensor],  # per layer [num_pages, 2, Hkv, page_size, D]
        batch: PagedBatch,
        rope_table: torch.Tensor,  # fp32 [max_position, rotary_dim]
        plan,  # from plan_for
        taps: dict[int, torch.Tensor],  # filled with the outputs of the layers in `wanted`
        wanted: set[int],
        last_rows: int = 0,  # > 0: the last layer's o_proj / MLP on the first rows only
    ) -> torch.Tensor:  # fp32 [B, S, d] (S = last_rows when set), the last layer's output
        """Run every layer (class docstring); layer i's output goes to ``taps[i]`` when i is
        in ``wanted``. The caches are written in place, as by the modules.

        ``last_rows`` (a block pass: :meth:`edgebuild.models.dspark.DSparkDraft.block_forward`)
        cuts the last layer to the first ``last_rows`` rows of each sequence after its
        attention, which still reads every row's K/V: the rows kept have the bits of the
        whole pass (every kernel is row-invariant), the others' o_proj and MLP are skipped."""
        bsz, rows = x.shape[:2]
        last_rows = last_rows if 0 < last_rows < rows else 0
        if self.flat is not None and CPP_LAYERS:  # the loop below in one C++ call
            f = self.flat
            hq, hkv, _, window, scale, _ = self.layers[0][-1]
            order = sorted(i for i in wanted if 0 <= i < len(self.layers))
            a, new_mask = self._step_args(plan, batch.positions, rope_table, window)
            outs = torch.ops.edgebuild_attn.decoder_layers(
                x, kv_caches, f["w"], f["sl"], f["bias"], f["n"], f["kind"], f["norm"],
                f["eps"], f["qk_norm"], f["qk_eps"], *a, hq, hkv, scale, order, new_mask,
                last_rows,
            )  # fmt: skip
            taps.update(zip(order, outs[1:], strict=True))
            return outs[0]
        step = torch.ops.edgebuild_attn.decode_step.default  # attention_kernel.decode_step
        args: dict[int, tuple] = {}
        for i, (qkv, qkv_w, n1, o, o_w, gu, gu_w, n2, down, down_w, heads) in enumerate(
            self.layers
        ):
            hq, hkv, d, window, scale, norms = heads
            a = args.get(window)
            if a is None:
                a = args[window] = self._step_args(plan, batch.positions, rope_table, window)
            h = qkv(x, *qkv_w, n1.weight, n1.eps, False, None)
            h = step(
                h.view(bsz, rows, hq + 2 * hkv, d), kv_caches[i], *a[0], hq, scale, *norms, a[1]
            )
            h = h.view(bsz, rows, hq * d)
            if last_rows and i == len(self.layers) - 1:  # the kept rows only (docstring)
                h, x = h[:, :last_rows].contiguous(), x[:, :last_rows].contiguous()
            h = o(h, *o_w, None, 0.0, False, x)
            x = down(gu(h, *gu_w, n2.weight, n2.eps, False, None), *down_w, None, 0.0, True, h)
            if i in wanted:
                taps[i] = x
        return x
