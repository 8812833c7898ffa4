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

Prefill (:mod:`edgebuild.runtime.prefill`): before the decode / verify pass of the running
requests, a step runs one batched target pass over prompt chunks of the requests still in
prefill (chunked, under the step's token budget, after the pages their prompts found in the
prefix cache); the pass that completes a prompt commits its first token, and with DSpark the
taps of all its rows (the cached pages' taps first) become the draft's pending context.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from edgebuild.ops import f32_linear
from edgebuild.ops.threads import one_thread
from edgebuild.runtime.backend import (
    DraftBackend,
    MultimodalPrefill,
    Proposal,
    TargetBackend,
    propose_after_context,
)
from edgebuild.runtime.kv_cache import Sequence, block_hashes
from edgebuild.runtime.metrics import RequestMetrics
from edgebuild.runtime.prefill import PrefillConfig, PrefillStats
from edgebuild.runtime.processors import TokenLogprob, apply_processors, token_logprobs
from edgebuild.runtime.rejection import RESIDUAL_EPS, verify_batch
from edgebuild.runtime.sampling import SamplingParams, sample, target_probs
from edgebuild.runtime.spec_schedule import ConfidenceScheduler
from edgebuild.runtime.stopping import IncrementalDetokenizer, StopChecker
from edgebuild.runtime.structured import RequestGrammar


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
    # prefill in progress: taps [rows, n_t*d] of the prompt rows in cache so far (cached
    # prefix pages first), and the chained block hashes of the prompt (None: not cached)
    prefill_features: list[torch.Tensor] = field(default_factory=list)
    prompt_hashes: list[bytes] | None = None
    # params.logprobs set: one entry per output token (raw target logits; runtime/processors.py)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # params.prompt_logprobs set: None for the first prompt token, then one entry per prompt
    # token (its raw target log-probability given the tokens before it), filled by prefill
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    grammar: RequestGrammar | None = None  # params.grammar's matcher (runtime/structured.py)

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
        stopper = StopChecker(
            params.max_tokens, stop_ids, tuple(params.stop), detok, min_tokens=params.min_tokens
        )
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
    """Plain autoregressive decoding: one target pass per token (batched across requests).

    Prompts are prefilled as :mod:`edgebuild.runtime.prefill` describes (chunked, batched,
    under a token budget; prefix-cache hits attached at :meth:`start`); a request in prefill
    is not part of that step's decode pass, and its first token is committed by the pass
    that runs the last chunk of its prompt.

    Args:
        target: the target backend (its ``allocator`` holds the prefix cache).
        prefill: prefill settings (already :meth:`PrefillConfig.resolved` for the target).
    """

    def __init__(self, target: TargetBackend, prefill: PrefillConfig | None = None):
        self.target = target
        self.prefill_config = prefill if prefill is not None else PrefillConfig()
        self.prefill_config.validate()
        self.stats = PrefillStats()
        self.taps: tuple[int, ...] = ()  # target layers whose hidden states the draft needs

    # ------------------------------------------------------------------ requests
    def start(self, st: RequestState) -> None:
        """A new cache sequence for `st`, starting with its prompt's cached prefix pages."""
        st.seq = self.target.new_sequence()
        st.prefill_features = []
        if st.anchor is None:  # a (re)started prefill computes the prompt logprobs again
            st.prompt_logprobs = []
        self._attach_prefix(st)

    def finish(self, st: RequestState) -> None:
        if st.seq is not None:
            self.target.free(st.seq)
        st.prefill_features = []

    def _commit(self, st: RequestState, tokens: list[int], rows: torch.Tensor) -> None:
        """Commit ``tokens`` (until a stop); ``rows``: the raw target logits [>= k, V] they
        were chosen from (their log-probabilities when the request asks for them)."""
        taken = st.stopper.feed_many(tokens)
        st.new_tokens.extend(taken)
        st.metrics.generated += len(taken)
        if st.params.logprobs is not None:
            st.logprobs.extend(token_logprobs(rows, taken, st.params.logprobs))
        if st.grammar is not None:
            st.grammar.advance(taken)

    # ------------------------------------------------------------------ prefix cache
    def _caches(self, has_images: bool) -> bool:
        # prompts with images are not cached: their pad tokens do not name the image
        return self.prefill_config.enable_prefix_caching and not has_images

    @staticmethod
    def _reads_cache(st: RequestState) -> bool:
        """Whether `st` may take cached prefix pages: not while it still needs prompt
        logprobs, which need the logits of every prompt row (vLLM skips the cache for them
        too); its pages are still registered for later requests."""
        return st.params.prompt_logprobs is None or st.anchor is not None

    def _prefix_hit(self, prompt_ids: list[int], hashes: list[bytes]) -> list[int]:
        """Cached pages of the prompt's longest cached prefix; never the whole prompt (its
        last token is always recomputed, for its logits); with taps, only pages cached with
        their taps."""
        alloc = self.target.allocator
        pages = alloc.match(hashes[: (len(prompt_ids) - 1) // alloc.page_size])
        if self.taps:
            payloads = alloc.payloads(pages)
            n = next((i for i, p in enumerate(payloads) if p is None), len(pages))
            pages = pages[:n]
        return pages

    def _attach_prefix(self, st: RequestState) -> None:
        st.prompt_hashes = None
        if not self._caches(st.prompt_images is not None):
            return
        alloc = self.target.allocator
        st.prompt_hashes = block_hashes(st.prompt_ids, alloc.page_size)
        pages = self._prefix_hit(st.prompt_ids, st.prompt_hashes) if self._reads_cache(st) else []
        alloc.attach(st.seq, pages)
        if self.taps:
            st.prefill_features = list(alloc.payloads(pages))
        hit = len(pages) * alloc.page_size
        st.metrics.cached_prompt_tokens = hit
        self.stats.prefix_queries += len(st.prompt_ids)
        self.stats.prefix_hits += hit

    def register_prompt(self, st: RequestState, features: torch.Tensor | None) -> None:
        """Cache the full prompt pages of `st` (written by the prefill path), each with the
        target taps [page_size, n_t * d] of its rows when the decoder has taps."""
        if st.prompt_hashes is None:
            return
        alloc, ps = self.target.allocator, self.target.allocator.page_size
        for i in range(st.seq.shared_rows // ps, len(st.prompt_hashes)):
            payload = None if features is None else features[i * ps : (i + 1) * ps].clone()
            alloc.register(st.seq, i, st.prompt_hashes[i], payload)

    # ------------------------------------------------------------------ prefill
    def _chunk_rows(self, st: RequestState) -> int:
        """Rows of the next prefill chunk of `st` (the whole rest when unchunked or with
        images, whose rows and positions go in one call)."""
        rest = len(st.prompt_ids) - st.seq.length
        if st.params.prompt_logprobs is not None and st.prompt_images is None:
            rest = min(rest, self._logits_rows_cap())
        if not self.prefill_config.enable_chunked_prefill or st.prompt_images is not None:
            return rest
        return min(rest, self.prefill_config.prefill_chunk)

    def _logits_rows_cap(self) -> int:
        """Rows of a prompt whose logprobs are asked for per prefill pass (its logits rows
        [rows, V] fp32 are held on the host): ``prefill_chunk`` (also with chunked prefill
        off), and at most a TensorRT engine's decode / verify length (its ``logits_rows``
        axis: the most logits rows one call returns)."""
        limits = getattr(self.target, "limits", None)  # TensorRT: EngineLimits
        cap = self.prefill_config.prefill_chunk
        return min(cap, limits.verify_len) if limits is not None else cap

    def first_step_pages(
        self, prompt_ids: list[int], has_images: bool, prompt_logprobs: bool = False
    ) -> int:
        """Target pages a new request's first step may take: its first chunk beyond the
        cached prefix (none with ``prompt_logprobs``: the request skips the cache), plus
        the cached pages it attaches that were counted free."""
        alloc, ps = self.target.allocator, self.target.allocator.page_size
        hit = []
        if self._caches(has_images) and not prompt_logprobs:
            hit = self._prefix_hit(prompt_ids, block_hashes(prompt_ids, ps))
        start, n = len(hit) * ps, len(prompt_ids) - len(hit) * ps
        if prompt_logprobs and not has_images:
            n = min(n, self._logits_rows_cap())
        if self.prefill_config.enable_chunked_prefill and not has_images:
            n = min(n, self.prefill_config.prefill_chunk)
        return alloc.evictable_among(hit) + alloc.pages_for(start + n) - len(hit)

    def prefill_step_pages(self, st: RequestState) -> int:
        """Target pages the next chunk of a request in prefill may take."""
        alloc = self.target.allocator
        return max(0, alloc.pages_for(st.seq.length + self._chunk_rows(st)) - len(st.seq.pages))

    def _plan_prefill(self, waiting: list[RequestState], decode_rows: int):
        """Groups of (request, rows) run as one pass each: unchunked, one request a pass;
        chunked, one pass over the first waiting requests (FIFO) whose chunks fit the
        budget beside the decode rows (at least one chunk)."""
        cfg = self.prefill_config
        if not cfg.enable_chunked_prefill:
            return [[(st, self._chunk_rows(st))] for st in waiting]
        group, used = [], decode_rows
        for st in waiting:
            n = self._chunk_rows(st)
            if group and used + n > cfg.max_num_batched_tokens:
                break
            group.append((st, n))
            used += n
        return [group]

    def prefill(self, waiting: list[RequestState], decode_rows: int = 0) -> None:
        """Run this step's prefill chunks of `waiting` (requests without a first token);
        a request whose prompt is complete commits its first token."""
        for group in self._plan_prefill(waiting, decode_rows):
            self._prefill_pass(group)

    def _prefill_pass(self, group: list[tuple[RequestState, int]]) -> None:
        t0 = time.perf_counter()
        rows, images, starts = [], [], []
        for st, n in group:
            pos = st.seq.length
            whole = st.prompt_images is not None and pos == 0
            if whole:
                st.seq.rope_delta = st.prompt_images.rope_delta
            rows.append(torch.tensor(st.prompt_ids[pos : pos + n], dtype=torch.int64))
            images.append(st.prompt_images if whole else None)
            starts.append(pos)
        wanted = [  # every row's logits for prompt logprobs, else the last row's
            list(range(n)) if st.params.prompt_logprobs is not None else [n - 1] for st, n in group
        ]
        out = self.target.forward(
            [st.seq for st, _ in group],
            rows,
            wanted,
            self.taps,
            images if any(m is not None for m in images) else None,
            prefill=True,
        )
        self.stats.passes += 1
        self.stats.chunks += len(group)
        dt = time.perf_counter() - t0
        done, last = [], []
        for b, (st, _) in enumerate(group):
            st.metrics.prefill_s += dt / len(group)
            if self.taps:  # a copy: the TensorRT taps live in a ring the next call reuses
                st.prefill_features.append(out.taps[b].clone())
            if st.params.prompt_logprobs is not None:
                _add_prompt_logprobs(st, starts[b], out.logits[b])
            if st.seq.length == len(st.prompt_ids):
                done.append(st)
                last.append(out.logits[b][-1])
        if done:
            tokens = next_tokens(last, [s.params for s in done], done)
            for st, token, row in zip(done, tokens, last, strict=True):
                self._end_prefill(st, token, row[None])

    def _end_prefill(self, st: RequestState, token: int, row: torch.Tensor) -> None:
        """The prompt is in the cache: cache its pages, hand its taps to the draft, commit
        the first token."""
        features = torch.cat(st.prefill_features) if self.taps else None
        self.register_prompt(st, features)
        st.prefill_features = []
        if self.taps:
            st.pending_features = features
        st.anchor = token
        st.metrics.prompt_tokens = len(st.prompt_ids)
        self._commit(st, [token], row)

    # ------------------------------------------------------------------ steps
    def step(self, states: list[RequestState], on_prefilled=None) -> None:
        """Advance every unfinished request by one token (or one prefill chunk).

        ``on_prefilled(states)``: called after the prefill pass with the requests whose
        prompt it finished (their first token committed), before the decode pass of the same
        step, so a server can stream first tokens one pass earlier.
        """
        for st in states:
            st.new_tokens = []
        live = [s for s in states if s.anchor is not None and not s.finished]
        waiting = [s for s in states if s.anchor is None and not s.finished]
        if waiting:
            self.prefill(waiting, decode_rows=len(live))
            _report_prefilled(waiting, on_prefilled)
        if live:
            self._decode_pass(live)

    def _decode_pass(self, live: list[RequestState], tap_layers: tuple[int, ...] = ()):
        """One target pass over each request's anchor: commit the next token of each.

        Returns the pass's TargetStep (taps [1, n_t * d] per request when asked for).
        """
        t0 = time.perf_counter()
        rows = [torch.tensor([s.anchor], dtype=torch.int64) for s in live]
        out = self.target.forward([s.seq for s in live], rows, [[0]] * len(live), tap_layers)
        dt = time.perf_counter() - t0
        tokens = next_tokens([lg[0] for lg in out.logits], [s.params for s in live], live)
        for b, (st, token) in enumerate(zip(live, tokens, strict=True)):
            st.anchor = token
            st.metrics.verify_s += dt / len(live)
            st.metrics.record_step(proposed=0, accepted=0)
            self._commit(st, [token], out.logits[b][:1])
        return out


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
        prefill: prefill settings (:class:`TargetOnlyDecoder`); the taps of every prefill
            chunk (and those cached with a prefix-cache hit) become the draft's context.
    """

    def __init__(
        self,
        target: TargetBackend,
        draft: DraftBackend,
        num_speculative_tokens: int,
        confidence_threshold: float = 0.0,
        scheduler: ConfidenceScheduler | None = None,
        prefill: PrefillConfig | None = None,
    ):
        super().__init__(target, prefill)
        self.draft = draft
        self.n = num_speculative_tokens
        self.threshold = confidence_threshold
        self.taps = tuple(draft.target_layer_ids)
        self.scheduler = scheduler
        self._last_rows_per_request = 1.0  # verify rows per request of the last scheduled step
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

    def step(self, states: list[RequestState], on_prefilled=None) -> None:
        """One speculative step for every unfinished request (or one prefill chunk);
        ``on_prefilled`` as in :meth:`TargetOnlyDecoder.step`."""
        for st in states:
            st.new_tokens = []
        live = [s for s in states if s.anchor is not None and not s.finished]
        waiting = [s for s in states if s.anchor is None and not s.finished]
        if waiting:
            # the step's verify rows count against the prefill budget: n + 1 per request, or
            # under scheduling what the last verify pass took (often 1: a plain decode)
            per = self.n + 1 if self.scheduler is None else self._last_rows_per_request
            self.prefill(waiting, decode_rows=math.ceil(len(live) * per))
            _report_prefilled(waiting, on_prefilled)
        if not live:
            return
        if self.scheduler is not None:
            self._scheduled_step(live, prefilling=bool(waiting))
            return
        proposals = self.propose(live)
        self.verify_and_commit(live, proposals)

    def _scheduled_step(self, live: list[RequestState], prefilling: bool = False) -> None:
        """A step under confidence scheduling (:mod:`edgebuild.runtime.spec_schedule`).

        ``prefilling``: prompts were prefilled in this step (more may wait): the requests
        that are not pinned verify nothing, so new requests get their first tokens one draft
        pass sooner. A pinned request (sampled with a seed) gets the lengths it chooses
        alone on the reference costs, whatever the batch, the load or the prefill.
        """
        sch = self.scheduler
        t_step = time.perf_counter()
        budgets = [max(0, min(self.n, s.remaining - 1)) for s in live]
        want = self._planned_lengths(live, budgets, prefilling)
        overdue = self.max_pending is not None and any(
            s.pending_features is not None and len(s.pending_features) >= self.max_pending - 1
            for s in live
        )  # a TensorRT draft takes at most max_input_len context rows in one pass
        if max(want, default=0) == 0 and not overdue:
            self._last_rows_per_request = 1.0
            self._decode_with_taps(live)
            sch.costs.observe([1] * len(live), 0, time.perf_counter() - t_step)
            return
        free_max = max((k for s, k in zip(live, want, strict=True) if not _pinned(s)), default=0)
        drafted = min(self.n, free_max + 1) if free_max else 0
        counts = [  # drafts of each: one more than planned, as the choice after may extend
            (min(b, k + 1) if k else 0) if _pinned(s) else min(b, drafted)
            for s, b, k in zip(live, budgets, want, strict=True)
        ]  # a pinned request's by its own plan; the others' by the longest of theirs
        full = self.propose(live, counts)
        lengths = self._chosen_lengths(live, full, max(counts))
        proposals = [p.truncated(k) for p, k in zip(full, lengths, strict=True)]
        self._last_rows_per_request = 1.0 + sum(lengths) / len(live)
        _, accepted = self.verify_and_commit(live, proposals)
        sch.costs.observe(
            [1 + len(p) for p in proposals], max(counts), time.perf_counter() - t_step
        )
        for st, p, k, a in zip(live, full, lengths, accepted, strict=True):
            record = sch.record_pinned if _pinned(st) else sch.record
            record(st.request_id, p.confidence, k, a)

    def _planned_lengths(
        self, live: list[RequestState], budgets: list[int], prefilling: bool
    ) -> list[int]:
        """Before the draft pass: the drafts each request is planned to verify (0 = none);
        the batch's plan for the requests that are not pinned, each pinned one's own."""
        sch = self.scheduler
        free = [i for i, s in enumerate(live) if not _pinned(s)]
        want = [
            0 if i in free else sch.plan_pinned(s.request_id, budgets[i])
            for i, s in enumerate(live)
        ]
        if free:
            plan = sch.plan(
                [live[i].request_id for i in free],
                [0 if prefilling else budgets[i] for i in free],
                batch=len(live),
            )
            for i, k in zip(free, plan.lengths, strict=True):
                want[i] = k
        return want

    def _chosen_lengths(
        self, live: list[RequestState], full: list[Proposal], draft_rows: int
    ) -> list[int]:
        """After the draft pass: the drafts of each proposal to verify (the batch's choice for
        the requests that are not pinned, each pinned one's own)."""
        sch = self.scheduler
        free = [i for i, s in enumerate(live) if not _pinned(s)]
        lengths = [
            0 if i in free else sch.choose_pinned(s.request_id, full[i].confidence)
            for i, s in enumerate(live)
        ]
        if free:
            choice = sch.choose(
                [sch.calibrated(full[i].confidence) for i in free],
                [len(full[i]) for i in free],
                draft_rows=draft_rows,
            )
            for i, k in zip(free, choice.lengths, strict=True):
                lengths[i] = k
        return lengths

    def _decode_with_taps(self, live: list[RequestState]) -> None:
        """A plain decode pass (no draft pass this step): a verify pass of no drafts, so a
        sampled request draws its token as in a step where it verifies none while others
        do (one uniform, inverse CDF); its taps join the pending context. A greedy batch
        without grammars runs target-only's decode pass itself (the same token: the argmax of
        the one row, after the same logits processors), with the taps asked for."""
        if all(s.params.greedy and s.grammar is None for s in live):
            out = self._decode_pass(live, self.taps)
            for b, st in enumerate(live):
                _append_pending(st, out.taps[b][:1])
            return
        for st in live:
            if st.grammar is not None:
                st.grammar.walk([])  # the mask of the one row
        empty = [Proposal([], torch.zeros(0, 1), torch.ones(0), None) for _ in live]
        self.verify_and_commit(live, empty)

    def propose(self, live: list[RequestState], counts: list[int] | None = None) -> list[Proposal]:
        """Extend the draft context with pending target features, then draft a block each.

        counts: drafts per request (default: n, cut to the remaining budget).
        """
        t0 = time.perf_counter()
        need = [s for s in live if s.pending_features is not None and len(s.pending_features)]
        ctx = [s.draft_seq for s in need], [s.pending_features for s in need]
        for s in need:  # handed over (not kept for a retry: an error fails the batch, and a
            s.pending_features = s.pending_buffer = None  # retry could add them twice)
        # Budget: a step commits n+1 tokens at most, so never draft past the remaining budget.
        if counts is None:
            counts = [max(0, min(self.n, s.remaining - 1)) for s in live]
        # the drafts of a request with a grammar are drawn under its mask (runtime/structured.py)
        masks = [None if s.grammar is None else s.grammar.draft_mask() for s in live]
        kw = {"constraints": masks} if any(m is not None for m in masks) else {}
        try:  # the context update and the draft pass (one call where the backend has it)
            proposals = propose_after_context(
                self.draft,
                *ctx,
                [s.draft_seq for s in live],
                [s.anchor for s in live],
                counts,
                [s.params for s in live],
                [s.generator for s in live],
                **kw,
            )
        finally:
            for m in masks:
                if m is not None:
                    m.release()
        if self.threshold > 0:
            proposals = [self._cutoff(p) for p in proposals]
        proposals = [  # the grammar's masks of the rows to verify; refused drafts cut
            p if s.grammar is None else p.cut(s.grammar.walk(p.tokens))
            for s, p in zip(live, proposals, strict=True)
        ]
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
        logits = [
            processed_rows(lg, st, prop.tokens)
            for lg, st, prop in zip(out.logits, live, proposals, strict=True)
        ]
        verdicts = verify_batch(
            logits, proposals, [s.params for s in live], [s.generator for s in live]
        )
        for b, (st, prop, v) in enumerate(zip(live, proposals, verdicts, strict=True)):
            n, a = len(prop.tokens), v.accepted
            self.target.rollback(st.seq, n - a)  # keep anchor + accepted drafts
            _append_pending(st, out.taps[b][: a + 1])  # after what no draft pass took yet
            st.anchor = v.next_token
            st.metrics.verify_s += dt / len(live)
            st.metrics.record_step(proposed=n, accepted=a)
            self._commit(st, v.tokens(prop.tokens), out.logits[b])
        return dt, [v.accepted for v in verdicts]


def _add_prompt_logprobs(st: RequestState, start: int, logits: torch.Tensor) -> None:
    """Append the prompt logprobs of a prefill chunk of `st` at positions ``start..``:
    ``logits`` fp32 [n, V] raw, row j predicting prompt token ``start + j + 1`` (the last
    row of the prompt predicts the first output token: not a prompt entry)."""
    if start == 0:
        st.prompt_logprobs = [None]  # the first prompt token has no context
    nxt = st.prompt_ids[start + 1 : start + 1 + len(logits)]
    st.prompt_logprobs.extend(token_logprobs(logits, nxt, st.params.prompt_logprobs, ranks=True))


def _pinned(st: RequestState) -> bool:
    """A sampled request with a seed, or one that asks for logprobs: its verify lengths must
    not depend on wall-clock costs or on other requests (:mod:`edgebuild.runtime.spec_schedule`,
    "pinned"). A seeded sample follows its lengths; a logprob's last bits follow the width of
    the pass that computed it wherever the kernels are not row-invariant (fp32)."""
    p = st.params
    return (not p.greedy and p.seed is not None) or p.logprobs is not None


def _report_prefilled(waiting: list[RequestState], on_prefilled) -> None:
    """Hand the requests whose prefill just finished to ``on_prefilled`` (if any)."""
    if on_prefilled is not None:
        done = [s for s in waiting if s.anchor is not None]
        if done:
            on_prefilled(done)


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
            with one_thread():  # no OpenMP region: its spinning worker took the kernels' core
                new[:n] = cur
        buf = new
    buf[n : n + m] = rows
    st.pending_buffer = buf
    st.pending_features = buf[: n + m]


def next_tokens(
    logits: list[torch.Tensor], params: list[SamplingParams], states: list[RequestState]
) -> list[int]:
    """One token per request from its fp32 [V] logits row: argmax (greedy) or a sample.

    The request's logits processors run first (:func:`processed_rows`). Greedy rows are
    decided together (one argmax over the stacked rows, first index on ties);
    sampled rows draw from :func:`target_probs` with the request's generator.
    """
    for st in states:
        if st.grammar is not None:
            st.grammar.walk([])  # the mask of the one row
    logits = [processed_rows(lg[None], st)[0] for lg, st in zip(logits, states, strict=True)]
    # one request: no stacked copy (a [1, V] copy is one more OpenMP region a token; at two
    # threads their spinning workers took the core the kernels' pool needed: int4 target-only
    # ran at ~69 tok/s where the DSpark decoder's draft-less steps ran at ~96, bench/README.md)
    rows = logits[0][None] if len(logits) == 1 else torch.stack(logits)
    out = f32_linear.argmax(rows).tolist()  # torch's rule, without an OpenMP region
    for b, (p, st) in enumerate(zip(params, states, strict=True)):
        if not p.greedy:
            out[b] = sample(target_probs(logits[b], p), st.generator)
    return out


def processed_rows(logits: torch.Tensor, st: RequestState, drafts: list[int] = ()) -> torch.Tensor:
    """``logits`` fp32 [R, V] of `st` through its logits processors (row i after its output
    plus ``drafts[:i]``: :func:`edgebuild.runtime.processors.apply_processors`); the same
    tensor when the request has none. Then the grammar's masks of the rows (set by
    :meth:`RequestGrammar.walk` over the same drafts) put what it forbids at -inf."""
    if st.params.has_processors:
        stopper = st.stopper
        logits = apply_processors(
            logits, st.params, st.prompt_ids, stopper.output_ids, drafts, stopper.stop_token_ids
        )
    if st.grammar is not None:
        logits = st.grammar.apply(logits)
    return logits
