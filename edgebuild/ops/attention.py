"""``edgebuild::paged_attention``: the golden CPU reference of the attention plugin.

This docstring is the contract shared by three implementations that must agree: this CPU op,
the ONNX node the exporter writes, and the CUDA kernels of the TensorRT plugin
(``plugins/README.md`` restates it; change both together). The code below is deliberately
plain (a loop over the batch, dense masks) so that it can be read as the specification.

One op serves every attention of the product: *new rows attend to the cached rows of their
sequence plus some of the new rows*, with optional per-head q/k RMSNorm, RoPE, GQA and a paged
KV cache. The phases differ only in their arguments:

=====================  ==========  ============  ============================  ========  ========
phase                  S (rows)    past_lengths  mask among new rows           write_kv  output
=====================  ==========  ============  ============================  ========  ========
prefill                prompt      0             causal=True                   True      used
chunked prefill        chunk       > 0           causal=True                   True      used
decode                 1           > 0           causal=True (one row)         True      used
verify (chain)         1 + drafts  > 0           causal=True                   True      used
verify (tree)          tree nodes  > 0           tree_mask [B, S, S]           True      used
draft context update   accepted    > 0           causal=True (any; see note)   True      ignored
draft block (DSpark)   block_size  > 0           causal=False: all block rows  False     used
vision (no cache)      patches     0             causal=False                  False     used
=====================  ==========  ============  ============================  ========  ========

Verify writes the K/V of every row; the runtime rolls rejected rows back by not advancing
``past_lengths`` past the accepted ones (stale slots are overwritten later). The draft context
update only needs its K/V written; its outputs are ignored. Vision passes an empty cache
``[0, 2, Hkv, page_size, D]`` and ``page_table [B, 0]``.

Inputs (``B`` batch, ``S`` new rows, ``Hq``/``Hkv`` query/KV heads, ``D`` head_dim)
    qkv           [B, S, (Hq + 2*Hkv) * D] fp32/bf16/fp16: packed projections, q then k then v,
                  each head-major (channel ``h*D + d`` of the q part is head ``h``).
    kv_cache      [num_pages, 2, Hkv, page_size, D] float: this layer's page pool, written in
                  place. ``[:, 0]`` holds K (after k-norm and RoPE), ``[:, 1]`` holds V.
    page_table    int32 [B, max_pages_per_seq]: physical page of logical page ``j`` of sequence
                  ``b``. Cache slot ``t`` of sequence ``b`` is page ``page_table[b, t // page_size]``,
                  offset ``t % page_size``.
    past_lengths  int32 [B]: slots ``0 .. past-1`` of each sequence are valid in the cache.
    input_lengths int32 [B]: valid new rows per sequence (``<= S``). Rows ``i >= input_lengths[b]``
                  are padding: never read, never written, output zero.
    positions     int32 [B, S]: RoPE position of each new row (padding rows: any value).
    rope_cos_sin  fp32 [max_position, rotary_dim]: ``rope.rope_cos_sin_table``.
    q_norm_weight [D] or None: per-head RMSNorm of q before RoPE (Qwen3 ``q_norm``).
    k_norm_weight [D] or None: same for k (Qwen3 ``k_norm``). V is never normalised.
    tree_mask     bool [B, S, S] or None: ``tree_mask[b, i, j]`` = new row i may see new row j.
                  Replaces the causal/non-causal rule among new rows (cached rows stay visible).

Attributes
    num_q_heads, num_kv_heads (Hq % Hkv == 0), head_dim, rotary_dim (even, 0..head_dim;
    0 = no RoPE), causal, write_kv, sliding_window (0 = off), scale (softmax scale, usually
    head_dim ** -0.5), rms_norm_eps, page_size (== kv_cache.shape[3]).

Output
    attn_out [B, S, Hq * D], dtype of qkv (head-major like the q part of qkv).

Semantics, for each sequence ``b`` with ``P = past_lengths[b]``, ``L = input_lengths[b]``:
    1. New row ``i < L`` occupies cache slot ``P + i``.
    2. ``q_i``: q head rows, q-norm (if given), then RoPE at ``positions[b, i]``.
       ``k_i``: k-norm (if given), then RoPE at ``positions[b, i]``. ``v_i``: as projected.
    3. Query row ``i`` sees key slot ``t`` iff
       ``t < P`` (cached) or ``t = P + j`` with ``j < L`` and
       (``tree_mask[b, i, j]`` if a tree mask is given, else ``j <= i`` if causal, else True),
       and, when ``sliding_window = w > 0``, ``(P + i) - t < w``.
    4. GQA: q head ``h`` uses KV head ``h // (Hq // Hkv)``.
    5. ``out_i = softmax(scale * q_i . K^T over visible slots) @ V`` per head, softmax in fp32.
       A row that sees no slot (only possible with a tree mask) outputs zeros.
    6. ``write_kv``: ``k_i`` and ``v_i`` (``i < L``) are stored at slot ``P + i``. Without
       ``write_kv`` the new rows still take part in this call but the cache is untouched.
       Cached slots are read before this call's writes; the slots one sequence writes must not
       be read or written by another sequence of the same call.

Numerics (all roundings are identities in fp32)
    q-norm/k-norm and RoPE run in fp32 and are rounded to qkv's dtype (HF order: norm, cast,
    rope); new K/V are then rounded to the cache dtype *before* they are used, so a row's key is
    the same whether it is read back from the cache later or used fresh now (chunked prefill
    equals one prefill). Scores, softmax and ``P @ V`` are fp32; the output is rounded to
    qkv's dtype once.

Errors (raised before any write; messages name the argument and the fix)
    ConfigError: inconsistent attributes (Hq % Hkv != 0, rotary_dim > head_dim or odd,
        negative sliding_window).
    ValueError: tensor shapes/dtypes that do not fit the attributes (qkv width, kv_cache
        including page_size == kv_cache.shape[3],
        page_table/past/input/positions/tree_mask/norm weights/rope table shapes, integer
        dtypes), and data errors checked by the CPU implementation only: a page table too
        small for ``past + input`` rows (``past`` alone when not writing), a page id outside
        the pool, ``input_lengths`` outside ``[0, S]``, negative ``past_lengths``, a position
        beyond the rope table.

Sources: spec/attention-plugin.md (phases, interface); HF ``LlamaAttention`` / ``Qwen3Attention``
(norm-then-RoPE order, GQA head mapping, fp32 softmax); DSpark draft block (spec
draft-checkpoint-formats.md section 2: non-causal block, context K/V stored post-norm, post-RoPE).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from edgebuild.errors import ConfigError
from edgebuild.ops.norm import rms_norm
from edgebuild.ops.rope import apply_rope

__all__ = ["ATTRIBUTES", "AttentionSpec", "gather_kv", "paged_attention"]

# The op's keyword attributes, in its schema's order: also the plugin node's ONNX attributes
# (spec/attention-plugin.md, plugins/contract.json). A contract: never renamed here alone.
ATTRIBUTES = (
    "num_q_heads",
    "num_kv_heads",
    "head_dim",
    "rotary_dim",
    "causal",
    "write_kv",
    "sliding_window",
    "scale",
    "rms_norm_eps",
    "page_size",
)


@dataclass(frozen=True)
class AttentionSpec:
    """The settings of one attention call, said once: the op's keyword attributes
    (:data:`ATTRIBUTES`) as one frozen record.

    A model builds its record once (heads, head size, mask, cache write, scale, window, norm
    eps) and passes it to :func:`edgebuild.models.common.attention`; the export path turns it
    into the op's keywords (:meth:`attributes`) and the plugin translation reads the node's
    ONNX attributes back into one (:meth:`from_attributes`).

    rotary_dim / page_size: None until bound to a call's RoPE table (``[max_position,
        rotary_dim]``) and KV cache (``[num_pages, 2, Hkv, page_size, D]``) by :meth:`bind`.
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool
    write_kv: bool
    scale: float
    sliding_window: int = 0
    rms_norm_eps: float = 1e-6
    rotary_dim: int | None = None
    page_size: int | None = None

    def replace(self, **changes) -> AttentionSpec:
        """A copy with ``changes`` (e.g. ``causal=False, write_kv=False``)."""
        return dataclasses.replace(self, **changes)

    def bind(self, rope_cos_sin: Tensor, kv_cache: Tensor) -> AttentionSpec:
        """This record with rotary_dim / page_size taken from the call's tensors where unset
        (``rope_cos_sin.shape[1]``, ``kv_cache.shape[3]``; symbolic sizes under export)."""
        rotary = self.rotary_dim if self.rotary_dim is not None else rope_cos_sin.shape[1]
        page = self.page_size if self.page_size is not None else kv_cache.shape[3]
        return dataclasses.replace(self, rotary_dim=rotary, page_size=page)

    def attributes(self) -> dict[str, int | float | bool]:
        """The op's keyword attributes ``{name: value}`` in :data:`ATTRIBUTES` order.

        Raises:
            ValueError: rotary_dim or page_size unset (call :meth:`bind` first).
        """
        if self.rotary_dim is None or self.page_size is None:
            raise ValueError(
                "AttentionSpec.attributes: rotary_dim and page_size are unset; bind() the "
                "record to the call's RoPE table and KV cache first"
            )
        return {name: getattr(self, name) for name in ATTRIBUTES}

    @classmethod
    def from_attributes(cls, attributes: Mapping[str, int | float | bool]) -> AttentionSpec:
        """The record of the op's keyword attributes (every name of :data:`ATTRIBUTES`).

        Raises:
            ValueError: a missing or unknown attribute name (both listed).
        """
        missing = [n for n in ATTRIBUTES if n not in attributes]
        unknown = sorted(set(attributes) - set(ATTRIBUTES))
        if missing or unknown:
            raise ValueError(
                f"AttentionSpec.from_attributes: missing {missing}, unknown {unknown}; "
                f"the attributes are {list(ATTRIBUTES)}"
            )
        return cls(**{n: attributes[n] for n in ATTRIBUTES})


def gather_kv(kv_cache: Tensor, page_table: Tensor, b: int, length: int) -> tuple[Tensor, Tensor]:
    """Read cache slots ``0 .. length-1`` of sequence ``b`` densely.

    Args:
        kv_cache: ``[num_pages, 2, Hkv, page_size, D]``.
        page_table: int ``[B, max_pages_per_seq]``.
        b: sequence index into ``page_table``.
        length: number of slots to read (``<= max_pages_per_seq * page_size``).

    Returns:
        ``(K, V)``, each ``[Hkv, length, D]`` in the cache dtype (copies, not views).

    Raises:
        ValueError: ``length`` beyond what the page-table row covers.
    """
    capacity = page_table.shape[1] * kv_cache.shape[3]
    if not 0 <= length <= capacity:
        raise ValueError(
            f"gather_kv: length {length} outside [0, {capacity}] "
            f"(page_table columns {page_table.shape[1]} x page_size {kv_cache.shape[3]})"
        )
    slots = torch.arange(length)
    pages, offsets = _slot_pages(page_table[b], slots, kv_cache.shape[3])
    # advanced indices at dims 0 and 3 around a slice: the indexed dim comes first -> [L, Hkv, D]
    keys = kv_cache[pages, 0, :, offsets, :].transpose(0, 1)
    values = kv_cache[pages, 1, :, offsets, :].transpose(0, 1)
    return keys, values


def _slot_pages(page_row: Tensor, slots: Tensor, page_size: int) -> tuple[Tensor, Tensor]:
    """Physical page and in-page offset of cache ``slots`` through one page-table row."""
    return page_row.long()[slots // page_size], slots % page_size


def _write_kv(
    kv_cache: Tensor, page_row: Tensor, first_slot: int, keys: Tensor, values: Tensor
) -> None:
    """Store ``keys``/``values`` ``[L, Hkv, D]`` at slots ``first_slot .. first_slot+L-1``."""
    slots = first_slot + torch.arange(keys.shape[0])
    pages, offsets = _slot_pages(page_row, slots, kv_cache.shape[3])
    kv_cache[pages, 0, :, offsets, :] = keys
    kv_cache[pages, 1, :, offsets, :] = values


def _check_shapes(
    qkv: Tensor,
    kv_cache: Tensor,
    page_table: Tensor,
    past_lengths: Tensor,
    input_lengths: Tensor,
    positions: Tensor,
    rope_cos_sin: Tensor,
    q_norm_weight: Tensor | None,
    k_norm_weight: Tensor | None,
    tree_mask: Tensor | None,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    sliding_window: int,
    page_size: int,
) -> None:
    """Checks that need shapes and dtypes only (run by the CPU and the fake implementation)."""
    hq, hkv, d = num_q_heads, num_kv_heads, head_dim
    if hq <= 0 or hkv <= 0 or d <= 0 or hq % hkv:
        raise ConfigError(
            f"paged_attention: num_q_heads ({hq}) must be a positive multiple of num_kv_heads "
            f"({hkv}) and head_dim ({d}) positive"
        )
    if rotary_dim < 0 or rotary_dim > d or rotary_dim % 2:
        raise ConfigError(
            f"paged_attention: rotary_dim ({rotary_dim}) must be even and in [0, head_dim={d}]"
        )
    if sliding_window < 0:
        raise ConfigError(f"paged_attention: sliding_window must be >= 0, got {sliding_window}")
    if qkv.dim() != 3 or not qkv.is_floating_point() or qkv.shape[2] != (hq + 2 * hkv) * d:
        raise ValueError(
            f"paged_attention: qkv must be float [B, S, (Hq + 2*Hkv) * D] = [B, S, {(hq + 2 * hkv) * d}]"
            f" (Hq={hq}, Hkv={hkv}, D={d}), got {qkv.dtype} {tuple(qkv.shape)}"
        )
    batch, rows = qkv.shape[0], qkv.shape[1]
    if kv_cache.dim() != 5 or tuple(kv_cache.shape[1:]) != (2, hkv, page_size, d):
        raise ValueError(
            f"paged_attention: kv_cache must be [num_pages, 2, Hkv={hkv}, page_size={page_size}, "
            f"D={d}], got {tuple(kv_cache.shape)}"
        )
    if not kv_cache.is_floating_point():
        raise ValueError(f"paged_attention: kv_cache must be float, got {kv_cache.dtype}")
    expected = {
        "page_table": (page_table, (batch, page_table.shape[-1])),
        "past_lengths": (past_lengths, (batch,)),
        "input_lengths": (input_lengths, (batch,)),
        "positions": (positions, (batch, rows)),
    }
    for name, (tensor, shape) in expected.items():
        if tensor.dtype != torch.int32 or tuple(tensor.shape) != shape:
            raise ValueError(
                f"paged_attention: {name} must be int32 {list(shape)}, "
                f"got {tensor.dtype} {list(tensor.shape)}"
            )
    if rope_cos_sin.dim() != 2 or rope_cos_sin.shape[1] != rotary_dim:
        raise ValueError(
            f"paged_attention: rope_cos_sin must be [max_position, rotary_dim={rotary_dim}], "
            f"got {tuple(rope_cos_sin.shape)}"
        )
    if rope_cos_sin.dtype != torch.float32:
        raise ValueError(f"paged_attention: rope_cos_sin must be fp32, got {rope_cos_sin.dtype}")
    for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if weight is not None and tuple(weight.shape) != (d,):
            raise ValueError(
                f"paged_attention: {name} must be [head_dim={d}], got {tuple(weight.shape)}"
            )
    if tree_mask is not None and (
        tree_mask.dtype != torch.bool or tuple(tree_mask.shape) != (batch, rows, rows)
    ):
        raise ValueError(
            f"paged_attention: tree_mask must be bool [B, S, S] = [{batch}, {rows}, {rows}], "
            f"got {tree_mask.dtype} {tuple(tree_mask.shape)}"
        )


def _check_values(
    qkv: Tensor,
    kv_cache: Tensor,
    page_table: Tensor,
    past_lengths: Tensor,
    input_lengths: Tensor,
    positions: Tensor,
    rope_rows: int,
    rotary_dim: int,
    write_kv: bool,
    page_size: int,
) -> None:
    """Checks that read the int inputs (CPU implementation only; before any write)."""
    rows, num_pages = qkv.shape[1], kv_cache.shape[0]
    max_pages = page_table.shape[1]
    for b in range(qkv.shape[0]):
        past, length = int(past_lengths[b]), int(input_lengths[b])
        if past < 0 or not 0 <= length <= rows:
            raise ValueError(
                f"paged_attention: sequence {b}: past_lengths={past} must be >= 0 and "
                f"input_lengths={length} in [0, S={rows}]"
            )
        end = past + length if write_kv else past
        pages_needed = -(-end // page_size)
        if pages_needed > max_pages:
            raise ValueError(
                f"paged_attention: sequence {b} needs {pages_needed} pages for {end} slots "
                f"(past {past} + {'new ' + str(length) if write_kv else 'no new (write_kv off)'}, "
                f"page_size {page_size}) but page_table has {max_pages} columns; allocate more "
                "pages for the sequence"
            )
        used = page_table[b, :pages_needed]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
            raise ValueError(
                f"paged_attention: sequence {b}: page ids {used.tolist()} must be in "
                f"[0, num_pages={num_pages})"
            )
        valid_positions = positions[b, :length]
        if (
            rotary_dim
            and length
            and (int(valid_positions.min()) < 0 or int(valid_positions.max()) >= rope_rows)
        ):
            raise ValueError(
                f"paged_attention: sequence {b}: positions up to {int(valid_positions.max())} "
                f"(min {int(valid_positions.min())}) but rope_cos_sin has {rope_rows} rows; "
                "build the table with a larger max_position"
            )


def _visible(
    past: int, length: int, tree_mask: Tensor | None, causal: bool, sliding_window: int
) -> Tensor:
    """bool ``[length, past + length]``: new row ``i`` may see cache slot ``t`` (contract rule 3)."""
    if tree_mask is not None:
        among_new = tree_mask[:length, :length]
    elif causal:
        among_new = torch.ones(length, length, dtype=torch.bool).tril()
    else:
        among_new = torch.ones(length, length, dtype=torch.bool)
    visible = torch.cat((torch.ones(length, past, dtype=torch.bool), among_new), dim=1)
    if sliding_window > 0:
        query_slots = past + torch.arange(length)
        key_slots = torch.arange(past + length)
        visible &= (query_slots[:, None] - key_slots[None, :]) < sliding_window
    return visible


def _norm_rope(
    x: Tensor, weight: Tensor | None, eps: float, positions: Tensor, table: Tensor
) -> Tensor:
    """Per-head RMSNorm (optional) then RoPE of ``x`` ``[L, H, D]``; result in ``x.dtype``."""
    if weight is not None:
        x = rms_norm(x, weight, eps).to(x.dtype)
    if table.shape[1]:
        x = apply_rope(x, positions, table)
    return x


def _attend(q: Tensor, keys: Tensor, values: Tensor, visible: Tensor, scale: float) -> Tensor:
    """fp32 attention of ``q`` ``[L, Hq, D]`` over ``keys``/``values`` ``[Hq, T, D]`` -> ``[L, Hq, D]``."""
    scores = torch.einsum("lhd,htd->hlt", q.float(), keys.float()) * scale  # [Hq, L, T]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(visible.any(dim=-1, keepdim=True), probs, 0.0)  # rows that see nothing
    return torch.einsum("hlt,htd->lhd", probs, values.float())


@torch.library.custom_op("edgebuild::paged_attention", mutates_args=("kv_cache",))
def _paged_attention_op(
    qkv: Tensor,
    kv_cache: Tensor,
    page_table: Tensor,
    past_lengths: Tensor,
    input_lengths: Tensor,
    positions: Tensor,
    rope_cos_sin: Tensor,
    q_norm_weight: Tensor | None,
    k_norm_weight: Tensor | None,
    tree_mask: Tensor | None,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    causal: bool,
    write_kv: bool,
    sliding_window: int = 0,
    scale: float,
    rms_norm_eps: float = 1e-6,
    page_size: int,
) -> Tensor:
    """CPU implementation of the contract in the module docstring."""
    _check_shapes(
        qkv,
        kv_cache,
        page_table,
        past_lengths,
        input_lengths,
        positions,
        rope_cos_sin,
        q_norm_weight,
        k_norm_weight,
        tree_mask,
        num_q_heads,
        num_kv_heads,
        head_dim,
        rotary_dim,
        sliding_window,
        page_size,
    )
    _check_values(
        qkv,
        kv_cache,
        page_table,
        past_lengths,
        input_lengths,
        positions,
        rope_cos_sin.shape[0],
        rotary_dim,
        write_kv,
        page_size,
    )
    batch, rows, _ = qkv.shape
    hq, hkv, d = num_q_heads, num_kv_heads, head_dim
    out = qkv.new_zeros(batch, rows, hq * d)
    for b in range(batch):
        past, length = int(past_lengths[b]), int(input_lengths[b])
        if length == 0:
            continue
        heads = qkv[b, :length].reshape(length, hq + 2 * hkv, d)  # [L, Hq + 2*Hkv, D]
        q, k, v = heads[:, :hq], heads[:, hq : hq + hkv], heads[:, hq + hkv :]
        pos = positions[b, :length]
        q = _norm_rope(q, q_norm_weight, rms_norm_eps, pos, rope_cos_sin)  # [L, Hq, D]
        k = _norm_rope(k, k_norm_weight, rms_norm_eps, pos, rope_cos_sin).to(kv_cache.dtype)
        v = v.to(kv_cache.dtype)  # [L, Hkv, D]
        past_k, past_v = gather_kv(kv_cache, page_table, b, past)  # [Hkv, P, D]
        keys = torch.cat((past_k, k.transpose(0, 1)), dim=1).repeat_interleave(hq // hkv, dim=0)
        values = torch.cat((past_v, v.transpose(0, 1)), dim=1).repeat_interleave(hq // hkv, dim=0)
        b_mask = None if tree_mask is None else tree_mask[b]
        visible = _visible(past, length, b_mask, causal, sliding_window)
        out[b, :length] = _attend(q, keys, values, visible, scale).reshape(length, hq * d)
        if write_kv:
            _write_kv(kv_cache, page_table[b], past, k, v)
    return out


@_paged_attention_op.register_fake
def _paged_attention_fake(
    qkv,
    kv_cache,
    page_table,
    past_lengths,
    input_lengths,
    positions,
    rope_cos_sin,
    q_norm_weight,
    k_norm_weight,
    tree_mask,
    *,
    num_q_heads,
    num_kv_heads,
    head_dim,
    rotary_dim,
    causal,
    write_kv,
    sliding_window=0,
    scale,
    rms_norm_eps=1e-6,
    page_size,
):
    _check_shapes(
        qkv,
        kv_cache,
        page_table,
        past_lengths,
        input_lengths,
        positions,
        rope_cos_sin,
        q_norm_weight,
        k_norm_weight,
        tree_mask,
        num_q_heads,
        num_kv_heads,
        head_dim,
        rotary_dim,
        sliding_window,
        page_size,
    )
    return qkv.new_empty(qkv.shape[0], qkv.shape[1], num_q_heads * head_dim)


def paged_attention(
    qkv: Tensor,
    kv_cache: Tensor,
    page_table: Tensor,
    past_lengths: Tensor,
    input_lengths: Tensor,
    positions: Tensor,
    rope_cos_sin: Tensor,
    q_norm_weight: Tensor | None = None,
    k_norm_weight: Tensor | None = None,
    tree_mask: Tensor | None = None,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    causal: bool,
    write_kv: bool,
    sliding_window: int = 0,
    scale: float,
    rms_norm_eps: float = 1e-6,
    page_size: int,
) -> Tensor:
    """Paged attention with fused q/k-norm, RoPE and KV write: ``torch.ops.edgebuild.paged_attention``.

    The full contract (shapes, dtypes, phases, masking, numerics, errors) is the docstring of
    ``edgebuild.ops.attention``. ``kv_cache`` is updated in place when ``write_kv``.

    Returns:
        ``attn_out`` ``[B, S, num_q_heads * head_dim]`` in ``qkv.dtype``; padding rows are zero.

    Raises:
        ConfigError: inconsistent attributes. ValueError: inputs that do not fit (see contract).
    """
    return torch.ops.edgebuild.paged_attention(
        qkv,
        kv_cache,
        page_table,
        past_lengths,
        input_lengths,
        positions,
        rope_cos_sin,
        q_norm_weight,
        k_norm_weight,
        tree_mask,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        causal=causal,
        write_kv=write_kv,
        sliding_window=sliding_window,
        scale=scale,
        rms_norm_eps=rms_norm_eps,
        page_size=page_size,
    )
