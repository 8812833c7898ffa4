"""The TensorRT draft: :class:`TrtDraft`, the DraftBackend over the ``draft`` engine (context
update and block pass in one call, the top-k lattice walked on the host). The overview is
:mod:`edgebuild.runtime.trt_backend`'s docstring."""

from __future__ import annotations

import torch

from edgebuild.errors import RequestError
from edgebuild.runtime.backend import Proposal
from edgebuild.runtime.kv_cache import PageAllocator, Sequence
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
        self.allocator = PageAllocator(self.limits.num_pages, self.limits.page_size)
        self.has_confidence = "draft_confidence" in io.names()
        self.pending: dict[int, torch.Tensor] = {}  # seq_id -> [m, F] device features
        self.top_k = int(io.get("draft_candidate_ids").dims[-1])

    def new_sequence(self) -> Sequence:
        return self.allocator.new_sequence()

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

    def _inputs(self, seqs, anchors, counts) -> dict[str, torch.Tensor]:
        width = max(1, max(counts))
        past = torch.tensor([s.length for s in seqs], dtype=torch.int32)
        ar = torch.arange(width, dtype=torch.int32)[None, :]
        block = torch.arange(self.block_size, dtype=torch.int32)[None, :]
        return {
            "context_positions": past[:, None] + ar,
            "context_lengths": torch.tensor(counts, dtype=torch.int32),
            "past_lengths": past,
            "anchor_ids": torch.tensor(anchors, dtype=torch.int32),
            "block_positions": (past + torch.tensor(counts, dtype=torch.int32))[:, None] + block,
            "page_table": _page_table(self.allocator, seqs, self.limits.pages_per_seq),
        }

    def _propose_chunk(
        self, seqs, anchors, num_tokens, params, generators, constraints=None
    ) -> list[Proposal]:
        feats = [self.pending.get(s.seq_id) for s in seqs]
        counts = [0 if f is None else int(f.shape[0]) for f in feats]
        width = max(1, max(counts))
        if width > self.limits.max_input_len:
            raise RequestError(
                f"{width} new context rows exceed the draft engine's max input length "
                f"{self.limits.max_input_len}"
            )
        _reserve(self.allocator, self.limits, seqs, counts)
        old = [s.length for s in seqs]
        try:
            inputs = self._inputs(seqs, anchors, counts)
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
        except BaseException:
            for s, length in zip(seqs, old, strict=True):
                self.allocator.truncate(s, length)
            raise
        for s, m in zip(seqs, counts, strict=True):
            self.allocator.advance(s, m)
            self.pending.pop(s.seq_id, None)
        conf = lattice[2] if self.has_confidence else None
        return walk_lattice(
            lattice[0], lattice[1], conf, num_tokens, params, generators, constraints
        )

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
