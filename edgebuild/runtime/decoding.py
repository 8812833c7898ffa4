"""Decoders: target-only and DSpark speculative decoding, as batched steps over requests.

Words used below (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; DSpark, Cheng et al. 2026, arXiv 2607.05147, section 3; spec/draft-checkpoint-formats.md
section 3):

- **anchor**: the newest committed token, at position s, not yet in the target's KV cache.
- **propose**: one draft pass over the block [anchor, mask x (B-1)] followed by the left-to-right
  Markov walk; gives drafts d_1..d_n for positions s+1..s+n and the distributions q_i they were
  drawn from (restricted to the top-k base candidates).
- **verify**: one target pass over [anchor, d_1..d_n] at positions s..s+n; row i gives the
  target distribution p_i for position s+i+1.
- **accept**: keep d_i with probability min(1, p_{i-1}(d_i) / q_i(d_i)), left to right, until
  the first rejection; a = number accepted (greedy: exact match with the target argmax).
- **resample**: after a rejection at i = a+1, draw the correction from
  normalize(max(0, p_a - q_{a+1})) (p_a itself if that mass is <= 1e-8).
- **bonus**: when all n drafts are accepted, draw one more token from p_n.

Each step commits a+1 tokens (tau = a+1 is the accepted length, bonus included). The target
cache keeps [anchor, d_1..d_a] and rolls back n-a rows; the draft's context is extended with the
target features of those a+1 rows. Stops inside the block are honoured token by token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from edgebuild.runtime.backend import DraftBackend, MultimodalPrefill, Proposal, TargetBackend
from edgebuild.runtime.kv_cache import Sequence
from edgebuild.runtime.metrics import RequestMetrics
from edgebuild.runtime.rejection import RESIDUAL_EPS, verify_batch
from edgebuild.runtime.sampling import SamplingParams, sample, target_probs
from edgebuild.runtime.spec_schedule import ConfidenceScheduler
from edgebuild.runtime.stopping import IncrementalDetokenizer, StopChecker


@dataclass
class RequestState:
    """Per-request decoding state; everything here is dropped when the request ends."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stopper: StopChecker
    generator: torch.Generator
    seq: Sequence | None = None
    draft_seq: Sequence | None = None
    anchor: int | None = None  # committed token not yet in the target cache
    pending_features: torch.Tensor | None = None  # [m, n_t*d] target taps not yet in draft cache
    pending_buffer: torch.Tensor | None = None  # storage behind pending_features (draft-less steps)
    prompt_images: MultimodalPrefill | None = None  # image rows + mrope positions (images)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    new_tokens: list[int] = field(default_factory=list)  # committed during the last step

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        stop_token_ids: frozenset[int] = frozenset(),
        detok: IncrementalDetokenizer | None = None,
    ) -> RequestState:
        """A fresh state: its own stop checker (EOS ids + params.stop_token_ids) and generator."""
        stop_ids = frozenset(params.stop_token_ids) | frozenset(stop_token_ids)
        stopper = StopChecker(params.max_tokens, stop_ids, tuple(params.stop), detok)
        return cls(request_id, list(prompt_ids), params, stopper, params.generator())

    @property
    def finished(self) -> bool:
        return self.stopper.finish_reason is not None

    @property
    def output_ids(self) -> list[int]:
        return self.stopper.output_ids

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.stopper.output_ids)


# ---------------------------------------------------------------------- verification parts
# The per-request parts below define the rules; the decoder runs them batched
# (:func:`edgebuild.runtime.rejection.verify_batch`), and the tests hold one to the other.
def accept(
    p: torch.Tensor,  # fp32 [n+1, V] target distributions for rows 0..n
    q: torch.Tensor,  # fp32 [n, V] draft distributions of d_1..d_n
    drafts: list[int],
    greedy: bool,
    generator: torch.Generator,
) -> int:
    """Number of drafts accepted left to right (min(1, p/q) rule; greedy: argmax match)."""
    for i, d in enumerate(drafts):
        if greedy:
            if int(p[i].argmax()) != d:
                return i
            continue
        p_d, q_d = float(p[i, d]), float(q[i, d])
        if q_d <= 0.0:
            return i  # the draft cannot have produced d: treat as rejected
        u = float(torch.rand((), generator=generator))
        if u >= min(1.0, p_d / q_d):
            return i
    return len(drafts)


def resample(p_row: torch.Tensor, q_row: torch.Tensor, greedy: bool, generator) -> int:
    """Correction token after a rejection: from normalize(max(0, p - q)), else from p."""
    if greedy:
        return int(p_row.argmax())
    residual = (p_row - q_row).clamp_min(0.0)
    mass = float(residual.sum())
    if mass <= RESIDUAL_EPS:
        return sample(p_row, generator)
    return sample(residual / mass, generator)


def bonus(p_row: torch.Tensor, greedy: bool, generator) -> int:
    """Extra token when every draft was accepted: a sample from the last target row."""
    return int(p_row.argmax()) if greedy else sample(p_row, generator)


def run_to_completion(decoder: TargetOnlyDecoder, states: list[RequestState]) -> None:
    """Step `states` until all finish (finished ones leave the batch); frees everything."""
    try:
        for st in states:
            if st.seq is None:
                decoder.start(st)
        active = list(states)
        while active:
            decoder.step(active)
            for st in active:
                if st.finished:
                    decoder.finish(st)
            active = [s for s in active if not s.finished]
    finally:
        for st in states:
            decoder.finish(st)


# ---------------------------------------------------------------------- decoders
class TargetOnlyDecoder:
    """Plain autoregressive decoding: one target pass per token (batched across requests)."""

    def __init__(self, target: TargetBackend):
        self.target = target

    def start(self, st: RequestState) -> None:
        st.seq = self.target.new_sequence()

    def finish(self, st: RequestState) -> None:
        if st.seq is not None:
            self.target.free(st.seq)

    def _commit(self, st: RequestState, tokens: list[int]) -> None:
        taken = st.stopper.feed_many(tokens)
        st.new_tokens.extend(taken)
        st.metrics.generated += len(taken)

    def prefill(self, st: RequestState, tap_layers: tuple[int, ...] = ()):
        """Run the prompt and commit the first token; returns the prompt's taps (or None)."""
        t0 = time.perf_counter()
        rows = torch.tensor(st.prompt_ids, dtype=torch.int64)
        images = st.prompt_images
        st.seq.rope_delta = images.rope_delta if images is not None else 0
        out = self.target.forward(
            [st.seq],
            [rows],
            [[len(st.prompt_ids) - 1]],
            tap_layers,
            [images] if images is not None else None,
        )
        token = next_tokens([out.logits[0][-1]], [st.params], [st])[0]
        st.anchor = token
        st.metrics.prefill_s += time.perf_counter() - t0
        st.metrics.prompt_tokens = len(st.prompt_ids)
        self._commit(st, [token])
        return out.taps[0] if out.taps is not None else None

    def step(self, states: list[RequestState]) -> None:
        """Advance every unfinished request by one token (prefill first when needed)."""
        for st in states:
            st.new_tokens = []
        fresh = [s for s in states if s.anchor is None and not s.finished]
        for st in fresh:
            self.prefill(st)
        live = [s for s in states if s not in fresh and not s.finished]
        if not live:
            return
        t0 = time.perf_counter()
        rows = [torch.tensor([s.anchor], dtype=torch.int64) for s in live]
        out = self.target.forward([s.seq for s in live], rows, [[0]] * len(live))
        dt = time.perf_counter() - t0
        tokens = next_tokens([lg[0] for lg in out.logits], [s.params for s in live], live)
        for st, token in zip(live, tokens, strict=True):
            st.anchor = token
            st.metrics.verify_s += dt / len(live)
            st.metrics.record_step(proposed=0, accepted=0)
            self._commit(st, [token])


class DSparkDecoder(TargetOnlyDecoder):
    """DSpark speculative decoding (propose -> verify -> accept -> resample | bonus).

    Args:
        target: the target backend (must return taps of `draft.target_layer_ids`).
        draft: the draft backend.
        num_speculative_tokens: n, 1..block_size drafts per step.
        confidence_threshold: static cutoff tau: the proposal stops at the first position
            whose confidence is below it (0 = off; DeepSpec `_confident_prefix_length`).
        scheduler: load-aware confidence scheduling
            (:class:`edgebuild.runtime.spec_schedule.ConfidenceScheduler`): each step verifies
            the per-request lengths that pay for themselves under the current batch, and
            skips the draft pass when none does. None = every request verifies n (or up to
            the static cutoff).
    """

    def __init__(
        self,
        target: TargetBackend,
        draft: DraftBackend,
        num_speculative_tokens: int,
        confidence_threshold: float = 0.0,
        scheduler: ConfidenceScheduler | None = None,
    ):
        super().__init__(target)
        self.draft = draft
        self.n = num_speculative_tokens
        self.threshold = confidence_threshold
        self.taps = tuple(draft.target_layer_ids)
        self.scheduler = scheduler
        limits = getattr(draft, "limits", None)  # TensorRT: context rows one pass accepts
        self.max_pending = getattr(limits, "max_input_len", None)

    def start(self, st: RequestState) -> None:
        super().start(st)
        st.draft_seq = self.draft.new_sequence()

    def finish(self, st: RequestState) -> None:
        super().finish(st)
        if st.draft_seq is not None:
            self.draft.free(st.draft_seq)
        st.pending_features = st.pending_buffer = None
        if self.scheduler is not None:
            self.scheduler.forget(st.request_id)

    def step(self, states: list[RequestState]) -> None:
        """One speculative step for every unfinished request (prefill first when needed)."""
        for st in states:
            st.new_tokens = []
        fresh = [s for s in states if s.anchor is None and not s.finished]
        for st in fresh:
            st.pending_features = self.prefill(st, self.taps)
        live = [s for s in states if s not in fresh and not s.finished]
        if not live:
            return
        if self.scheduler is not None:
            self._scheduled_step(live)
            return
        proposals = self.propose(live)
        self.verify_and_commit(live, proposals)

    def _scheduled_step(self, live: list[RequestState]) -> None:
        """A step under confidence scheduling (:mod:`edgebuild.runtime.spec_schedule`)."""
        sch = self.scheduler
        t_step = time.perf_counter()
        budgets = [max(0, min(self.n, s.remaining - 1)) for s in live]
        plan = sch.plan([s.request_id for s in live], budgets)
        overdue = self.max_pending is not None and any(
            s.pending_features is not None and len(s.pending_features) >= self.max_pending - 1
            for s in live
        )  # a TensorRT draft takes at most max_input_len context rows in one pass
        if max(plan.lengths, default=0) == 0 and not overdue:
            self._decode_with_taps(live)
            sch.costs.observe([1] * len(live), 0, time.perf_counter() - t_step)
            return
        drafted = min(self.n, max(plan.lengths, default=0) + 1)
        counts = [min(b, drafted) for b in budgets]
        full = self.propose(live, counts)
        choice = sch.choose(
            [sch.calibrated(p.confidence) for p in full],
            [len(p) for p in full],
            draft_rows=max(counts),
        )
        proposals = [p.truncated(k) for p, k in zip(full, choice.lengths, strict=True)]
        _, accepted = self.verify_and_commit(live, proposals)
        sch.costs.observe(
            [1 + len(p) for p in proposals], max(counts), time.perf_counter() - t_step
        )
        for st, p, k, a in zip(live, full, choice.lengths, accepted, strict=True):
            sch.record(st.request_id, p.confidence, k, a)

    def _decode_with_taps(self, live: list[RequestState]) -> None:
        """A plain decode pass (no draft pass this step); its taps join the pending context."""
        t0 = time.perf_counter()
        rows = [torch.tensor([s.anchor], dtype=torch.int64) for s in live]
        out = self.target.forward([s.seq for s in live], rows, [[0]] * len(live), self.taps)
        dt = time.perf_counter() - t0
        tokens = next_tokens([lg[0] for lg in out.logits], [s.params for s in live], live)
        for b, (st, token) in enumerate(zip(live, tokens, strict=True)):
            _append_pending(st, out.taps[b][:1])
            st.anchor = token
            st.metrics.verify_s += dt / len(live)
            st.metrics.record_step(proposed=0, accepted=0)
            self._commit(st, [token])

    def propose(self, live: list[RequestState], counts: list[int] | None = None) -> list[Proposal]:
        """Extend the draft context with pending target features, then draft a block each.

        counts: drafts per request (default: n, cut to the remaining budget).
        """
        t0 = time.perf_counter()
        need = [s for s in live if s.pending_features is not None and len(s.pending_features)]
        if need:
            self.draft.update_context(
                [s.draft_seq for s in need], [s.pending_features for s in need]
            )
            for s in need:
                s.pending_features = s.pending_buffer = None
        # Budget: a step commits n+1 tokens at most, so never draft past the remaining budget.
        if counts is None:
            counts = [max(0, min(self.n, s.remaining - 1)) for s in live]
        proposals = self.draft.propose(
            [s.draft_seq for s in live],
            [s.anchor for s in live],
            counts,
            [s.params for s in live],
            [s.generator for s in live],
        )
        if self.threshold > 0:
            proposals = [self._cutoff(p) for p in proposals]
        dt = time.perf_counter() - t0
        for s in live:
            s.metrics.draft_s += dt / len(live)
        return proposals

    def _cutoff(self, prop: Proposal) -> Proposal:
        below = (prop.confidence < self.threshold).nonzero()
        n = int(below[0]) if len(below) else len(prop.tokens)
        return prop.truncated(n)

    def verify_and_commit(
        self, live: list[RequestState], proposals: list[Proposal]
    ) -> tuple[float, list[int]]:
        """Target pass over [anchor, drafts]; accept, resample or bonus; roll back; commit.

        Returns (seconds of the target pass, drafts accepted per request).
        """
        t0 = time.perf_counter()
        rows = [
            torch.tensor([s.anchor, *p.tokens], dtype=torch.int64)
            for s, p in zip(live, proposals, strict=True)
        ]
        out = self.target.forward(
            [s.seq for s in live], rows, [list(range(len(r))) for r in rows], self.taps
        )
        dt = time.perf_counter() - t0
        verdicts = verify_batch(
            out.logits, proposals, [s.params for s in live], [s.generator for s in live]
        )
        for b, (st, prop, v) in enumerate(zip(live, proposals, verdicts, strict=True)):
            n, a = len(prop.tokens), v.accepted
            self.target.rollback(st.seq, n - a)  # keep anchor + accepted drafts
            st.pending_features = out.taps[b][: a + 1]
            st.anchor = v.next_token
            st.metrics.verify_s += dt / len(live)
            st.metrics.record_step(proposed=n, accepted=a)
            self._commit(st, v.tokens(prop.tokens))
        return dt, [v.accepted for v in verdicts]


def _append_pending(st: RequestState, rows: torch.Tensor) -> None:
    """Append target features [m, F] to ``st.pending_features`` in amortised O(m).

    The rows are copied (TensorRT taps live in a ring the next call reuses) into a buffer
    that doubles when full, so the many draft-less steps of a loaded server do not copy the
    whole pending context every step.
    """
    cur, buf = st.pending_features, st.pending_buffer
    n, m = (0 if cur is None else int(cur.shape[0])), int(rows.shape[0])
    fits = buf is not None and n and cur.data_ptr() == buf.data_ptr() and n + m <= buf.shape[0]
    if not fits:
        new = rows.new_empty((max(16, 2 * (n + m)), rows.shape[1]))
        if n:
            new[:n] = cur
        buf = new
    buf[n : n + m] = rows
    st.pending_buffer = buf
    st.pending_features = buf[: n + m]


def next_tokens(
    logits: list[torch.Tensor], params: list[SamplingParams], states: list[RequestState]
) -> list[int]:
    """One token per request from its fp32 [V] logits row: argmax (greedy) or a sample.

    Greedy rows are decided together (one argmax over the stacked rows, first index on ties);
    sampled rows draw from :func:`target_probs` with the request's generator.
    """
    out = torch.stack(logits).argmax(-1).tolist()
    for b, (p, st) in enumerate(zip(params, states, strict=True)):
        if not p.greedy:
            out[b] = sample(target_probs(logits[b], p), st.generator)
    return out
