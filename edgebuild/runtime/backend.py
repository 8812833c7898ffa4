"""The `Backend` protocols the decoders drive, and the data they exchange.

Kept small so that torch (CPU), onnxruntime and TensorRT can all implement them:
a target runs new rows over its paged cache (prefill, decode and verify are the same call with
different row counts) and can roll a sequence back; a draft takes context features and proposes
a block of tokens with the distribution it sampled them from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from edgebuild.runtime.kv_cache import PageAllocator, Sequence
from edgebuild.runtime.sampling import SamplingParams


@dataclass
class TargetStep:
    """Output of one target call for a batch of B sequences.

    logits[b]: fp32 [R_b, V] for the rows asked for; taps[b]: [n_b, n_t * d] concatenated
    tapped hidden states of every new row (None when no taps were asked for).
    """

    logits: list[torch.Tensor]
    taps: list[torch.Tensor] | None


@dataclass
class MultimodalPrefill:
    """The image part of one sequence's prefill (a prompt with images, multimodal-RoPE target).

    Both backends take the same description and splice the image rows themselves: the torch
    backend over its host token embeddings, the TensorRT backend inside the base engine (the
    image pad rows carry ids ``>= vocab_size`` that index its ``image_embeds`` input).

    image_rows: int64 [N] ascending indices, among the prompt's P rows, of the image pad tokens.
    image_embeds: [N, d] their embeddings in the same order (the vision tower's output: a host
        tensor on the torch backend, a device tensor from the visual engine on TensorRT).
    positions: int64 [3, P] (t, h, w) multimodal RoPE positions of the prompt rows.
    rope_delta: decode step j (cache slot P + j) runs at position P + j + rope_delta on every
        axis.
    """

    image_rows: torch.Tensor
    image_embeds: torch.Tensor
    positions: torch.Tensor
    rope_delta: int

    @property
    def num_image_rows(self) -> int:
        """N, the number of image pad rows."""
        return int(self.image_rows.shape[0])


@dataclass
class Proposal:
    """A drafted block for one sequence.

    tokens: the n drafted ids (positions s+1..s+n after the anchor at s).
    q: fp32 [n, K] the distribution each token was drawn from, over ``q_ids[i]`` (one-hot
       when greedy); zero outside those candidates, which keeps rejection sampling exact.
    confidence: fp32 [n] confidence-head probabilities (ones when the draft has no head).
    q_ids: int64 [n, K] the candidate ids q is over; None means q is dense over the
       vocabulary (K = V, candidate j is token j).
    rejected: the one draft after these that was cut because the request's grammar refuses
       it (:mod:`edgebuild.runtime.structured`): counted as rejected, so when all n are
       accepted the next token comes from the residual against its q, not from p_n.
    """

    tokens: list[int]
    q: torch.Tensor
    confidence: torch.Tensor
    q_ids: torch.Tensor | None = None
    rejected: Proposal | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def truncated(self, n: int) -> Proposal:
        """The first n drafts (a confidence cutoff or a budget)."""
        ids = None if self.q_ids is None else self.q_ids[:n]
        if n >= len(self.tokens):
            return self
        return Proposal(self.tokens[:n], self.q[:n], self.confidence[:n], ids)

    def cut(self, n: int) -> Proposal:
        """The first n drafts; draft n (refused by the grammar) kept as ``rejected``."""
        if n >= len(self.tokens):
            return self
        tail = self.truncated(n + 1)
        ids = None if tail.q_ids is None else tail.q_ids[n:]
        refused = Proposal(tail.tokens[n:], tail.q[n:], tail.confidence[n:], ids)
        return dataclasses.replace(self.truncated(n), rejected=refused)

    def dense_q(self, vocab: int) -> torch.Tensor:
        """fp32 [n, vocab] q scattered over the vocabulary (zero outside the candidates)."""
        if self.q_ids is None:
            return self.q.float()
        out = torch.zeros(len(self.tokens), vocab)
        return out.scatter_(1, self.q_ids.long(), self.q.float())

    def token_q(self) -> torch.Tensor:
        """fp32 [n] q of each drafted token (0 if the token is not among its candidates)."""
        tok = torch.tensor(self.tokens, dtype=torch.long)
        if self.q_ids is None:
            return self.q.float().gather(1, tok[:, None]).squeeze(-1)
        hit = self.q_ids.long() == tok[:, None]
        return (self.q.float() * hit).sum(-1)


class TargetBackend(Protocol):
    """Runs the target LLM over a paged KV cache.

    Attributes:
        vocab_size: V, the width of every logits row (padding rows of the head included).
        max_model_len: the most rows (prompt + generated + one verify block) one sequence may
            hold in the cache.
        allocator: the :class:`~edgebuild.runtime.kv_cache.PageAllocator` of its pools (the
            decoders keep the prefix cache there).
    """

    vocab_size: int
    max_model_len: int
    allocator: PageAllocator

    def new_sequence(self) -> Sequence:
        """A new, empty sequence (length 0, no pages) in this backend's KV cache."""
        ...

    def forward(
        self,
        seqs: list[Sequence],
        rows: list[torch.Tensor],  # per sequence int64 [n_b] new token ids
        logits_rows: list[list[int]],  # per sequence row indices (into its n_b rows)
        tap_layers: tuple[int, ...] = (),
        images: list[MultimodalPrefill | None] | None = None,  # per sequence (prefill only)
        prefill: bool = False,
    ) -> TargetStep:
        """Append ``rows[b]`` to sequence ``b`` of the batch and return the asked-for logits.

        Prefill (n_b = prompt length), decode (n_b = 1) and verify (n_b = drafts + 1) are this
        one call; each row's numerics must not depend on how many rows share the pass
        (docs/ARCHITECTURE.md: exactness).

        Args:
            seqs: the B sequences; each grows by n_b rows (their K/V written to the cache).
            rows: int64 [n_b] token ids per sequence, in position order after its last row.
            logits_rows: per sequence, indices in ``[0, n_b)`` of the rows whose logits are
                returned (ascending; e.g. ``[n_b - 1]`` for decode, all rows for verify).
            tap_layers: output-of-layer ids whose hidden states are returned, concatenated in
                this order (the draft's ``target_layer_ids``); ``()`` for none.
            images: per sequence, its prompt's image rows and multimodal RoPE positions
                (prefill of a prompt with images only), else None.
            prefill: the rows are prompt rows (a prefill chunk); a backend that can computes
                them so that a row's bits depend neither on how the prompt is cut into calls
                nor on the other prompts of the call (chunked prefill, prefix cache).

        Returns:
            :class:`TargetStep`: ``logits[b]`` fp32 ``[len(logits_rows[b]), V]``; ``taps[b]``
            ``[n_b, len(tap_layers) * d]`` in the hidden-state dtype (None without
            ``tap_layers``).

        Raises:
            CacheCapacityError: not enough free KV pages (nothing is written).
        """
        ...

    def rollback(self, seq: Sequence, rows: int) -> None:
        """Drop the last ``rows`` rows of ``seq`` (rejected drafts), ``0 <= rows <= length``;
        pages that become empty return to the pool.

        Raises:
            ValueError: ``rows`` outside ``[0, seq.length]``.
        """
        ...

    def free(self, seq: Sequence) -> None:
        """Return every page of ``seq`` to the pool (idempotent)."""
        ...

    def can_fit(self, rows: int) -> bool:
        """True when a sequence of ``rows`` rows fits in the whole KV pool (an empty cache)."""
        ...


class DraftBackend(Protocol):
    """Runs a speculative draft (DSpark) with its own context cache.

    A backend class may also define ``propose_after_context(ctx_seqs, features, *propose's
    arguments)``: :meth:`update_context` then :meth:`propose` in one go, with the same cache
    and proposals (:meth:`edgebuild.runtime.dspark_backend.TorchDraft.propose_after_context`);
    :func:`propose_after_context` (the DSpark decoder's and the step-cost profile's way in)
    calls it then instead of the two.

    Attributes:
        block_size: B, rows of one draft block (anchor + B-1 masks); at most B drafts a step.
        target_layer_ids: the target layers whose hidden states the draft reads (the
            ``tap_layers`` of :meth:`TargetBackend.forward`), in concatenation order.
    """

    block_size: int
    target_layer_ids: tuple[int, ...]

    def new_sequence(self) -> Sequence:
        """A new, empty sequence in the draft's context cache."""
        ...

    def update_context(self, seqs: list[Sequence], features: list[torch.Tensor]) -> None:
        """Append committed context rows to each sequence's context cache.

        Args:
            seqs: the B sequences; each grows by m_b rows.
            features: per sequence ``[m_b, n_t * d]`` target features of its new committed
                rows (``TargetStep.taps`` rows, n_t = len(target_layer_ids)), in the
                target's hidden-state dtype.
        """
        ...

    def propose(
        self,
        seqs: list[Sequence],
        anchors: list[int],
        num_tokens: list[int],
        params: list[SamplingParams],
        generators: list[torch.Generator],
        constraints: list | None = None,
    ) -> list[Proposal]:
        """Draft a block after each sequence's context (block K/V never persist).

        Args:
            seqs: the B sequences (context length s each).
            anchors: the last committed token id of each sequence (at position s).
            num_tokens: drafts wanted per sequence, ``0 <= n_b <= block_size`` (0: a
                budget-cut step, an empty proposal).
            params: sampling settings per sequence (greedy drafts argmax).
            generators: per sequence, the torch.Generator the draws come from.
            constraints: per sequence a grammar's
                :class:`~edgebuild.runtime.structured.DraftMask` or None (None: no grammar
                anywhere): each slot's candidates are filtered by it, so the drafts are
                grammatical and q is the masked distribution; the block ends early where it
                allows no candidate.

        Returns:
            One :class:`Proposal` per sequence: ``n_b`` tokens, fp32 ``q [n_b, K]`` (over
            ``q_ids`` int64 ``[n_b, K]``, or dense over V when ``q_ids`` is None) and fp32
            ``confidence [n_b]``.
        """
        ...

    def free(self, seq: Sequence) -> None:
        """Return every page of ``seq``'s context cache (idempotent)."""
        ...


def propose_after_context(
    draft: DraftBackend,
    ctx_seqs: list[Sequence],
    features: list[torch.Tensor],
    *propose_args,
    **propose_kwargs,
) -> list[Proposal]:
    """``draft.update_context(ctx_seqs, features)`` (skipped without sequences), then
    ``draft.propose(*propose_args, **propose_kwargs)``; in one call where the backend's class
    defines ``propose_after_context`` (:class:`DraftBackend`). The class, not the instance, is
    asked: a wrapper that forwards attributes to a backend (a test's rigged draft) keeps its
    own ``propose``. Returns :meth:`DraftBackend.propose`'s proposals; raises what it raises."""
    if hasattr(type(draft), "propose_after_context"):
        return draft.propose_after_context(ctx_seqs, features, *propose_args, **propose_kwargs)
    if ctx_seqs:
        draft.update_context(ctx_seqs, features)
    return draft.propose(*propose_args, **propose_kwargs)
