"""Pieces shared by the model definitions: the paged-batch metadata and weight loading helpers.

Models never import the runtime: the runtime builds a :class:`PagedBatch` and passes per-layer
KV pools in; models call :mod:`edgebuild.ops` for attention, RoPE and norms.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from edgebuild.checkpoint.quant import QuantizedWeight
from edgebuild.checkpoint.shapes import check_shape, layer_linear_shapes  # noqa: F401 (re-export)


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


def attention(
    qkv: torch.Tensor,  # [B, S, (Hq + 2*Hkv) * D]
    kv_cache: torch.Tensor,  # [num_pages, 2, Hkv, page_size, D]
    batch: PagedBatch,
    rope_table: torch.Tensor,  # fp32 [max_position, rotary_dim]
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    causal: bool,
    write_kv: bool,
    sliding_window: int = 0,
    scale: float,
    rms_norm_eps: float = 1e-6,
    want_output: bool = True,
) -> torch.Tensor | None:
    """Attention of the contract in :mod:`edgebuild.ops.attention`, run the fast way.

    Under torch.export / compile the custom op `edgebuild::paged_attention` is emitted (it
    becomes the plugin node); eagerly the vectorized DensePlan path runs (same results,
    tested against the reference op). Returns [B, S, Hq * D] (None if not want_output).
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
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rotary_dim=rope_table.shape[1],
            causal=causal,
            write_kv=write_kv,
            sliding_window=sliding_window,
            scale=scale,
            rms_norm_eps=rms_norm_eps,
            page_size=kv_cache.shape[3],
        )
    from edgebuild.ops.attention_fast import paged_attention_planned

    valid = batch.flat_valid
    if valid is not None:  # rows arrive unpadded [1, N, W]: pad for the plan, unpad after
        padded = qkv.new_zeros(*valid.shape, qkv.shape[-1])
        padded[valid] = qkv[0]
        qkv = padded
    plan = batch.plan(qkv.shape[1], kv_cache.shape[3], causal, write_kv)
    out = paged_attention_planned(
        qkv,
        kv_cache,
        plan,
        batch.positions,
        rope_table,
        q_norm_weight,
        k_norm_weight,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        sliding_window=sliding_window,
        scale=scale,
        rms_norm_eps=rms_norm_eps,
        want_output=want_output,
    )
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
