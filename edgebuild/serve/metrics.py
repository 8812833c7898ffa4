"""Prometheus metrics of the server (GET /metrics): requests, tokens, queue, speculation, latency.

Each server owns its registry (several servers can live in one process, as in the tests).
Updated from the scheduler's worker thread (prometheus_client is thread-safe) and from the
HTTP layer (status codes).

Speculative decoding: `edgellm_spec_decode_steps_total` target passes and
`edgellm_spec_decode_committed_tokens_total` tokens they committed give tau (mean accepted
length, bonus included), exported directly as `edgellm_spec_decode_mean_accepted_length`;
per draft position i (1-based), `..._draft_proposed_total{position}` and
`..._draft_accepted_total{position}` give the acceptance rate at i, exported as
`edgellm_spec_decode_acceptance_rate{position}`.

Prefill (runtime/prefill.py): `edgellm_prefix_cache_queries_total` prompt tokens looked up in
the prefix cache and `edgellm_prefix_cache_hits_total` those found (tokens, as vLLM counts
them), their ratio `edgellm_prefix_cache_hit_rate`; `edgellm_prefill_chunks_total` prompt
chunks run and `edgellm_prefill_passes_total` target passes that ran them (chunks per pass
is the prefill batch size).
"""

from __future__ import annotations

import threading

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from edgebuild.runtime.metrics import RequestMetrics
from edgebuild.runtime.prefill import PrefillStats

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)


class ServeMetrics:
    """All metrics of one server, in its own registry."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._declare_requests(self.registry)
        self._declare_speculation(self.registry)
        self._declare_latency_and_prefill(self.registry)
        self._lock = threading.Lock()
        self._spec = RequestMetrics()
        self._prefill = PrefillStats()  # the decoder's totals when last read
        self._prefix = [0, 0]  # hits, queries counted by this server
        self.speculative = False  # set by the server: count draft-less steps of DSpark too

    def _declare_requests(self, r: CollectorRegistry) -> None:
        """HTTP responses, requests, tokens, queue and steps."""
        self.http_responses = Counter(
            "edgellm_http_responses",
            "HTTP responses by route and status",
            ["route", "status"],
            registry=r,
        )
        self.requests = Counter(
            "edgellm_requests",
            "Generation requests finished, by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "edgellm_requests_rejected",
            "Generation requests refused before running, by status",
            ["status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "edgellm_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter(
            "edgellm_generation_tokens", "Generated (committed) tokens", registry=r
        )
        self.running = Gauge("edgellm_num_requests_running", "Requests in the batch", registry=r)
        self.waiting = Gauge("edgellm_num_requests_waiting", "Requests in the queue", registry=r)
        self.steps = Counter("edgellm_decode_steps", "Batched decoder steps", registry=r)
        self.preemptions = Counter(
            "edgellm_num_preemptions",
            "Running requests preempted (pages freed, requeued, recomputed) for a full KV pool",
            registry=r,
        )

    def _declare_speculation(self, r: CollectorRegistry) -> None:
        """Speculative decoding: passes, committed tokens, tau, acceptance by position."""
        self.spec_steps = Counter(
            "edgellm_spec_decode_steps", "Target passes of speculative requests", registry=r
        )
        self.spec_committed = Counter(
            "edgellm_spec_decode_committed_tokens",
            "Tokens committed by those passes (accepted + bonus/correction)",
            registry=r,
        )
        self.spec_tau = Gauge(
            "edgellm_spec_decode_mean_accepted_length",
            "tau: mean tokens committed per target pass (bonus included)",
            registry=r,
        )
        self.draft_proposed = Counter(
            "edgellm_spec_decode_draft_proposed",
            "Drafts proposed at each position",
            ["position"],
            registry=r,
        )
        self.draft_accepted = Counter(
            "edgellm_spec_decode_draft_accepted",
            "Drafts accepted at each position",
            ["position"],
            registry=r,
        )
        self.acceptance = Gauge(
            "edgellm_spec_decode_acceptance_rate",
            "P(accepted | proposed) at each position",
            ["position"],
            registry=r,
        )

    def _declare_latency_and_prefill(self, r: CollectorRegistry) -> None:
        """TTFT, end-to-end and queue latency; prefix cache and prefill chunks."""
        self.ttft = Histogram(
            "edgellm_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "edgellm_e2e_request_latency_seconds",
            "Arrival to last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "edgellm_request_queue_time_seconds",
            "Arrival to admission into the batch",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefix_queries = Counter(
            "edgellm_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            registry=r,
        )
        self.prefix_hits = Counter(
            "edgellm_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (not recomputed)",
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "edgellm_prefix_cache_hit_rate",
            "Prefix cache hits / queries (tokens) since start",
            registry=r,
        )
        self.prefill_chunks = Counter(
            "edgellm_prefill_chunks", "Prompt chunks prefilled", registry=r
        )
        self.prefill_passes = Counter(
            "edgellm_prefill_passes", "Target passes that ran prompt chunks", registry=r
        )

    def attach_kv(self, llm) -> None:
        """Export the KV pools of ``llm`` (:meth:`~edgebuild.runtime.llm.LLM.kv_usage`, read at
        scrape time), the DSpark draft's beside the target's:

        - ``edgellm_kv_cache_usage_perc{pool}``: fraction of the pool's pages in use (vLLM's
          ``kv_cache_usage_perc``), ``pool`` = ``target`` / ``draft``;
        - ``edgellm_kv_cache_capacity_bytes{pool}``: the pool's bytes (CPU backend);
        - ``edgellm_kv_cache_bytes_per_token{pool}``: K + V bytes of one row, all layers.
        """
        self.registry.register(_KvCollector(llm))

    def attach_schedule(self, scheduler) -> None:
        """Export a :class:`~edgebuild.runtime.spec_schedule.ConfidenceScheduler`'s counters
        (read at scrape time):

        - ``edgellm_spec_decode_scheduled_steps_total`` steps it scheduled, and
          ``edgellm_spec_decode_draft_skipped_steps_total`` those that ran no draft pass;
        - ``edgellm_spec_decode_verify_length_total{length}`` request-steps that verified
          ``length`` drafts (the chosen lengths);
        - ``edgellm_spec_decode_predicted_accepted_tokens_total`` (sum of the calibrated
          cumulative confidences of the chosen drafts) against
          ``edgellm_spec_decode_realised_accepted_tokens_total`` (drafts accepted);
        - ``edgellm_spec_decode_cost_scale{step}``: measured / profiled step time, for
          draft-less (decode) and drafting (speculative) steps.
        """
        self.registry.register(_ScheduleCollector(scheduler))

    def request_finished(self, reason: str, m: RequestMetrics, e2e_s: float) -> None:
        """Count a finished (or aborted) request and fold its decoding metrics in."""
        self.requests.labels(reason).inc()
        self.e2e.observe(e2e_s)
        if not m.proposed_at and not (self.speculative and m.steps):
            return
        self.spec_steps.inc(m.steps)
        self.spec_committed.inc(m.committed)
        for i, (p, a) in enumerate(zip(m.proposed_at, m.accepted_at, strict=True)):
            self.draft_proposed.labels(str(i + 1)).inc(p)
            self.draft_accepted.labels(str(i + 1)).inc(a)
        with self._lock:
            self._spec = self._spec.merge(m)
            self.spec_tau.set(self._spec.tau)
            for i, rate in enumerate(self._spec.acceptance_by_position):
                self.acceptance.labels(str(i + 1)).set(rate)

    def prefill_start(self, stats: PrefillStats) -> None:
        """Count prefill from a decoder's running totals `stats` on (a decoder may have run
        before this server started)."""
        with self._lock:
            self._prefill = stats.copy()

    def prefill_update(self, stats: PrefillStats) -> None:
        """Bring the prefill counters up to a decoder's running totals `stats`."""
        with self._lock:
            last, self._prefill = self._prefill, stats.copy()
            hits = max(0, stats.prefix_hits - last.prefix_hits)
            queries = max(0, stats.prefix_queries - last.prefix_queries)
            self._prefix[0] += hits
            self._prefix[1] += queries
            rate = self._prefix[0] / self._prefix[1] if self._prefix[1] else None
        self.prefix_queries.inc(queries)
        self.prefix_hits.inc(hits)
        self.prefill_chunks.inc(max(0, stats.chunks - last.chunks))
        self.prefill_passes.inc(max(0, stats.passes - last.passes))
        if rate is not None:
            self.prefix_hit_rate.set(rate)

    def queue_depth(self, waiting: int, running: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


class _KvCollector:
    """Prometheus collector over an LLM's KV pools (see attach_kv)."""

    def __init__(self, llm):
        self.llm = llm

    def describe(self):
        """No fixed descriptions: prometheus_client then calls collect() at each scrape."""
        return []

    def collect(self):
        """Usage, capacity and bytes per token of each pool (read at scrape time)."""
        from prometheus_client.core import GaugeMetricFamily

        p = "edgellm_kv_cache_"
        usage = GaugeMetricFamily(p + "usage_perc", "Fraction of KV pages in use", labels=["pool"])
        cap = GaugeMetricFamily(p + "capacity_bytes", "KV pool bytes", labels=["pool"])
        per = GaugeMetricFamily(p + "bytes_per_token", "K+V bytes of one row", labels=["pool"])
        for pool, u in self.llm.kv_usage().items():
            usage.add_metric([pool], 1.0 - u["free_pages"] / u["pages"])
            if u["bytes_per_token"] is not None:
                cap.add_metric([pool], u["pages"] * u["page_size"] * u["bytes_per_token"])
                per.add_metric([pool], u["bytes_per_token"])
        yield from (usage, cap, per)


class _ScheduleCollector:
    """Prometheus collector over a ConfidenceScheduler's stats (see attach_schedule)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def describe(self):
        """No fixed descriptions: prometheus_client then calls collect() at each scrape."""
        return []

    def collect(self):
        """The scheduler's counters as metric families (read at scrape time)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self.scheduler.stats
        p = "edgellm_spec_decode_"
        yield CounterMetricFamily(p + "scheduled_steps", "Steps confidence-scheduled", st.steps)
        yield CounterMetricFamily(
            p + "draft_skipped_steps", "Scheduled steps that ran no draft pass",
            st.skipped_drafts,
        )  # fmt: skip
        lengths = CounterMetricFamily(
            p + "verify_length",
            "Request-steps by drafts verified (chosen length)",
            labels=["length"],
        )
        for k, count in enumerate(list(st.chosen)):
            lengths.add_metric([str(k)], count)
        yield lengths
        yield CounterMetricFamily(
            p + "predicted_accepted_tokens",
            "Sum of calibrated cumulative confidences of the verified drafts",
            st.predicted_accepted,
        )
        yield CounterMetricFamily(
            p + "realised_accepted_tokens", "Verified drafts accepted", st.realised_accepted
        )
        scale = GaugeMetricFamily(
            p + "cost_scale", "Measured / profiled seconds of a step", labels=["step"]
        )
        scale.add_metric(["decode"], self.scheduler.costs.decode_scale)
        scale.add_metric(["speculative"], self.scheduler.costs.spec_scale)
        yield scale
