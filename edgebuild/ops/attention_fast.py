"""A vectorized CPU implementation of the paged attention contract (the eager fast path).

Same contract and results as the reference op in :mod:`edgebuild.ops.attention` (tested
against it), but planned once per model step and run as a few batched tensor ops per layer:

1. :class:`DensePlan` turns the page table and lengths into flat gather/scatter indices and a
   visibility mask ``[B, S, T]`` (computed once, shared by every layer of a step);
2. :func:`paged_attention_planned` normalizes and rotates q/k, scatters the new K/V into the
   pages, gathers each sequence's keys densely and runs ``scaled_dot_product_attention``.

The reference op stays the golden model (and the export / plugin boundary); this module only
exists because a Python loop per sequence and per layer is slow on a CPU.

**Row-invariant steps** (decode and verify: few new rows per sequence, cache written): each
new row attends as its own one-query problem ``[R, H, 1, D]`` over key columns padded to a
multiple of ``KEY_ALIGN`` and masked past its visible count, so a row's bits depend only on
its own keys, never on how many rows share the pass (a 1-row decode and row i of an n+1-row
verify give identical output). That is what keeps greedy DSpark equal to greedy target-only
in bf16 (design rule "Exactness"; checked bit for bit by tests/test_batch_invariance.py).

**Chunk-invariant prefill** (``prefill``: the rows are prompt rows, any count): the rows run
as one fp32 attention per sequence whose key columns are padded to a multiple of
``PREFILL_KEY_ALIGN`` and whose query rows are padded to a multiple of
``PREFILL_QUERY_ALIGN``, so that torch's CPU flash kernel (key blocks of 512, query blocks of
32 / 64 / 256) always sees the same key blocks and never a query block of 1 or 2 rows (those
take another GEMM path). Measured in bf16 on the real SmolLM2: without the padding, a prompt
prefilled in chunks of 32 or 64 rows, or a 1-row chunk, gives other bits than in one pass;
with it, a row's K/V, taps and logits are the same whatever the chunking and whatever other
prompts share the pass (tests/test_prefill_invariance.py), which chunked prefill and the
prefix cache rely on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from edgebuild.ops import attention_kernel
from edgebuild.ops.attention import AttentionSpec
from edgebuild.ops.norm import rms_norm
from edgebuild.ops.rope import apply_rope, check_positions, rotate_with

KEY_ALIGN = 32  # key columns of a row-invariant step are padded to a multiple of this
ROW_INVARIANT_MAX_ROWS = 16  # steps with at most this many new rows per sequence
PREFILL_KEY_ALIGN = 512  # key columns of a prefill step: a multiple of the flash kernel's block
PREFILL_QUERY_ALIGN = 32  # query rows of a prefill step: no flash query block of 1 or 2 rows


@dataclass
class DensePlan:
    """Index and mask tensors for one step (one PagedBatch), shared by all layers.

    Attributes:
        write_b, write_i: long [N] batch / row index of each valid new row.
        write_pages, write_offsets: long [N] where that row's K/V go in the pool.
        read_pages, read_offsets: long [B, T] slot t of sequence b (padding points at 0/0).
        key_slots: long [B, T] cache slot index of each key column (for sliding windows).
        query_slots: long [B, S] cache slot of each new row.
        base_mask: bool [B, S, T] visibility without a sliding window.
        valid_rows: bool [B, S] rows < input_lengths.
        write_kv: whether new rows are written and read back from the cache; when False the
            key columns are [past slots (padded to P); new rows (S)].
        row_invariant: decode / verify step (causal, cache written, S <= ROW_INVARIANT_MAX_ROWS):
            T is padded to a multiple of KEY_ALIGN and every valid row attends alone.
        prefill: chunk-invariant prompt step (module docstring): T padded to a multiple of
            PREFILL_KEY_ALIGN, query rows to a multiple of PREFILL_QUERY_ALIGN.
    """

    write_b: Tensor
    write_i: Tensor
    write_pages: Tensor
    write_offsets: Tensor
    read_pages: Tensor
    read_offsets: Tensor
    key_slots: Tensor
    query_slots: Tensor
    base_mask: Tensor
    valid_rows: Tensor
    write_kv: bool
    past_width: int
    row_invariant: bool = False
    page_table: Tensor | None = None  # long [B, max_pages] (page gathers, the C++ steps)
    page_size: int = 0
    prefill: bool = False
    _memo: dict = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        page_table: Tensor,  # int32 [B, max_pages]
        past_lengths: Tensor,  # int32 [B]
        input_lengths: Tensor,  # int32 [B]
        rows: int,  # S
        page_size: int,
        causal: bool,
        write_kv: bool,
        prefill: bool = False,
    ) -> DensePlan:
        """Plan a step; raises ValueError when the page table cannot hold the rows.

        `prefill` (causal steps that write the cache only): the chunk-invariant prompt path.
        """
        bsz = page_table.shape[0]
        past = past_lengths.long()
        length = input_lengths.long()
        ar_s = torch.arange(rows)
        valid = ar_s[None, :] < length[:, None]  # [B, S]
        query_slots = past[:, None] + ar_s[None, :]  # [B, S]
        cover = (past + length) if write_kv else past
        if bsz:
            _check_covered(page_table, page_size, int(cover.max()))
        table = page_table.long()
        wb, wi = valid.nonzero(as_tuple=True)
        wslots = query_slots[wb, wi]
        w_pages = table[wb, wslots // page_size]
        w_off = wslots % page_size
        width = int(cover.max()) if bsz else 0
        prefill = prefill and causal and write_kv
        row_invariant = (
            causal and write_kv and rows <= ROW_INVARIANT_MAX_ROWS and bsz > 0 and not prefill
        )
        if row_invariant:
            width = -(-width // KEY_ALIGN) * KEY_ALIGN
        elif prefill:
            width = -(-width // PREFILL_KEY_ALIGN) * PREFILL_KEY_ALIGN
        ar_t = torch.arange(width)
        in_range = ar_t[None, :] < cover[:, None]  # [B, T_past or T]
        slots = torch.where(in_range, ar_t[None, :], 0)
        r_pages = torch.gather(table, 1, slots // page_size) if width else slots
        r_pages = torch.where(in_range, r_pages, 0)
        r_off = slots % page_size
        if write_kv:
            key_slots = ar_t[None, :].expand(bsz, width)
            if causal:
                mask = key_slots[:, None, :] <= query_slots[:, :, None]
            else:  # every new row sees all valid new rows
                mask = ar_t[None, None, :] < (past + length)[:, None, None]
            mask = mask & in_range[:, None, :]
        else:
            new_slots = query_slots
            key_slots = torch.cat([ar_t[None, :].expand(bsz, width), new_slots], dim=1)
            past_vis = in_range[:, None, :].expand(bsz, rows, width)
            if causal:
                new_vis = ar_s[None, None, :] <= ar_s[None, :, None]
            else:
                new_vis = torch.ones(1, rows, rows, dtype=torch.bool)
            new_vis = new_vis & valid[:, None, :]
            mask = torch.cat([past_vis, new_vis.expand(bsz, rows, rows)], dim=2)
        mask = mask & valid[:, :, None]
        return cls(
            wb, wi, w_pages, w_off, r_pages, r_off, key_slots, query_slots, mask, valid,
            write_kv, width, row_invariant, table, page_size, prefill,
        )  # fmt: skip

    def row_masks(self, sliding_window: int) -> Tensor:
        """bool [R, T]: the key columns each valid row (``write_b``, ``write_i``) sees."""
        return self.mask_for(sliding_window)[self.write_b, self.write_i]

    def mask_for(self, sliding_window: int) -> Tensor:
        """bool [B, S, T] with the sliding-window rule q - t < w applied (memoized)."""
        if sliding_window <= 0:
            return self.base_mask
        m = self._memo.get(sliding_window)
        if m is None:
            near = (self.query_slots[:, :, None] - self.key_slots[:, None, :]) < sliding_window
            m = self.base_mask & near
            self._memo[sliding_window] = m
        return m


SMALL_PLAN_ROWS = 64  # KernelPlan.build computes a step of up to this many rows on Python ints
SMALL_PLAN_PAGES = 1024  # ... whose page table has at most this many entries (it is listed whole)


@dataclass
class KernelPlan:
    """What edgebuild's C++ steps (:func:`edgebuild.ops.attention_kernel.decode_step`) read of
    a step, without :class:`DensePlan`'s dense gathers and ``[B, S, T]`` masks: the valid rows
    (``write_b``, ``write_i``), where each goes in the pool (``write_pages``,
    ``write_offsets``, int64 [R]), the page table (int64 [B, pages]) and, for the steps that
    attend, each row's key columns (:meth:`row_masks`). The same values as the DensePlan of
    the step (tests/test_draft_program.py); a DensePlan of a 1-row decode took ~0.2 ms to
    build, ~4% of an int4 SmolLM2 token. Built by :meth:`build` for the steps
    :func:`kernel_route` sends to the C++ step: decode / verify (row-invariant), a DSpark
    draft's context update (write-only) and its block pass (non-causal, nothing written).
    """

    write_b: Tensor
    write_i: Tensor
    write_pages: Tensor
    write_offsets: Tensor
    page_table: Tensor
    past: Tensor  # long [B] rows already cached
    lengths: Tensor  # long [B] valid new rows
    write_kv: bool
    past_width: int  # T: key columns of row_masks (the block's: cached columns only)
    row_invariant: bool
    prefill: bool = False
    _memo: dict = field(default_factory=dict)

    @classmethod
    def build(cls, batch, rows: int, page_size: int, causal: bool, write_kv: bool) -> KernelPlan:
        """Plan a step of the kinds above: ``batch`` a :class:`~edgebuild.models.common.
        PagedBatch` (its int32 ``page_table [B >= 1, pages]``, ``past_lengths`` and
        ``input_lengths [B]``), ``rows`` S. Raises ValueError as :meth:`DensePlan.build` when
        the page table cannot hold the rows."""
        page_table = batch.page_table
        bsz = page_table.shape[0]
        if bsz * rows <= SMALL_PLAN_ROWS and page_table.numel() <= SMALL_PLAN_PAGES:
            # a few rows of a small table: the indices in Python (the table read as a list)
            return cls._build_small(batch, rows, page_size, causal, write_kv)
        past, length = batch.past_lengths.long(), batch.input_lengths.long()
        top = int(((past + length) if write_kv else past).max())
        _check_covered(page_table, page_size, top)
        if int(length.min()) >= rows:  # every row valid: no nonzero
            wb = torch.arange(bsz).repeat_interleave(rows)
            wi = torch.arange(rows).repeat(bsz)
        else:
            wb, wi = (torch.arange(rows)[None, :] < length[:, None]).nonzero(as_tuple=True)
        table = page_table.long().contiguous()
        slots = past[wb] + wi
        row_invariant = causal and write_kv and rows <= ROW_INVARIANT_MAX_ROWS
        width = -(-top // KEY_ALIGN) * KEY_ALIGN if row_invariant else top
        return cls(
            wb, wi, table[wb, slots // page_size], slots % page_size, table, past, length,
            write_kv, width, row_invariant,
        )  # fmt: skip

    @classmethod
    def _build_small(
        cls, batch, rows: int, page_size: int, causal: bool, write_kv: bool
    ) -> KernelPlan:
        """:meth:`build` for a step of at most :data:`SMALL_PLAN_ROWS` rows: the same values
        (the same row order: sequence-major), the indices computed on Python ints, where the
        tensor path's ~12 small torch ops took ~0.1 ms a step (twice a DSpark draft pass)."""
        pasts, lengths = batch.past_lengths.tolist(), batch.input_lengths.tolist()
        top = max((p + n) if write_kv else p for p, n in zip(pasts, lengths, strict=True))
        _check_covered(batch.page_table, page_size, top)
        pages = batch.page_table.tolist()
        wb, wi, wp, wo = [], [], [], []
        for b, (p, n) in enumerate(zip(pasts, lengths, strict=True)):
            for i in range(min(n, rows)):
                wb.append(b)
                wi.append(i)
                wp.append(pages[b][(p + i) // page_size])
                wo.append((p + i) % page_size)
        row_invariant = causal and write_kv and rows <= ROW_INVARIANT_MAX_ROWS
        width = -(-top // KEY_ALIGN) * KEY_ALIGN if row_invariant else top
        idx = torch.tensor([wb, wi, wp, wo], dtype=torch.long).view(4, len(wb))  # rows: views
        pl = torch.tensor([pasts, lengths], dtype=torch.long)
        return cls(
            idx[0], idx[1], idx[2], idx[3], batch.page_table.long().contiguous(), pl[0], pl[1],
            write_kv, width, row_invariant,
        )  # fmt: skip

    def row_masks(self, sliding_window: int) -> Tensor:
        """bool [R, T] as :meth:`DensePlan.row_masks` (the block's: its cached columns)."""
        key = ("row_masks", sliding_window)
        m = self._memo.get(key)
        if m is None:
            wb, t = self.write_b, torch.arange(self.past_width)[None, :]
            q = (self.past[wb] + self.write_i)[:, None]  # each row's cache slot
            if self.write_kv:  # causal: keys up to the row
                m = (t <= q) & (t < (self.past + self.lengths)[wb][:, None])
            else:  # the block: every cached row
                m = t < self.past[wb][:, None]
            if sliding_window > 0:
                m = m & ((q - t) < sliding_window)
            self._memo[key] = m
        return m

    def new_masks(self, rows: int, sliding_window: int) -> Tensor:
        """bool [R, S]: the block rows each valid row of a block pass sees (its valid rows,
        within the window)."""
        j = torch.arange(rows)[None, :]
        m = j < self.lengths[self.write_b][:, None]
        if sliding_window > 0:
            m = m & ((self.write_i[:, None] - j) < sliding_window)
        return m


def _check_covered(page_table: Tensor, page_size: int, needed: int) -> None:
    """Raise ValueError when ``page_table [B, pages]`` holds fewer than ``needed`` slots."""
    capacity = page_table.shape[1] * page_size
    if needed > capacity:
        raise ValueError(
            f"paged_attention: page_table covers {capacity} slots but a sequence needs "
            f"{needed}; allocate more pages for the sequence"
        )


def kernel_route(
    qkv: Tensor, kv_cache: Tensor, head_dim: int, rows: int, causal: bool, write_kv: bool,
    prefill: bool, want_output: bool,
) -> bool:  # fmt: skip
    """Whether :func:`paged_attention_planned` runs this step as the C++ step (then a
    :class:`KernelPlan` serves it): a row-invariant decode / verify, a draft's write-only
    context update or its few-row block pass, with the kernel usable here (the routing of
    :func:`_decode_step`, :func:`_kernel_takes` and :func:`_draft_step_here`). A causal step
    that writes nothing (no caller) is left to the DensePlan, whose block masks are causal."""
    if not (
        FUSED_STEP
        and qkv.is_contiguous()
        and qkv.shape[0] > 0
        and attention_kernel.usable(qkv.dtype, kv_cache, head_dim)
    ):
        return False
    if write_kv and not want_output:  # a context update: any row count
        return True
    if write_kv:  # decode / verify
        return causal and rows <= ROW_INVARIANT_MAX_ROWS and not prefill
    return want_output and not causal and rows <= ROW_INVARIANT_MAX_ROWS  # a block pass


def paged_attention_planned(
    qkv: Tensor,  # [B, S, (Hq + 2*Hkv) * D]
    kv_cache: Tensor,  # [num_pages, 2, Hkv, page_size, D], updated in place when write_kv
    plan: DensePlan | KernelPlan,
    positions: Tensor,  # int [B, S]
    rope_cos_sin: Tensor,  # fp32 [max_position, rotary_dim]
    q_norm_weight: Tensor | None,
    k_norm_weight: Tensor | None,
    spec: AttentionSpec,
    want_output: bool = True,
) -> Tensor | None:
    """The attention contract, vectorized over the batch (see module docstring).

    `spec`: the call's settings (heads, head size, window, scale, norm eps; its causal /
    write_kv are the plan's, and rotary_dim is the RoPE table's width).

    Returns attn_out [B, S, Hq * D] in qkv.dtype (padding rows zero), or None when
    `want_output` is False (a draft context update only writes the cache).
    """
    bsz, rows, _ = qkv.shape
    hq, hkv, d = spec.num_q_heads, spec.num_kv_heads, spec.head_dim
    sliding_window, scale, rms_norm_eps = spec.sliding_window, spec.scale, spec.rms_norm_eps
    heads = qkv.view(bsz, rows, hq + 2 * hkv, d)
    if plan.row_invariant and want_output:
        return _decode_step(
            heads, kv_cache, plan, positions, rope_cos_sin, q_norm_weight, k_norm_weight,
            hq, sliding_window, scale, rms_norm_eps,
        )  # fmt: skip
    if _draft_step_here(heads, kv_cache, plan, want_output):  # a DSpark draft's, in C++
        norms = (q_norm_weight, k_norm_weight)
        return _kernel_step(
            heads, kv_cache, plan, positions, rope_cos_sin, *norms, spec, want_output
        )
    k = heads[:, :, hq : hq + hkv]
    v = heads[:, :, hq + hkv :]
    if k_norm_weight is not None:
        k = rms_norm(k, k_norm_weight, rms_norm_eps).to(qkv.dtype)
    if rope_cos_sin.shape[1]:
        k = apply_rope(k, positions, rope_cos_sin)
    k = k.to(kv_cache.dtype)
    v = v.to(kv_cache.dtype)
    if plan.write_kv and plan.write_b.numel():
        kv_cache[plan.write_pages, 0, :, plan.write_offsets, :] = k[plan.write_b, plan.write_i]
        kv_cache[plan.write_pages, 1, :, plan.write_offsets, :] = v[plan.write_b, plan.write_i]
    if not want_output:
        return None
    q = heads[:, :, :hq]
    if q_norm_weight is not None:
        q = rms_norm(q, q_norm_weight, rms_norm_eps).to(qkv.dtype)
    if rope_cos_sin.shape[1]:
        q = apply_rope(q, positions, rope_cos_sin)
    if plan.prefill:  # whole pages, [B, Hkv, T, D]
        keys, values = _gather_pages(kv_cache, plan, torch.float32)
    else:
        keys = kv_cache[plan.read_pages, 0, :, plan.read_offsets, :].transpose(1, 2)
        values = kv_cache[plan.read_pages, 1, :, plan.read_offsets, :].transpose(1, 2)
        if not plan.write_kv:  # [B, Hkv, T_past + S, D]
            keys = torch.cat([keys, k.transpose(1, 2)], dim=2)
            values = torch.cat([values, v.transpose(1, 2)], dim=2)
    mask = plan.mask_for(sliding_window)  # [B, S, T]
    seen = mask.any(-1)  # rows that see nothing (padding): give them one key, zero them after
    safe = mask | ~seen[:, :, None]
    if plan.prefill:  # pad the query rows (module docstring); padding rows see key 0
        extra = -rows % PREFILL_QUERY_ALIGN
        q = F.pad(q, (0, 0, 0, 0, 0, extra))  # [B, S', Hq, D]
        pad_rows = torch.zeros(bsz, extra, safe.shape[2], dtype=torch.bool)
        pad_rows[:, :, 0] = True
        safe = torch.cat([safe, pad_rows], dim=1)  # [B, S', T]
    out = F.scaled_dot_product_attention(
        q.float().transpose(1, 2),  # [B, Hq, S, D]
        keys.float(),  # [B, Hkv, T, D]
        values.float(),
        attn_mask=safe[:, None],
        scale=scale,
        enable_gqa=hq != hkv,
    )  # [B, Hq, S', D]
    out = out[:, :, :rows].transpose(1, 2).reshape(bsz, rows, hq * d)
    out = out.masked_fill(~seen[:, :, None], 0.0)
    return out.to(qkv.dtype)


# A decode / verify step's q/k norms, RoPE, K/V write and attention run as one C++ call per
# layer (attention_kernel.decode_step), as do a DSpark draft's context update and block pass;
# False runs them as torch ops (+ decode_attention for decode / verify rows: the same bits
# without q/k norms).
FUSED_STEP = True


def _rope_rows(
    plan: DensePlan | KernelPlan, positions: Tensor, table: Tensor
) -> tuple[Tensor, Tensor]:
    """(cos, sin) fp32 [B, S, 1, rotary_dim / 2] of this step's positions, built once a step."""
    key = ("rope", table.data_ptr(), tuple(table.shape))
    rows = plan._memo.get(key)
    if rows is None:
        check_positions(positions, table)
        half = table.shape[1] // 2
        r = table.float()[positions.long()].unsqueeze(2)  # [B, S, 1, rotary_dim]
        rows = (r[..., :half], r[..., half:])
        plan._memo[key] = rows
    return rows


def _decode_step(
    heads: Tensor,  # [B, S, Hq + 2 * Hkv, D] the projected rows
    kv_cache: Tensor,  # [num_pages, 2, Hkv, page_size, D], written in place
    plan: DensePlan,  # a row-invariant plan (causal, write_kv, few rows)
    positions: Tensor,  # int [B, S]
    rope_cos_sin: Tensor,  # fp32 [max_position, rotary_dim]
    q_norm_weight: Tensor | None,
    k_norm_weight: Tensor | None,
    hq: int,
    sliding_window: int,
    scale: float,
    eps: float,
) -> Tensor:  # [B, S, Hq * D] in heads.dtype, padding rows zero
    """Decode / verify attention: each valid row attends alone (module docstring).

    q and k are normalized and rotated together (the same formula as
    :func:`edgebuild.ops.rope.apply_rope`, with the step's cos/sin rows built once), K/V are
    written with one scatter, and every valid row runs as its own one-query problem: by
    edgebuild's C++ kernel where it builds (:mod:`edgebuild.ops.attention_kernel`: K/V read in
    place from the pages, fp32 math), else by :func:`_sdpa_rows` (the pages gathered, one
    ``[R, Hq, 1, D]`` SDPA over key columns padded to a multiple of KEY_ALIGN and masked past
    the row, in the model dtype with fp32 softmax inside). Both are row-invariant.
    """
    bsz, rows, width, d = heads.shape
    hkv = (width - hq) // 2
    dtype = heads.dtype
    if _kernel_takes(heads, kv_cache, plan):  # one C++ call: norms, RoPE, the K/V write and
        # the attention (without norms the same bits as below; the norms' sum is fp64 there)
        return _fused_step(
            heads, kv_cache, plan, positions, rope_cos_sin, hq, sliding_window, scale,
            q_norm_weight, k_norm_weight, eps,
        )  # fmt: skip
    if q_norm_weight is None and k_norm_weight is None:
        qk = heads[:, :, : hq + hkv]
    else:
        q, k = heads[:, :, :hq], heads[:, :, hq : hq + hkv]
        if q_norm_weight is not None:
            q = rms_norm(q, q_norm_weight, eps).to(dtype)
        if k_norm_weight is not None:
            k = rms_norm(k, k_norm_weight, eps).to(dtype)
        qk = torch.cat([q, k], dim=2)
    rot = rope_cos_sin.shape[1]
    if rot:
        qk = rotate_with(qk, *_rope_rows(plan, positions, rope_cos_sin))
    wb, wi = plan.write_b, plan.write_i  # the valid rows
    out = heads.new_zeros(bsz, rows, hq * d)
    if not wb.numel():
        return out
    new = torch.stack([qk[:, :, hq:], heads[:, :, hq + hkv :]], dim=2)  # [B, S, 2, Hkv, D]
    kv_cache[plan.write_pages, :, :, plan.write_offsets, :] = new[wb, wi].to(kv_cache.dtype)
    mask = plan.mask_for(sliding_window)  # [B, S, T]
    if attention_kernel.usable(dtype, kv_cache, d):  # K/V read in place, fp32 (row-invariant)
        key = ("rows_mask", sliding_window)
        row_mask = plan._memo.get(key)
        if row_mask is None:
            row_mask = plan._memo[key] = mask[wb, wi].contiguous()  # [R, T]
        qr = qk[wb, wi, :hq]  # [R, Hq, D]
        o = attention_kernel.decode_attention(qr, kv_cache, plan.page_table, wb, row_mask, scale)
        if wb.numel() == bsz * rows:  # every row is valid (a lone sequence's decode / verify)
            return o.view(bsz, rows, hq * d)
        out[wb, wi] = o
        return out
    return _sdpa_rows(qk, kv_cache, plan, mask, out, hq, scale)


def _kernel_takes(heads: Tensor, kv_cache: Tensor, plan: DensePlan | KernelPlan) -> bool:
    """Whether :func:`edgebuild.ops.attention_kernel.decode_step` runs this step here."""
    return (
        FUSED_STEP
        and heads.is_contiguous()
        and plan.page_table is not None
        and attention_kernel.usable(heads.dtype, kv_cache, heads.shape[-1])
    )


def _draft_step_here(
    heads: Tensor, kv_cache: Tensor, plan: DensePlan | KernelPlan, want_output: bool
) -> bool:
    """Whether :func:`_kernel_step` runs this step: a write-only context update of few rows
    (no output, any row count, so that a context row's cached K never depends on the other
    sequences of the update) or a non-causal block of few rows that writes nothing."""
    return _kernel_takes(heads, kv_cache, plan) and (
        (plan.write_kv and not want_output)  # any row count: a row's K is the same in any batch
        or (not plan.write_kv and want_output and heads.shape[1] <= ROW_INVARIANT_MAX_ROWS)
    )


def _fused_step(
    heads: Tensor, kv_cache: Tensor, plan: DensePlan | KernelPlan, positions: Tensor, rope_cos_sin: Tensor,
    hq: int, sliding_window: int, scale: float, q_norm_weight: Tensor | None = None,
    k_norm_weight: Tensor | None = None, eps: float = 0.0,
) -> Tensor:  # fmt: skip
    """:func:`_decode_step` through :func:`edgebuild.ops.attention_kernel.decode_step`; the
    step's inputs (cos/sin rows, int64 indices, each row's mask) are built once per step and
    shared by the layers (:func:`fused_step_args`)."""
    bsz, rows, _, d = heads.shape
    args = fused_step_args(plan, positions, rope_cos_sin, sliding_window)
    o = attention_kernel.decode_step(
        heads, kv_cache, *args, hq, scale, q_norm_weight, k_norm_weight, eps
    )
    return _scatter_rows(o, heads, args[2], args[3], hq)


def _scatter_rows(o: Tensor, heads: Tensor, wb: Tensor, wi: Tensor, hq: int) -> Tensor:
    """[B, S, Hq * D] from the valid rows' [R, Hq * D] (padding rows zero)."""
    bsz, rows, _, d = heads.shape
    if wb.numel() == bsz * rows:  # every row is valid (a lone sequence's decode / verify)
        return o.view(bsz, rows, hq * d)
    out = heads.new_zeros(bsz, rows, hq * d)
    if wb.numel():
        out[wb, wi] = o
    return out


def _kernel_step(
    heads: Tensor, kv_cache: Tensor, plan: DensePlan | KernelPlan, positions: Tensor, rope_cos_sin: Tensor,
    q_norm_weight: Tensor | None, k_norm_weight: Tensor | None, spec: AttentionSpec,
    want_output: bool,
) -> Tensor | None:  # fmt: skip
    """A DSpark draft's two other steps in one C++ call each
    (:func:`edgebuild.ops.attention_kernel.decode_step`): its context update (the rows' K/V
    normalized, rotated and written, nothing attended: ``want_output`` False), and its block
    pass (non-causal, nothing written: each valid row attends its sequence's cached keys,
    then every valid block row of its sequence). Rows are computed one at a time, so a row's
    bits do not depend on the other rows or sequences of the pass."""
    hq, sliding_window, scale, eps = (
        spec.num_q_heads, spec.sliding_window, spec.scale, spec.rms_norm_eps
    )  # fmt: skip
    if not want_output:
        rows = _step_rows(plan, positions, rope_cos_sin)
        attention_kernel.decode_step(
            heads, kv_cache, *rows, None, hq, scale, q_norm_weight, k_norm_weight, eps
        )
        return None
    *rows, new_mask = block_step_args(plan, positions, rope_cos_sin, sliding_window)
    o = attention_kernel.decode_step(
        heads, kv_cache, *rows, hq, scale, q_norm_weight, k_norm_weight, eps, new_mask
    )
    return _scatter_rows(o, heads, rows[2], rows[3], hq)


def block_step_args(
    plan: DensePlan | KernelPlan, positions: Tensor, rope_cos_sin: Tensor, sliding_window: int
) -> tuple[Tensor, ...]:
    """A DSpark draft block pass's inputs of :func:`edgebuild.ops.attention_kernel.decode_step`
    (a plan that writes nothing, non-causal): ``(cos, sin, write_b, write_i, write_pages,
    write_offsets, page_table, mask, new_mask)``, ``mask`` bool [R, past_width] the cached
    keys each valid row sees, ``new_mask`` bool [R, S] the block rows it sees; built once per
    plan, RoPE table and window."""
    key = ("block", rope_cos_sin.data_ptr(), tuple(rope_cos_sin.shape), sliding_window)
    args = plan._memo.get(key)
    if args is None:
        rows = _step_rows(plan, positions, rope_cos_sin)
        if isinstance(plan, KernelPlan):
            masks = (
                plan.row_masks(sliding_window),
                plan.new_masks(positions.shape[1], sliding_window),
            )
        else:
            mask = plan.row_masks(sliding_window)  # [R, past_width + S]
            masks = mask[:, : plan.past_width], mask[:, plan.past_width :]
        args = plan._memo[key] = (*rows, *(m.contiguous() for m in masks))
    return args


def _cos_sin(
    plan: DensePlan | KernelPlan, positions: Tensor, rope_cos_sin: Tensor
) -> tuple[Tensor, Tensor]:
    """fp32 contiguous [B, S, rotary_dim / 2] cos and sin of the step's rows."""
    if rope_cos_sin.shape[1]:
        return tuple(t.squeeze(2).contiguous() for t in _rope_rows(plan, positions, rope_cos_sin))
    bsz, rows = positions.shape
    zero = torch.zeros(bsz, rows, 0)
    return zero, zero


def fused_step_args(
    plan: DensePlan | KernelPlan, positions: Tensor, rope_cos_sin: Tensor, sliding_window: int
) -> tuple[Tensor, ...]:
    """The step's inputs of :func:`edgebuild.ops.attention_kernel.decode_step` after
    ``heads`` and the cache: ``(cos, sin, write_b, write_i, write_pages, write_offsets,
    page_table, mask)`` (shapes there), built once per plan, RoPE table and window."""
    key = ("fused", rope_cos_sin.data_ptr(), tuple(rope_cos_sin.shape), sliding_window)
    args = plan._memo.get(key)
    if args is None:
        rows = _step_rows(plan, positions, rope_cos_sin)
        args = plan._memo[key] = (*rows, plan.row_masks(sliding_window).contiguous())  # [R, T]
    return args


def write_step_args(
    plan: DensePlan | KernelPlan, positions: Tensor, rope_cos_sin: Tensor
) -> tuple[Tensor, ...]:
    """A write-only step's inputs of :func:`edgebuild.ops.attention_kernel.decode_step` after
    ``heads`` and the cache (a DSpark draft's context update, no mask): ``(cos, sin, write_b,
    write_i, write_pages, write_offsets, page_table)``, memoized on the plan."""
    return _step_rows(plan, positions, rope_cos_sin)


def _step_rows(
    plan: DensePlan | KernelPlan, positions: Tensor, rope_cos_sin: Tensor
) -> tuple[Tensor, ...]:
    """``(cos, sin, write_b, write_i, write_pages, write_offsets, page_table)`` of the step's
    valid rows (memoized on the plan): :func:`fused_step_args` without the mask."""
    key = ("rows", rope_cos_sin.data_ptr(), tuple(rope_cos_sin.shape))
    rows = plan._memo.get(key)
    if rows is None:
        cos, sin = _cos_sin(plan, positions, rope_cos_sin)
        rows = plan._memo[key] = (
            cos, sin, plan.write_b.long().contiguous(), plan.write_i.long().contiguous(),
            plan.write_pages.long().contiguous(), plan.write_offsets.long().contiguous(),
            plan.page_table.contiguous(),
        )  # fmt: skip
    return rows


def _sdpa_rows(
    qk: Tensor, kv_cache: Tensor, plan: DensePlan, mask: Tensor, out: Tensor, hq: int,
    scale: float,
) -> Tensor:  # fmt: skip
    """The torch path of :func:`_decode_step` (no C++ kernel here): the pages gathered densely,
    each valid row one ``scaled_dot_product_attention`` query; fills and returns ``out``."""
    bsz, rows = out.shape[:2]
    d, dtype, wb, wi = qk.shape[-1], out.dtype, plan.write_b, plan.write_i
    hkv = qk.shape[2] - hq
    kt, vt = _gather_pages(kv_cache, plan, dtype)  # [B, Hkv, T, D] each
    if bsz == 1:
        n = wb.numel()
        kr, vr = kt.expand(n, -1, -1, -1), vt.expand(n, -1, -1, -1)
        qr = qk[0, wi, :hq].unsqueeze(2)  # [R, Hq, 1, D]
        o = F.scaled_dot_product_attention(
            qr, kr, vr, attn_mask=mask[0, wi][:, None, None, :], scale=scale,
            enable_gqa=hq != hkv,
        )  # fmt: skip
        out[0, wi] = o.reshape(n, hq * d).to(dtype)
        return out
    # Several sequences: one call per row index i over the sequences that have row i, so
    # the keys are the gathered tensor itself (or a slice of it), never copied per row.
    valid = plan.valid_rows
    for i in range(rows):
        sel = valid[:, i].nonzero().squeeze(1)
        n = sel.numel()
        if n == 0:
            break
        if n == bsz:
            kr, vr, qr, mr = kt, vt, qk[:, i, :hq], mask[:, i]
        elif int(sel[-1] - sel[0]) + 1 == n:  # a contiguous run of sequences: a view
            lo, hi = int(sel[0]), int(sel[-1]) + 1
            kr, vr, qr, mr = kt[lo:hi], vt[lo:hi], qk[lo:hi, i, :hq], mask[lo:hi, i]
        else:
            kr, vr, qr, mr = kt[sel], vt[sel], qk[sel, i, :hq], mask[sel, i]
        o = F.scaled_dot_product_attention(
            qr.unsqueeze(2),
            kr,
            vr,
            attn_mask=mr[:, None, None, :],
            scale=scale,
            enable_gqa=hq != hkv,
        )  # fmt: skip  [n, Hq, 1, D]
        out[sel, i] = o.reshape(n, hq * d).to(dtype)
    return out


def _gather_pages(kv_cache: Tensor, plan: DensePlan, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(K, V) [B, Hkv, T, D] of every sequence in the plan, gathered page by page.

    Whole pages are copied (``index_select`` on the page axis, then one transpose copy),
    several times faster than gathering slot by slot; slots past a sequence's length hold
    stale or other pages' rows, which the plan's mask hides.
    """
    table, ps = plan.page_table, plan.page_size
    bsz, npages = table.shape
    _, _, hkv, _, d = kv_cache.shape
    width = plan.past_width
    need = -(-width // ps)
    if npages < need:  # a wider key span than the table: pad with page 0 (masked)
        table = torch.cat([table, table.new_zeros(bsz, need - npages)], dim=1)
    pages = kv_cache.index_select(0, table[:, :need].reshape(-1))  # [B*need, 2, Hkv, ps, D]
    pages = pages.view(bsz, need, 2 * hkv, ps, d).transpose(1, 2)
    kv = pages.reshape(bsz, 2, hkv, need * ps, d)[:, :, :, :width].to(dtype)
    return kv[:, 0], kv[:, 1]
