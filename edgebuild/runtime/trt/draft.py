"""The TensorRT draft: :class:`TrtDraft`, the DraftBackend over the ``draft`` engine (context
update and block pass in one call, the top-k lattice walked on the host). The overview is
:mod:`edgebuild.runtime.trt_backend`'s docstring.

A full-attention draft's context rows take pages like the target's (one row per position, up
to ``build.max_kv_cache_capacity``). A sliding-window draft keeps a fixed ring per request
(:attr:`BufferPlan.draft_ring <edgebuild.runtime.trt_plan.BufferPlan>`, the rule of
:class:`~edgebuild.runtime.kv_cache.DraftRing`): before a call the ring is rotated so that it
covers the new rows and the block; the engine gets the rotated page table, ``past_lengths``
in ring slots (slot t = position ``base + t``), only the new rows a block can still see, and
their absolute ``context_positions`` / ``block_positions`` (RoPE). The engine's window mask is
on slots, which differ as positions do, so rows of a recycled page that were not rewritten
(slots >= the length, or older than W) are never seen. The block's K/V are never written, so
rejected drafts leave nothing in the ring: it only advances by accepted target rows.
"""

from __future__ import annotations

import torch

from edgebuild.errors import RequestError
from edgebuild.runtime.backend import Proposal
from edgebuild.runtime.kv_cache import PageAllocator, RingSequence, Sequence
from edgebuild.runtime.markov_walk import walk_lattice
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.runtime.trt.buffers import (
    EngineRunner,
    RoleBuffers,
    _on,
    _page_table,
    _reserve,
)
from edgebuild.runtime.trt_plan import (
    BufferPlan,
    Profile,
    RoleIO,
    choose_profile,
)


class TrtDraft:
    """DraftBackend on the ``draft`` engine (:mod:`edgebuild.runtime.trt_backend`).

    Args:
        runner: the draft engine runner.
        io, profiles, plan: as for :class:`TrtTarget`.
        block_size: the draft's block size (slots of the lattice).
        target_layer_ids: the target taps it reads.
        device, stream: as for :class:`TrtTarget`.
    """

    def __init__(
        self,
        runner: EngineRunner,
        io: RoleIO,
        profiles: list[Profile],
        plan: BufferPlan,
        block_size: int,
        target_layer_ids: tuple[int, ...],
        vocab_size: int,
        device: torch.device | str = "cuda",
        stream=None,
    ):
        self.runner, self.io, self.profiles, self.stream = runner, io, profiles, stream
        self.limits = plan.limits
        self.block_size = block_size
        self.target_layer_ids = tuple(target_layer_ids)
        self.vocab_size = vocab_size
        self.buffers = RoleBuffers(plan, "draft", io, device)
        self.ring = plan.draft_ring  # None: a full-attention draft (module docstring)
        self.allocator = PageAllocator(
            plan.draft_pages or self.limits.num_pages, self.limits.page_size
        )
        self.has_confidence = "draft_confidence" in io.names()
        self.pending: dict[int, torch.Tensor] = {}  # seq_id -> [m, F] device features
        self.top_k = int(io.get("draft_candidate_ids").dims[-1])

    def new_sequence(self) -> Sequence:
        seq = self.allocator.new_sequence()
        return RingSequence(seq.seq_id) if self.ring else seq

    def context_length(self, seq: Sequence) -> int:
        """Context rows the sequence has seen (its next block sits at this position)."""
        return seq.total if isinstance(seq, RingSequence) else seq.length

    def pages_to_grow(self, seq: Sequence | None, rows: int) -> int:
        """Pages a pass that adds ``rows`` context rows may newly take (``seq`` None: a new
        sequence): a ring takes all its pages at once; a full cache one row per row (the
        block's rows take none: the engine never writes them)."""
        have = len(seq.pages) if seq is not None else 0
        if self.ring:
            return self.ring.pages - have
        length = seq.length if seq is not None else 0
        return max(self.allocator.pages_for(length + rows) - have, 0)

    def free(self, seq: Sequence) -> None:
        self.pending.pop(seq.seq_id, None)
        self.allocator.free(seq)

    def update_context(self, seqs: list[Sequence], features: list[torch.Tensor]) -> None:
        """Remember the new context rows [m_b, n_t * d] (device); the next propose writes them."""
        for s, f in zip(seqs, features, strict=True):
            if s.seq_id in self.pending:
                f = torch.cat([self.pending[s.seq_id], f])
            self.pending[s.seq_id] = f

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
        """One draft call per chunk of at most max-batch sequences: context update + block
        (``constraints``: per sequence its grammar's DraftMask or None, for the walk)."""
        out = []
        step = self.limits.max_batch
        masks = constraints if constraints is not None else [None] * len(seqs)
        for i in range(0, len(seqs), step):
            c = slice(i, i + step)
            out += self._propose_chunk(
                seqs[c], anchors[c], num_tokens[c], params[c], generators[c], masks[c]
            )
        return out

    def _inputs(self, seqs, anchors, layout) -> dict[str, torch.Tensor]:
        past, starts, written, block_at = (torch.tensor(v, dtype=torch.int32) for v in layout)
        width = max(1, int(written.max()))
        ar = torch.arange(width, dtype=torch.int32)[None, :]
        block = torch.arange(self.block_size, dtype=torch.int32)[None, :]
        return {
            "context_positions": starts[:, None] + ar,
            "context_lengths": written,
            "past_lengths": past,
            "anchor_ids": torch.tensor(anchors, dtype=torch.int32),
            "block_positions": block_at[:, None] + block,
            "page_table": _page_table(self.allocator, seqs, self.limits.pages_per_seq),
        }

    def _place(self, seqs, feats, counts) -> tuple[list, tuple]:
        """Make room for the call's context rows: pages (full cache) or the ring's rotation.

        Returns the rows to write per sequence and the layout: slots before them
        (``past_lengths``), their first position, their count, the block's first position.

        Raises:
            CacheCapacityError: no pages (or no free ring); nothing is taken then.
        """
        if self.ring is None:
            _reserve(self.allocator, self.limits, seqs, counts)
            past = [s.length for s in seqs]
            ends = [p + m for p, m in zip(past, counts, strict=True)]
            return feats, (past, past, counts, ends)
        rows, layout, done = [], ([], [], [], []), []
        try:
            for s, f, m in zip(seqs, feats, counts, strict=True):
                done.append((s, self.ring.state(s)))
                self.ring.make_room(self.allocator, s, s.total + m + self.block_size)
                first = self.ring.first_written(s, m)  # older rows: no block sees them
                rows.append(None if f is None else f[first - s.total :])
                for column, v in zip(layout, (first - s.base, first, s.total + m - first,
                                              s.total + m), strict=True):  # fmt: skip
                    column.append(v)
        except BaseException:
            self._unplace(done)
            raise
        return rows, layout

    def _unplace(self, done: list) -> None:
        for s, state in reversed(done):
            if self.ring is None:
                self.allocator.truncate(s, state)
            else:
                self.ring.restore(self.allocator, s, state)

    def _commit(self, seqs, counts) -> None:
        for s, m in zip(seqs, counts, strict=True):
            if self.ring is None:
                self.allocator.advance(s, m)
            else:
                self.ring.advance(s, m)
            self.pending.pop(s.seq_id, None)

    def _propose_chunk(
        self, seqs, anchors, num_tokens, params, generators, constraints=None
    ) -> list[Proposal]:
        feats = [self.pending.get(s.seq_id) for s in seqs]
        counts = [0 if f is None else int(f.shape[0]) for f in feats]
        undo = [(s, s.length if self.ring is None else self.ring.state(s)) for s in seqs]
        feats, layout = self._place(seqs, feats, counts)
        width = max(1, max(layout[2]))
        try:
            if width > self.limits.max_input_len:
                raise RequestError(
                    f"{width} new context rows exceed the draft engine's max input length "
                    f"{self.limits.max_input_len}"
                )
            lattice = self._execute(seqs, anchors, feats, layout, width)
        except BaseException:
            self._unplace(undo)
            raise
        self._commit(seqs, counts)
        conf = lattice[2] if self.has_confidence else None
        return walk_lattice(
            lattice[0], lattice[1], conf, num_tokens, params, generators, constraints
        )

    def _execute(self, seqs, anchors, feats, layout, width) -> list[torch.Tensor]:
        """One engine call; the lattice (candidates, scores[, confidence]) on the host."""
        inputs = self._inputs(seqs, anchors, layout)
        profile = choose_profile(self.profiles, {k: tuple(v.shape) for k, v in inputs.items()})
        key = (len(seqs), width) if width <= self.limits.verify_len else None
        with _on(self.stream):
            f_dim = self.io.get("context_features").dims[-1]
            views = self.buffers.bind(inputs, self._device_shapes(len(seqs), width, f_dim))
            ctx = views["context_features"]
            for b, f in enumerate(feats):
                if f is not None and len(f):
                    ctx[b, : f.shape[0]].copy_(f)  # device to device (tap ring -> input)
            self.runner.execute(profile, views, key)
            lattice = [
                self.buffers.read_back(name, views[name])
                for name in ("draft_candidate_ids", "draft_scores", "draft_confidence")
                if name in views
            ]
        if self.stream is not None:
            self.stream.synchronize()  # the walk needs the lattice on the host
        return lattice

    def _device_shapes(self, batch: int, width: int, f_dim: int) -> dict[str, tuple[int, ...]]:
        n, k = self.block_size, self.top_k
        out = {
            "context_features": (batch, width, f_dim),
            "draft_candidate_ids": (batch, n, k),
            "draft_scores": (batch, n, k, k),
        }
        if self.has_confidence:
            out["draft_confidence"] = (batch, n, k)
        return out
