"""The torch (CPU) DSpark draft backend: context cache, block pass and the Markov walk.

The walk (spec/draft-checkpoint-formats.md section 3, "Drafting" and "Top-k pruning"): for
k = 0..n-1, take the top-k candidates of the base logits z_k, add the Markov bias of the
previous token (anchor for k = 0) on those candidates, and draw x_k from the resulting
distribution q_k (argmax when greedy, softmax(scores / T) otherwise); q_k is zero outside the
candidates, which keeps rejection sampling exact. `draft_top_k` 0 uses the full vocabulary
(the whole token map, where the draft's vocabulary is cut to one:
:mod:`edgebuild.speculative.token_map`; column j of the base logits is then token
``token_map[j]``).

**Context cache.** A full-attention draft keeps one paged row per context position (its pages
grow with the context and are counted beside the target's). A windowed draft
(``sliding_window`` W, :class:`~edgebuild.runtime.kv_cache.RingSequence`) owns a fixed ring of
pages per request (:class:`~edgebuild.runtime.kv_cache.DraftRing`: the rule, shared with the
TensorRT draft): slot t holds position ``base + t``, the oldest page moves to the end when a
write or a block would run past the ring, only rows a later block can see are computed, and
the block's rows are never written, so rolling a block back is nothing to undo across the wrap.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from edgebuild.models import common
from edgebuild.models.common import PagedBatch
from edgebuild.models.dspark import DSparkDraft, MarkovHeadType
from edgebuild.ops import attention_fast, attention_kernel
from edgebuild.ops.threads import one_thread
from edgebuild.runtime.backend import Proposal
from edgebuild.runtime.kv_cache import (
    DraftRing,
    PageAllocator,
    RingSequence,
    Sequence,
    allocate_pools,
)
from edgebuild.runtime.markov_walk import (
    constrain,
    draw_rows,
    follow,
    greedy_proposals,
    walk_lattice,
    walk_uniforms,
)
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.runtime.torch_backend import make_batch, pad_rows

log = logging.getLogger("edgebuild.runtime")

LATTICE_MAX_BYTES = 256 * 2**20
"""Largest top-k lattice built at once. It holds ``B x n x K x K`` fp32 scores plus the
``B x n x K x d`` hidden rows of its Markov input, which grows with ``K**2``: a
``draft_top_k`` (or a checkpoint's ``markov_topk``) of 4,096 at batch 28 needed ~15 GB and was
OOM-killed on a 24 GB host. Above this the same walk runs token by token
(:meth:`TorchDraft._walk_by_token`, ``O(B n K)`` memory, the same candidates and scores)."""


def lattice_bytes(batch: int, n: int, k: int, hidden: int) -> int:
    """Bytes of the fp32 tensors of a ``[batch, n]`` top-``k`` lattice (``hidden`` = d)."""
    return 4 * batch * n * k * (k + hidden)


ONE_THREAD_ROWS = 16  # a context update of at most this many rows runs its torch ops alone


class TorchDraft:
    """DraftBackend for a :class:`DSparkDraft` on the CPU.

    Args:
        model: the loaded draft (head and embedding already resolved).
        max_kv_rows: context-cache capacity in rows across sequences.
        page_size: rows per page.
        top_k: candidates per position for the Markov walk (0 = the full vocabulary, or the
            whole token map).
        quant: None, ``"int8"`` or ``"int4"``: how the linears are packed (as the target's).
        ring: a windowed draft's per-request ring (module docstring); default: when its config
            has a ``sliding_window``. False keeps a full paged cache (the reference the ring is
            tested against: same window, every row kept).
        token_map: int ``[V']`` sorted unique token ids the draft's vocabulary is cut to
            (:mod:`edgebuild.speculative.token_map`), or None (the whole vocabulary).
    """

    def __init__(
        self,
        model: DSparkDraft,
        max_kv_rows: int,
        page_size: int,
        top_k: int = 16,
        quant: str | None = None,
        ring: bool | None = None,
        token_map: torch.Tensor | None = None,
    ):
        cfg = model.config
        self.model, self.config = model, cfg
        self.block_size = cfg.block_size
        self.target_layer_ids = tuple(cfg.target_layer_ids)
        self.top_k = top_k
        have = model.token_map
        same_map = (have is None and token_map is None) or (
            have is not None and token_map is not None and torch.equal(have, token_map.long())
        )
        if model.packed_lm_head is None or not same_map:  # packed for this map (or none)
            model.pack_for_cpu(quant, token_map)
        # + one block per page budget: block rows are reserved (never written) during a pass
        num_pages = -(-max_kv_rows // page_size) + 4 * (-(-cfg.block_size // page_size))
        window = cfg.sliding_window if ring or ring is None else None
        self.ring = (
            DraftRing(window, cfg.ring_rows(page_size) // page_size, page_size) if window else None
        )
        self.allocator = PageAllocator(num_pages, page_size)
        dtype = next(model.parameters()).dtype
        self.pools = allocate_pools(
            cfg.num_hidden_layers,
            num_pages,
            page_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype,
        )

    def new_sequence(self) -> Sequence:
        seq = self.allocator.new_sequence()
        return RingSequence(seq.seq_id) if self.ring else seq

    @property
    def ring_pages(self) -> int:
        """Pages of one request's ring (0: a full-attention cache)."""
        return self.ring.pages if self.ring else 0

    def context_length(self, seq: Sequence) -> int:
        """Context rows the sequence has seen (its next block sits at this position)."""
        return seq.total if isinstance(seq, RingSequence) else seq.length

    def pages_to_grow(self, seq: Sequence | None, rows: int) -> int:
        """Pages a step that adds ``rows`` context rows and runs a block may newly take
        (``seq`` None: a new sequence with ``rows`` rows). A ring takes all its pages at once."""
        if self.ring:
            return self.ring.pages - (len(seq.pages) if seq is not None else 0)
        have, length = (len(seq.pages), seq.length) if seq is not None else (0, 0)
        return max(self.allocator.pages_for(length + rows + self.block_size) - have, 0)

    def _ring_update(self, seqs: list[RingSequence], features: list[torch.Tensor]) -> None:
        """Write the rows a later block can see into each ring (module docstring)."""
        rows, starts = [], []
        for s, f in zip(seqs, features, strict=True):
            self.ring.make_room(self.allocator, s, s.total + int(f.shape[0]))
            first = self.ring.first_written(s, int(f.shape[0]))  # older rows: never visible
            rows.append(f[first - s.total :])
            starts.append(first)
        lengths = [int(r.shape[0]) for r in rows]
        past = torch.tensor([st - s.base for s, st in zip(seqs, starts, strict=True)])
        width = max(lengths, default=0)
        if width == 0:
            return
        positions = torch.tensor(starts)[:, None] + torch.arange(width)[None, :]
        batch = PagedBatch(
            page_table=self.allocator.page_table(seqs),
            past_lengths=past.to(torch.int32),
            input_lengths=torch.tensor(lengths, dtype=torch.int32),
            positions=positions.to(torch.int32),
        )
        self.model.context_update(pad_rows(rows, 0), self.pools, batch)
        for s, f in zip(seqs, features, strict=True):
            self.ring.advance(s, int(f.shape[0]))

    def _ring_block(
        self, seqs: list[RingSequence], anchors: list[int], rows: int | None = None
    ) -> torch.Tensor:
        bs = self.block_size
        for s in seqs:
            self.ring.make_room(self.allocator, s, s.total + bs)
        past = torch.tensor([s.length for s in seqs], dtype=torch.int32)
        total = torch.tensor([s.total for s in seqs], dtype=torch.int32)
        batch = PagedBatch(
            page_table=self.allocator.page_table(seqs),
            past_lengths=past,
            input_lengths=torch.full((len(seqs),), bs, dtype=torch.int32),
            positions=(total[:, None] + torch.arange(bs, dtype=torch.int32)[None, :]),
        )
        ids = self.model.block_input_ids(torch.tensor(anchors))
        return self.model.block_forward(ids, self.pools, batch, rows)

    def free(self, seq: Sequence) -> None:
        self.allocator.free(seq)

    @torch.inference_mode()
    def update_context(self, seqs: list[Sequence], features: list[torch.Tensor]) -> None:
        """Append target features [m_b, n_t * d] of sequence b's new context rows."""
        if self.ring:
            self._ring_update(seqs, features)
            return
        lengths = [int(f.shape[0]) for f in features]
        batch = make_batch(self.allocator, seqs, lengths)
        with one_thread() if sum(lengths) <= ONE_THREAD_ROWS else nullcontext():
            self.model.context_update(pad_rows(features, 0), self.pools, batch)
        for s, n in zip(seqs, lengths, strict=True):
            self.allocator.advance(s, n)

    @torch.inference_mode()
    def propose(
        self,
        seqs: list[Sequence],
        anchors: list[int],
        num_tokens: list[int],
        params: list[SamplingParams],
        generators: list[torch.Generator],
        constraints: list | None = None,
    ) -> list[Proposal]:
        """One block pass at positions s..s+B-1 (s = context length), then the Markov walk
        (``constraints``: per sequence its grammar's DraftMask or None, see
        :meth:`DraftBackend.propose`).

        Only the ``max(num_tokens)`` rows that are drafted go through the block's last o_proj /
        MLP (:meth:`DSparkDraft.block_forward` ``rows``) and ``lm_head``.
        """
        bs = self.block_size
        n_max = max(num_tokens, default=0)
        if n_max == 0:  # a budget-cut step: nothing to draft, no block pass
            return [Proposal([], torch.zeros(0, 1), torch.ones(0), None) for _ in seqs]
        if self.ring:  # only the n_max drafted rows leave the block's last layer
            h = self._ring_block(seqs, anchors, n_max)  # the ring's pages hold the block's slots
        else:
            batch = make_batch(self.allocator, seqs, [bs] * len(seqs))
            try:
                ids = self.model.block_input_ids(torch.tensor(anchors))
                h = self.model.block_forward(ids, self.pools, batch, n_max)  # [B, n_max, d]
            finally:
                for s in seqs:  # block K/V never persist: release the reserved pages
                    self.allocator.truncate(s, s.length)
        base = self.model.base_logits(h)  # fp32 [B, n, V] (or [B, n, V'] over a token map)
        with one_thread():
            return self.walk(h, base, anchors, num_tokens, params, generators, constraints)

    @torch.inference_mode()
    def propose_after_context(
        self,
        ctx_seqs: list[Sequence],
        features: list[torch.Tensor],
        seqs: list[Sequence],
        anchors: list[int],
        num_tokens: list[int],
        params: list[SamplingParams],
        generators: list[torch.Generator],
        constraints: list | None = None,
    ) -> list[Proposal]:
        """:meth:`update_context` ``(ctx_seqs, features)``, then :meth:`propose` (the other
        arguments): the same cache, the same proposals (tests/test_draft_program.py). Where
        the draft runs on edgebuild's kernels (:attr:`DSparkDraft.pass_args`; no ring) and
        ``ctx_seqs`` are among ``seqs``, the update, the block pass, the draft's ``lm_head``
        and, for a greedy batch without grammars, the walk are one C++ call
        (:meth:`DSparkDraft.draft_pass`), without the two step plans, the batch bookkeeping
        and the calls' wrappers in Python between them: a SmolLM2 proposal right after a
        target pass (fp32, the interpreter's data from memory) 2.5 -> 1.7 ms at one thread,
        2.2 -> 1.4 ms at two (bench/README.md, runs of 2026-12-06 06:00-07:00 UTC). The
        DSpark decoder calls this instead of the two when the backend's class has it, and
        the start-up step-cost profile times it (LLM.enable_confidence_scheduling). The
        pages a block would take are not reserved (the block writes none), so the free list
        may order pages differently from the two passes' (the same rows either way)."""
        n_max = max(num_tokens, default=0)
        at = {id(s): b for b, s in enumerate(seqs)}
        if (
            n_max == 0
            or self.ring is not None
            or self.model.pass_args is None
            or not common.CPP_LAYERS
            or not attention_fast.FUSED_STEP
            or self.block_size > attention_fast.ROW_INVARIANT_MAX_ROWS
            or not attention_kernel.usable(torch.float32, self.pools[0], self.model.config.head_dim)
            or len(at) != len(seqs)
            or len({id(s) for s in ctx_seqs}) != len(ctx_seqs)
            or any(id(s) not in at for s in ctx_seqs)
        ):
            if ctx_seqs:
                self.update_context(ctx_seqs, features)
            return self.propose(seqs, anchors, num_tokens, params, generators, constraints)
        ctx_len = [0] * len(seqs)
        for s, f in zip(ctx_seqs, features, strict=True):
            ctx_len[at[id(s)]] = int(f.shape[0])
        rows = None  # the adding sequences' new rows in batch order, padded: [C, M, n_t * d]
        adding = sorted(
            ((at[id(s)], f) for s, f in zip(ctx_seqs, features, strict=True) if len(f)),
            key=lambda bf: bf[0],
        )
        if adding:
            rows = adding[0][1].new_zeros(len(adding), max(ctx_len), adding[0][1].shape[-1])
            for c, (b, f) in enumerate(adding):
                rows[c, : f.shape[0]] = f
                self.allocator.reserve(seqs[b], int(f.shape[0]))  # as make_batch does
        past = [s.length for s in seqs]
        walk = None
        greedy = self._greedy_walk(params, constraints, self.model.vocab_columns)
        if greedy and self.model.pass_args["walk"] is not None:
            walk = (self.top_k, num_tokens)  # the walk in the same call (greedy_path's)
        out = self.model.draft_pass(
            rows, ctx_len, anchors, self.pools, self.allocator.page_table(seqs), past, n_max,
            sum(ctx_len) <= ONE_THREAD_ROWS, walk,
        )  # fmt: skip
        for s, n in zip(seqs, ctx_len, strict=True):
            if n:
                self.allocator.advance(s, n)
        if walk is not None:
            return greedy_proposals(*out[2:], num_tokens)
        with one_thread():
            return self.walk(*out, anchors, num_tokens, params, generators, constraints)

    def _greedy_walk(
        self, params: list[SamplingParams], constraints: list | None, vocab: int
    ) -> bool:
        """Whether :meth:`walk` takes the one-call greedy path: candidates cut to
        ``draft_top_k`` below ``vocab`` (the base logits' columns), a head that is not rnn,
        every request greedy, no grammar."""
        head = self.model.markov_head
        return (
            0 < self.top_k < vocab
            and (head is None or head.head_type is not MarkovHeadType.RNN)
            and all(p.greedy for p in params)
            and (constraints is None or all(c is None for c in constraints))
        )

    def walk(
        self,
        h: torch.Tensor,  # [B, n, d] post-norm draft hidden of the drafted rows
        base: torch.Tensor,  # fp32 [B, n, V] base logits ([B, n, V']: the token map's)
        anchors: list[int],
        num_tokens: list[int],
        params: list[SamplingParams],
        generators: list[torch.Generator],
        constraints: list | None = None,
    ) -> list[Proposal]:
        """The Markov walk (module docstring). A greedy batch without grammars walks only the
        path it takes, in one C++ call (:meth:`DSparkDraft.greedy_path`: 0.23 ms a proposal
        against 0.75 ms for the lattice and its walk, in a 2-thread int4 decode; the same
        drafts except at scores tied within the lattice's fp32 rounding; it returns None for
        an rnn head, which is not asked). Otherwise over the top-k lattice, the one walk the
        TensorRT draft runs too (:func:`walk_lattice`); token by token for an rnn head or the
        full vocabulary (``draft_top_k`` 0), where no lattice exists, and for a lattice over
        :data:`LATTICE_MAX_BYTES`."""
        vocab = base.shape[-1]
        k_cand = self.top_k if 0 < self.top_k < vocab else vocab
        head = self.model.markov_head
        rnn = head is not None and head.head_type is MarkovHeadType.RNN
        if self._greedy_walk(params, constraints, vocab):  # only the path taken, in one call
            got = self.model.greedy_path(h, base, torch.tensor(anchors), num_tokens, k_cand)
            if got is not None:
                return greedy_proposals(*got, num_tokens)
        small = lattice_bytes(*h.shape[:2], k_cand, h.shape[-1]) <= LATTICE_MAX_BYTES
        if k_cand < vocab and not rnn and small:
            cand, scores, conf = self.model.lattice(h, base, torch.tensor(anchors), k_cand)
            return walk_lattice(
                cand, scores, conf, num_tokens, params, generators, constraints, base,
                self.model.token_map,
            )  # fmt: skip
        return self._walk_by_token(
            h, base, anchors, num_tokens, params, generators, k_cand, constraints
        )

    def _walk_by_token(
        self, h, base, anchors, num_tokens, params, generators, k_cand, constraints=None
    ):
        """Slot by slot, the Markov bias computed from the token actually chosen before.
        ``base``'s column j is token ``token_map[j]`` with a token map, else token j."""
        model, vocab = self.model, base.shape[-1]
        tmap = model.token_map  # the token id of each column of base, or None (column j is j)
        n_max = max(num_tokens, default=0)
        batch = len(anchors)
        prev = torch.tensor(anchors, dtype=torch.long)
        greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool)
        temps = torch.tensor([float(p.temperature) for p in params])
        uniforms = walk_uniforms(params, generators, num_tokens)
        state = None
        q = torch.zeros(batch, n_max, k_cand)
        ids = torch.zeros(batch, n_max, k_cand, dtype=torch.long)
        conf = torch.ones(batch, n_max)
        tokens = torch.zeros(batch, n_max, dtype=torch.long)
        limit = list(num_tokens)
        for k in range(n_max):
            z = base[:, k]  # [B, V]
            cand = z.topk(k_cand, dim=-1).indices if k_cand < vocab else None  # [B, K] columns
            scores = z if cand is None else z.gather(1, cand)
            if cand is None:  # every column: [B, V] token ids
                tokens_k = (torch.arange(vocab) if tmap is None else tmap).expand(batch, -1)
            else:
                tokens_k = cand if tmap is None else tmap[cand]  # [B, K] token ids
            new_state = None
            if model.markov_head is not None:
                if cand is None and tmap is None:
                    bias, new_state = model.markov_head.step(prev, h[:, k], state)
                else:
                    bias, new_state = model.markov_head.candidate_bias(
                        prev, h[:, k], state, tokens_k
                    )
                scores = scores + bias
            if model.confidence_head is not None:
                conf[:, k] = model.confidence(h[:, k], prev)
            ids[:, k] = tokens_k
            scores = constrain(scores, ids[:, k], constraints, limit, k)
            q[:, k], choice = draw_rows(scores, greedy, temps, uniforms[:, k])
            tokens[:, k] = ids[:, k].gather(1, choice[:, None]).squeeze(-1)
            follow(tokens[:, k], constraints, limit, k)
            prev, state = tokens[:, k].clone(), new_state
        listed = tokens.tolist()
        return [
            Proposal(
                listed[b][:n],
                q[b, :n],
                conf[b, :n],
                q_ids=None if k_cand == vocab and tmap is None else ids[b, :n],
            )
            for b, n in enumerate(limit)
        ]
