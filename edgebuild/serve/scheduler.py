"""Continuous batching: one worker thread owns the model; requests join and leave between steps.

Threads and queues:

- The asyncio side (HTTP handlers) calls :meth:`Scheduler.submit`, which appends a
  :class:`Ticket` to the waiting deque under a lock and wakes the worker; it then awaits the
  ticket's `asyncio.Queue`.
- The worker thread loops: admit waiting tickets (FIFO) while the batch has room
  (`max_batch_size`) and the KV pool has room for their first step; drop cancelled requests
  (freeing their pages); make room for the next step (below); run one `decoder.step` over
  the whole batch (each request keeps its own KV pages, draft context and accepted length);
  post the new text of each request to its queue with `loop.call_soon_threadsafe`; finish
  and free the requests that ended.
- A full system (`max_batch_size + max_queued_requests` requests in flight) refuses new
  requests (429). A client that goes away cancels its ticket; the worker frees its pages
  before the next step. :meth:`Scheduler.close` cancels what is left and joins the worker.

Admission policy (KV pages). Nothing is reserved for a request's worst case: a request is
admitted when the free pages cover, besides what the running batch's next step may take, its
own first step (:meth:`LLM.first_step_pages`: its first prefill chunk beyond the cached
prefix of its prompt, plus the cached pages it attaches that were counted free), and a
sequence's pages grow as it prefills chunk by chunk and decodes (the decoders reserve per
step). "Free" includes evictable prefix-cache pages (cached, no user), which a reservation
takes over, least recently used first. Before every step the worker checks that the free
pages cover what every running request's step may take (its next prompt chunk while in
prefill; else one verify block, plus the draft's context rows and block); when they do not,
it preempts the request that arrived last: its pages are freed, its output and random
generator kept, and it goes back to the front of the queue; when readmitted its cache is
recomputed from prompt + output (:meth:`LLM.resume`, which may start from cached prompt
pages) and it continues where it stopped, its client seeing one stream. The oldest requests
so always progress; a request alone always fits, because a request is refused (400) unless
prompt + max_tokens fit one sequence's capacity, which is at most the pool (every page not
held by the request being free or evictable).

Prefill (runtime/prefill.py): the decoder step runs, before the decode pass of the running
requests, one batched pass over prompt chunks of requests still in prefill under
``--max-num-batched-tokens``; a request's first token is posted after the step that ran its
last chunk.

Only the worker touches the model, the KV allocators and the RequestStates, so there is no
shared mutable model state between requests beyond the paged pools, whose only shared pages
are read-only prefix-cache pages (runtime/kv_cache.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field

from edgebuild.errors import EdgebuildError
from edgebuild.runtime.decoding import RequestState
from edgebuild.runtime.llm import LLM
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.serve.errors import APIError
from edgebuild.serve.metrics import ServeMetrics
from edgebuild.serve.text import next_delta

log = logging.getLogger("edgebuild.serve")

RETRY_AFTER_S = 1  # Retry-After of a 429 (full queue) and of a 503 while shutting down


@dataclass
class Event:
    """A message from the worker to one request.

    kind: "token" (more text), "done" (finished; `text` is the last delta, `final_text` the
    whole output) or "error" (`status`, `message`, `code`, and `retry_after` seconds for a
    temporary refusal). ``logprobs``: the entries (OpenAI chat shape: ``token``, ``logprob``,
    ``bytes``, ``top_logprobs``) of the tokens committed since the previous event, so the
    entries of all events concatenate to one per output token; ``prompt_logprobs``: set on
    the first event after the prompt was prefilled when the request asks for them, one
    entry per prompt token (``token_id``, ``token``, ``bytes``, ``logprob`` and ``rank``,
    None for the first token, and ``top_logprobs``); ``cached_tokens``: prompt tokens served
    from the prefix cache.
    """

    kind: str
    text: str = ""
    final_text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    status: int = 200
    message: str = ""
    code: str | None = None
    retry_after: int | None = None
    metrics: dict = field(default_factory=dict)
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict] | None = None
    cached_tokens: int = 0


class Ticket:
    """One submitted request as the asyncio side sees it.

    Args:
        scheduler: the owning scheduler (woken on cancel).
        request_id: id used in responses and logs.
        prompt_ids: prompt token ids (already checked against the limits).
        params: sampling parameters.
        loop: the event loop that awaits the events.
    """

    def __init__(self, scheduler, request_id, prompt_ids, params, loop):
        self.scheduler = scheduler
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.images: list = []  # preprocessed images (vision-language models)
        self.params: SamplingParams = params
        self.loop: asyncio.AbstractEventLoop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = False  # set by the asyncio side, read by the worker
        self.ended = False  # worker side: a terminal event was posted
        self.arrival = time.perf_counter()
        self.preempted: _Active | None = None  # worker side: its state while requeued
        self.after: Ticket | None = None  # choice i > 0: admitted once choice 0 prefilled
        self.prefilled = False  # worker side: its first token is out (or it ended)
        self._getter: asyncio.Task | None = None

    def cancel(self) -> None:
        """Ask the worker to drop this request and free its pages (idempotent)."""
        if not self.cancelled and not self.ended:
            self.cancelled = True
            self.scheduler.wake()
        if self._getter is not None:
            self._getter.cancel()
            self._getter = None

    def post(self, event: Event) -> None:
        """Worker side: hand `event` to the asyncio side (thread-safe)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled = True

    async def events(self, is_disconnected=None, poll_s: float = 0.5):
        """Yield events up to and including the terminal one; stop early when cancelled.

        Every `poll_s` without an event, `await is_disconnected()` is checked; a client that
        went away cancels the request and ends the iteration.
        """
        while True:
            if self._getter is None:
                self._getter = asyncio.ensure_future(self.queue.get())
            getter = self._getter
            done, _ = await asyncio.wait({getter}, timeout=poll_s)
            if getter.cancelled():  # cancel() was called (the client went away)
                return
            if not done:
                if is_disconnected is not None and await is_disconnected():
                    self.cancel()
                    return
                continue
            event = getter.result()
            self._getter = None
            yield event
            if event.kind != "token":
                return


@dataclass
class _Active:
    """Worker-side record of a running request."""

    ticket: Ticket
    state: RequestState
    sent: str = ""
    first_token_at: float | None = None
    logprobs_sent: int = 0  # entries of state.logprobs already posted
    prompt_logprobs_sent: bool = False


def _internal(exc: Exception) -> str:
    """The client-visible message of an unexpected server-side failure."""
    return f"internal error while running the request: {type(exc).__name__}: {exc}"


class QueueFullError(APIError):
    """Too many requests in flight (HTTP 429)."""

    def __init__(self, limit: int):
        super().__init__(
            429,
            f"the server is busy: {limit} requests are already running or queued "
            "(--max-batch-size + --max-queued-requests); retry later",
            None,
            "queue_full",
            retry_after=RETRY_AFTER_S,
        )


class Scheduler:
    """Runs submitted requests in a continuously batched loop on one worker thread.

    Args:
        llm: the loaded model (owned by the worker once started).
        max_batch_size: most requests stepped together.
        max_queued_requests: most requests waiting beyond a full batch.
        metrics: where to count requests, tokens, queue depth and latency.
    """

    def __init__(
        self,
        llm: LLM,
        max_batch_size: int = 8,
        max_queued_requests: int = 64,
        metrics: ServeMetrics | None = None,
        batch_wait_s: float = 0.0,
    ):
        if max_batch_size < 1 or max_queued_requests < 0:
            raise ValueError("max_batch_size must be >= 1 and max_queued_requests >= 0")
        self.llm = llm
        self.max_batch_size = max_batch_size
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics or ServeMetrics("model")
        self.batch_wait_s = batch_wait_s
        self._cond = threading.Condition()
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._active: list[_Active] = []
        self._inflight = 0
        self._closing = False
        self._draining = False  # shutting down: no new requests
        self._abort = False  # the worker is to end everything in flight with 503
        self._ids = 0
        self._thread: threading.Thread | None = None
        self._token_text: dict[int, str] = {}  # worker side: decoded single tokens

    # ------------------------------------------------------------------ asyncio side
    def start(self) -> None:
        """Start the worker thread."""
        self._thread = threading.Thread(target=self._run, name="edgellm-scheduler", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The worker runs and takes requests (False once shutdown began)."""
        return (
            self._thread is not None
            and self._thread.is_alive()
            and not self._closing
            and not self._draining
        )

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._active)

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, request_id=None, images=None
    ) -> Ticket:
        """Queue a request (call from the event loop); `images`: preprocessed prompt images.

        Raises:
            QueueFullError: too many requests in flight (429).
            APIError: 503 when the server is shutting down.
        """
        return self.submit_choices(prompt_ids, [params], request_id, images)[0]

    def submit_choices(
        self, prompt_ids: list[int], params: list[SamplingParams], request_id=None, images=None
    ) -> list[Ticket]:
        """Queue the ``n = len(params)`` choices of one request, all or none: each is a
        ticket counted in flight (admission, preemption and the 429 limit see every choice).
        Choices after the first wait for the first's prefill, so that with prefix caching on
        they attach its prompt pages instead of computing their own.

        Raises:
            QueueFullError: the choices do not all fit in flight (429).
            APIError: 503 when the server is shutting down.
        """
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._closing or not self.alive:
                raise APIError(
                    503,
                    "the server is shutting down",
                    None,
                    "shutting_down",
                    retry_after=RETRY_AFTER_S,
                )
            limit = self.max_batch_size + self.max_queued_requests
            if self._inflight + len(params) > limit:
                self.metrics.rejected.labels("429").inc()
                raise QueueFullError(limit)
            self._ids += 1
            rid = request_id or f"req-{self._ids}"
            tickets = []
            for i, p in enumerate(params):
                t = Ticket(self, rid if i == 0 else f"{rid}-{i}", prompt_ids, p, loop)
                t.images = list(images or [])
                t.after = tickets[0] if tickets else None
                tickets.append(t)
            self._waiting.extend(tickets)
            self._inflight += len(tickets)
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify()
        return tickets

    def wake(self) -> None:
        """Wake the worker (a request was cancelled)."""
        with self._cond:
            self._cond.notify()

    def begin_shutdown(self) -> None:
        """Refuse new requests with 503; the running and queued ones go on."""
        with self._cond:
            self._draining = True

    def abort_all(self) -> None:
        """Have the worker end every running and queued request with a 503 (thread-safe);
        the worker itself keeps running until :meth:`close`."""
        with self._cond:
            self._draining = True
            self._abort = True
            self._cond.notify()

    def close(self, timeout: float | None = 30.0) -> None:
        """Cancel everything still queued or running (503 to its client); join the worker."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the scheduler worker did not stop within %.0f s", timeout)

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._closing or self._abort or self._waiting or self._active):
                        self._cond.wait()
                    if self._closing:
                        break
                    self._gather_burst_locked()
                    abort, self._abort = self._abort, False
                    admitted = [] if abort else self._admit_locked()
                if abort:
                    self._abort_all()
                    continue
                try:
                    self._iteration(admitted)
                except Exception as exc:  # a bug must not stop the server: fail what ran
                    log.exception("scheduler iteration failed; failing the running requests")
                    self._fail_running(admitted, exc)
        except BaseException:
            log.exception("the scheduler worker crashed")
            raise
        finally:
            self._abort_all()

    def _gather_burst_locked(self) -> None:
        """With nothing running and requests just arrived, wait (lock released) until no new
        one arrived for ``batch_wait_s`` (at most 5x that in all): a burst of prompts then
        shares one batched prefill pass instead of trickling into several (dynamic batching's
        queue delay). Nobody waits on a running stream: with requests running it returns."""
        if self.batch_wait_s <= 0 or self._active or not self._waiting:
            return
        deadline = time.monotonic() + 5 * self.batch_wait_s
        while not (self._closing or self._abort):
            seen = len(self._waiting)
            left = deadline - time.monotonic()
            if left <= 0 or seen >= self.max_batch_size:
                return
            self._cond.wait(min(self.batch_wait_s, left))
            if len(self._waiting) == seen:
                return

    def _iteration(self, admitted: list[Ticket]) -> None:
        """Start the admitted requests, drop cancelled ones, step the batch."""
        for ticket in admitted:
            self._start(ticket)
        for a in [a for a in self._active if a.ticket.cancelled]:
            self._end(a, None, "abort")
        self._make_room()
        if self._active:
            self._step()
        self.metrics.queue_depth(len(self._waiting), len(self._active))

    def _fail_running(self, admitted: list[Ticket], exc: Exception) -> None:
        """After an unexpected error: 500 to every running or just-admitted request."""
        error = Event("error", status=500, message=_internal(exc))
        for a in list(self._active):
            try:
                self._end(a, error, "error")
            except Exception:  # freeing failed too: drop it from the batch regardless
                log.exception("freeing request %s failed", a.ticket.request_id)
                if a in self._active:
                    self._active.remove(a)
                    self._release(a.ticket)
                a.ticket.post(error)
        for ticket in admitted:
            if not ticket.ended:
                self._release(ticket)
                ticket.post(error)

    def _step_pages(self, active: list[_Active]) -> tuple[int, int]:
        """KV pages (target, draft) the next step of `active` may take."""
        need = [self.llm.step_pages(a.state) for a in active]
        return sum(t for t, _ in need), sum(d for _, d in need)

    def _first_step_pages(self, ticket: Ticket) -> tuple[int, int]:
        if ticket.preempted is not None:
            return self.llm.step_pages(ticket.preempted.state)
        return self.llm.first_step_pages(
            ticket.prompt_ids, ticket.images, ticket.params.prompt_logprobs is not None
        )

    def _admit_locked(self) -> list[Ticket]:
        """Pop waiting tickets (FIFO) whose first step fits the KV pool beside the running
        batch's next step (module docstring: admission policy)."""
        out: list[Ticket] = []
        free_t, free_d = self.llm.free_pages()
        run_t, run_d = self._step_pages(self._active)
        free_t, free_d = free_t - run_t, free_d - run_d
        while self._waiting and len(self._active) + len(out) < self.max_batch_size:
            ticket = self._waiting[0]
            if ticket.cancelled:
                self._waiting.popleft()
                self._inflight -= 1
                ticket.ended = True
                continue
            first = ticket.after
            if first is not None and not (first.prefilled or first.ended or self._caching_off):
                break  # its prompt pages are about to be cached by choice 0 (one prefill)
            need_t, need_d = self._first_step_pages(ticket)
            if need_t > free_t or need_d > free_d:
                if not self._active and not out:  # cannot fit even alone: fail it clearly
                    self._waiting.popleft()
                    out.append(ticket)  # _start reports the capacity error
                break  # wait for running requests to free pages (the head keeps its turn)
            self._waiting.popleft()
            free_t, free_d = free_t - need_t, free_d - need_d
            out.append(ticket)
        return out

    def _make_room(self) -> None:
        """Preempt the latest arrivals until the batch's next step fits the free pages; a
        request that does not fit even alone is ended cleanly (:meth:`_out_of_room`)."""
        while self._active:
            free_t, free_d = self.llm.free_pages()
            need_t, need_d = self._step_pages(self._active)
            if need_t <= free_t and need_d <= free_d:
                return
            if len(self._active) == 1:
                self._out_of_room(self._active[0], need_d > free_d)
                return
            self._preempt(max(self._active, key=lambda a: a.ticket.arrival))

    def _out_of_room(self, a: _Active, draft: bool) -> None:
        """End a lone request whose next step does not fit a KV pool (admission keeps
        prompt + max_tokens within :attr:`LLM.max_model_len`, so this is a safety net, never
        a 500 mid-request): with output, it finishes with ``finish_reason`` "length" (vLLM at
        max_model_len); still in prefill, it gets the 400 of a prompt too long."""
        pool = "--max-draft-kv-cache-capacity" if draft else "--max-kv-cache-capacity"
        log.warning("request %s: its next step does not fit the KV pool (%s); ended",
                    a.ticket.request_id, pool)  # fmt: skip
        st = a.state
        if st.anchor is None:
            msg = f"the prompt ({len(st.prompt_ids)} tokens) does not fit the KV pool; raise {pool}"
            self._end(a, Event("error", status=400, message=msg), "error")
            return
        st.stopper.finish_reason = "length"
        delta = next_delta(st.stopper, a.sent)
        a.sent += delta
        self._end(a, self._done_event(a, delta), "length")

    def _preempt(self, a: _Active) -> None:
        """Free a running request's pages and put it back at the front of the queue."""
        self.llm.preempt(a.state)
        self._active.remove(a)
        a.ticket.preempted = a
        with self._cond:
            self._waiting.appendleft(a.ticket)
        self.metrics.preemptions.inc()
        log.info("KV pool full: preempted %s (%d tokens so far)", a.ticket.request_id,
                 len(a.state.output_ids))  # fmt: skip

    def _start(self, ticket: Ticket) -> None:
        """Create the request's decoding state (or recompute a preempted one's cache); a
        failure fails this request only."""
        if ticket.preempted is not None:
            self._resume(ticket)
            return
        free_t, _ = self.llm.free_pages()
        need_t, _ = self._first_step_pages(ticket)
        if not self._active and need_t > free_t:
            self._release(ticket)
            ticket.post(Event("error", status=400, message=self._too_big(ticket)))
            return
        try:
            state = self.llm.new_request(
                ticket.prompt_ids, ticket.params, ticket.request_id, images=ticket.images or None
            )
        except EdgebuildError as exc:
            self._release(ticket)
            ticket.post(Event("error", status=400, message=str(exc)))
            return
        except Exception as exc:  # a bug must fail this request, never the worker
            log.exception("starting request %s failed", ticket.request_id)
            self._release(ticket)
            ticket.post(Event("error", status=500, message=_internal(exc)))
            return
        self.metrics.queue_time.observe(time.perf_counter() - ticket.arrival)
        self.metrics.prompt_tokens.inc(len(ticket.prompt_ids))
        self._active.append(_Active(ticket, state))

    def _too_big(self, ticket: Ticket) -> str:
        alloc = self.llm.target.allocator
        return (
            f"the prompt ({len(ticket.prompt_ids)} tokens) does not fit the KV pool of "
            f"{alloc.num_pages * alloc.page_size} rows (--max-kv-cache-capacity)"
        )

    def _resume(self, ticket: Ticket) -> None:
        a, ticket.preempted = ticket.preempted, None
        try:
            self.llm.resume(a.state)
        except Exception as exc:
            log.exception("recomputing preempted request %s failed", ticket.request_id)
            self.llm.finish(a.state)
            self._release(ticket)
            ticket.post(Event("error", status=500, message=_internal(exc)))
            return
        self._active.append(a)

    def _step(self) -> None:
        """One decoder step over the batch; publish new text; end finished requests."""
        try:
            self.llm.decoder.step([a.state for a in self._active], self._publish_prefilled)
        except Exception as exc:  # a bug or resource failure must not stop the server
            log.exception("decoder step failed; failing the %d running requests", len(self._active))
            for a in list(self._active):
                self._end(a, Event("error", status=500, message=_internal(exc)), "error")
            return
        self.metrics.steps.inc()
        self.metrics.prefill_update(self.llm.decoder.stats)
        now = time.perf_counter()
        for a in list(self._active):
            try:
                self._publish(a, now)
            except Exception as exc:  # e.g. detokenizing: fails this request only
                log.exception("publishing request %s failed", a.ticket.request_id)
                self._end(a, Event("error", status=500, message=_internal(exc)), "error")

    def _publish_prefilled(self, states: list) -> None:
        """Mid-step: post the first tokens of requests whose prefill just finished (before the
        step's decode pass; time to first token one pass shorter). Published tokens are
        cleared so that the end of the step does not count them again."""
        ids = {id(s) for s in states}
        now = time.perf_counter()
        for a in [a for a in self._active if id(a.state) in ids and not a.state.finished]:
            try:
                self._publish(a, now)
            except Exception as exc:  # e.g. detokenizing: fails this request only
                log.exception("publishing request %s failed", a.ticket.request_id)
                self._end(a, Event("error", status=500, message=_internal(exc)), "error")
            a.state.new_tokens = []

    def _publish(self, a: _Active, now: float) -> None:
        """Post the request's new text; end it when it finished."""
        st = a.state
        a.ticket.prefilled = a.ticket.prefilled or st.anchor is not None
        if st.new_tokens:
            self.metrics.generation_tokens.inc(len(st.new_tokens))
            if a.first_token_at is None:
                a.first_token_at = now
                self.metrics.ttft.observe(now - a.ticket.arrival)
        delta = next_delta(st.stopper, a.sent)
        a.sent += delta
        if st.finished and st.grammar is not None and st.grammar.dead:
            msg = (
                "the requested structured output cannot be continued with this model's "
                "vocabulary (no token fits the grammar at some point); simplify the schema / "
                "regex / grammar"
            )
            self._end(
                a, Event("error", status=400, message=msg, code="grammar_unsatisfiable"), "error"
            )
        elif st.finished:
            self._end(a, self._done_event(a, delta), st.stopper.finish_reason)
        elif delta:
            a.ticket.post(
                Event(
                    "token",
                    text=delta,
                    logprobs=self._new_logprobs(a),
                    prompt_logprobs=self._prompt_logprobs(a),
                )
            )

    def _new_logprobs(self, a: _Active) -> list[dict]:
        """The log-probability entries of `a` not posted yet (OpenAI chat shape)."""
        new = a.state.logprobs[a.logprobs_sent :]
        a.logprobs_sent += len(new)
        return [
            {
                **self._token_entry(e.token_id, e.logprob),
                "top_logprobs": [self._token_entry(t, lp) for t, lp in e.top],
            }
            for e in new
        ]

    def _prompt_logprobs(self, a: _Active) -> list[dict] | None:
        """The prompt's log-probability entries of `a`, once, after its prefill (None when
        not asked for or already posted)."""
        st = a.state
        if st.params.prompt_logprobs is None or a.prompt_logprobs_sent or st.anchor is None:
            return None
        a.prompt_logprobs_sent = True
        out = []
        for token_id, e in zip(st.prompt_ids, st.prompt_logprobs, strict=True):
            entry = {**self._token_entry(token_id, None), "token_id": token_id, "rank": None}
            if e is not None:
                entry.update(logprob=e.logprob, rank=e.rank)
            top = [] if e is None else e.top
            entry["top_logprobs"] = [{**self._token_entry(t, lp), "token_id": t} for t, lp in top]
            out.append(entry)
        return out

    def _token_entry(self, token_id: int, logprob: float | None) -> dict:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.llm.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _done_event(self, a: _Active, delta: str) -> Event:
        st = a.state
        return Event(
            "done",
            text=delta,
            final_text=st.stopper.final_text(),
            finish_reason=st.stopper.finish_reason,
            prompt_tokens=len(st.prompt_ids),
            completion_tokens=len(st.output_ids),
            metrics=st.metrics.to_dict(),
            logprobs=self._new_logprobs(a),
            prompt_logprobs=self._prompt_logprobs(a),
            cached_tokens=st.metrics.cached_prompt_tokens,
        )

    @property
    def _caching_off(self) -> bool:
        return not self.llm.decoder.prefill_config.enable_prefix_caching

    def _release(self, ticket: Ticket) -> None:
        """Count the request out of the in-flight total (idempotent)."""
        if ticket.ended:
            return
        with self._cond:
            self._inflight -= 1
            ticket.ended = True

    def _end(self, a: _Active, event: Event | None, reason: str) -> None:
        """Free the request's pages and draft state; post its terminal event."""
        self.llm.finish(a.state)
        self._active.remove(a)
        self._release(a.ticket)
        self.metrics.request_finished(
            reason, a.state.metrics, time.perf_counter() - a.ticket.arrival
        )
        if event is not None:
            a.ticket.post(event)

    def _abort_all(self) -> None:
        """End every running and queued request with the shutdown 503."""
        shutdown = Event(
            "error",
            status=503,
            message="the server is shutting down; retry on another instance or later",
            code="shutting_down",
            retry_after=RETRY_AFTER_S,
        )
        for a in list(self._active):
            self._end(a, shutdown, "abort")
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for ticket in waiting:
            self._release(ticket)
            ticket.post(shutdown)
        self.metrics.queue_depth(0, 0)
