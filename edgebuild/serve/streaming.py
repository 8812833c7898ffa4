"""Turning a ticket's events into HTTP answers: SSE chunks for streams, one body otherwise.

Streamed chat: a first chunk with `role` per choice, one chunk per text delta (with the
log-probability entries of every token it carries), a chunk with the `finish_reason` per
choice, then (with `stream_options.include_usage`) a usage chunk with empty `choices` (the
sums over the choices), then `data: [DONE]`. With ``n > 1`` each chunk carries its choice's
``index``; the choices' chunks interleave as their tokens come. A failure after the stream started is sent as an SSE
`{"error": ...}` event, which OpenAI clients raise. Leaving the stream early (the client went
away, or the task was cancelled) cancels the request so the worker frees its KV pages.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from starlette.requests import Request

from edgebuild.serve.errors import APIError, error_body
from edgebuild.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    PromptLogprob,
    PromptLogprobs,
    Usage,
)
from edgebuild.serve.scheduler import Event, Ticket
from edgebuild.serve.tools import ToolCallStream, parse_tool_calls

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _chunk(model) -> str:
    """A chunk without null delta fields and without `usage` unless it is set."""
    d = model.model_dump()
    for choice in d["choices"]:
        if "delta" in choice:
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    if d.get("usage") is None:
        d.pop("usage", None)
    return sse(d)


def _usage(events: list[Event]) -> Usage:
    """Usage of a request: its prompt once, the completion tokens of every choice summed."""
    return Usage.of(
        events[0].prompt_tokens,
        sum(ev.completion_tokens for ev in events),
        min(ev.cached_tokens for ev in events),
    )


class _Chunks:
    """The SSE lines of one stream, chunks of type `kind` (ChatCompletionChunk or
    CompletionResponse) with the stream's id, model and creation time."""

    def __init__(self, kind, request_id: str, model: str):
        self.kind, self.request_id, self.model = kind, request_id, model
        self.created = int(time.time())

    def of(self, choice) -> str:
        """A chunk carrying one choice."""
        return _chunk(self._make([choice]))

    def end(self, done: list[Event], n: int, include_usage: bool) -> list[str]:
        """The last lines: the usage chunk (empty ``choices``; when asked for and all `n`
        choices finished), then ``data: [DONE]``."""
        out = [_chunk(self._make([], _usage(done)))] if include_usage and len(done) == n else []
        return [*out, DONE]

    def _make(self, choices: list, usage: Usage | None = None):
        return self.kind(
            id=self.request_id, created=self.created, model=self.model, choices=choices,
            usage=usage,
        )  # fmt: skip


async def watch_disconnect(request: Request, tickets: list[Ticket]) -> None:
    """Cancel `tickets` as soon as the client's connection closes (the request body has been
    read, so the next ASGI message is the disconnect), so that the worker drops them before
    its next decoder step."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for ticket in tickets:
                ticket.cancel()
            return


async def merged(tickets: list[Ticket], is_disconnected=None) -> AsyncIterator[tuple[int, Event]]:
    """(choice index, event) of every ticket as they come, until each ended."""
    if len(tickets) == 1:
        async for ev in tickets[0].events(is_disconnected):
            yield 0, ev
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, ticket: Ticket) -> None:
        try:
            async for ev in ticket.events(is_disconnected):
                await queue.put((i, ev))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, t)) for i, t in enumerate(tickets)]
    running = len(tickets)
    try:
        while running:
            i, ev = await queue.get()
            if ev is None:
                running -= 1
                continue
            yield i, ev
    finally:
        for task in tasks:
            task.cancel()


async def collect(tickets: list[Ticket], request: Request) -> list[Event]:
    """Wait for the terminal events of a non-streamed request's choices (cancelled at once
    when the client goes away: :func:`watch_disconnect`); each done event carries all the
    log-probability entries of its choice.

    Raises:
        APIError: a choice failed (status from the worker) or the client went away.
    """
    watcher = asyncio.ensure_future(watch_disconnect(request, tickets))
    done: list[Event | None] = [None] * len(tickets)
    entries: list[list[dict]] = [[] for _ in tickets]
    prompt: list[list[dict] | None] = [None] * len(tickets)
    try:
        async for i, ev in merged(tickets):
            entries[i].extend(ev.logprobs)
            prompt[i] = ev.prompt_logprobs if ev.prompt_logprobs is not None else prompt[i]
            if ev.kind == "done":
                ev.logprobs, ev.prompt_logprobs = entries[i], prompt[i]
                done[i] = ev
            elif ev.kind == "error":
                raise APIError(ev.status, ev.message, None, ev.code, ev.retry_after)
        if any(ev is None for ev in done):
            raise APIError(400, "the client disconnected", None, "client_disconnected")
        return done
    finally:
        watcher.cancel()
        for ticket in tickets:
            ticket.cancel()


def _chat_logprobs(ev: Event, wanted: bool) -> ChoiceLogprobs | None:
    return ChoiceLogprobs(content=ev.logprobs) if wanted else None


def _message(ev: Event, tools: bool, forced: bool = False) -> tuple[AssistantMessage, str | None]:
    """The assistant message of a finished choice and its finish_reason (``tool_calls``
    when its text held calls and tools were offered: :mod:`edgebuild.serve.tools`). A
    `forced` call (``tool_choice`` required or named) cut before it completed
    (``max_tokens``) gives no content and no calls, its own finish_reason (``length``):
    the partial markup is not returned as text."""
    if tools:
        content, calls = parse_tool_calls(ev.final_text)
        if calls:
            return AssistantMessage(content=content, tool_calls=calls), "tool_calls"
        if forced:
            return AssistantMessage(content=None), ev.finish_reason
    return AssistantMessage(content=ev.final_text), ev.finish_reason


def prompt_logprobs_of(entries: list[dict] | None, k: int | None) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` from the scheduler's prompt entries
    (:class:`edgebuild.serve.scheduler.Event`): per token after the first, the prompt token
    and its ``k`` most likely alternatives (ranks 1..k), keyed by token id."""
    if k is None or entries is None:
        return None
    out: PromptLogprobs = []
    for e in entries:
        if e["logprob"] is None:
            out.append(None)
            continue
        d = {str(e["token_id"]): PromptLogprob(logprob=e["logprob"], rank=e["rank"],
                                               decoded_token=e["token"])}  # fmt: skip
        for r, t in enumerate(e["top_logprobs"][:k]):
            d.setdefault(
                str(t["token_id"]),
                PromptLogprob(logprob=t["logprob"], rank=r + 1, decoded_token=t["token"]),
            )
        out.append(d)
    return out


def chat_response(
    events: list[Event], request_id: str, model: str, req: ChatCompletionRequest
) -> ChatCompletionResponse:
    """The non-streamed chat completion of a finished request (one choice per event; the
    ``logprobs``, tools and ``prompt_logprobs`` that `req` asks for)."""
    logprobs, tools = bool(req.logprobs), req.uses_tools
    choices = []
    for i, ev in enumerate(events):
        message, finish = _message(ev, tools, req.forces_tool_call)
        choices.append(
            ChatChoice(
                index=i,
                message=message,
                finish_reason=finish,
                logprobs=_chat_logprobs(ev, logprobs),
            )
        )
    return ChatCompletionResponse(
        id=request_id,
        model=model,
        choices=choices,
        usage=_usage(events),
        prompt_logprobs=prompt_logprobs_of(events[0].prompt_logprobs, req.prompt_logprobs),
    )


class CompletionLogprobsBuilder:
    """The legacy completions ``logprobs`` object of one choice, built chunk by chunk
    (``text_offset`` continues across chunks, from the echoed prompt's length)."""

    def __init__(self, offset: int = 0):
        self.offset = offset

    def __call__(self, entries: list[dict], top: int | None = None) -> CompletionLogprobs:
        """The object of ``entries`` (``top``: alternatives kept per token, all if None;
        a prompt's first entry has a null logprob and null alternatives, as in OpenAI)."""
        out = CompletionLogprobs()
        for e in entries:
            out.tokens.append(e["token"])
            out.token_logprobs.append(e["logprob"])
            alts = e["top_logprobs"][:top]
            first = e["logprob"] is None
            out.top_logprobs.append(None if first else {t["token"]: t["logprob"] for t in alts})
            out.text_offset.append(self.offset)
            self.offset += len(e["token"])
        return out

    def echoed(self, entries: list[dict], top: int, echo: str) -> CompletionLogprobs:
        """The prompt's entries (offsets from 0); the output's offsets then start at the
        end of the echoed text."""
        self.offset = 0
        out = self(entries, top)
        self.offset = len(echo)
        return out


def _merge(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    """The entries of `a`, then those of `b`."""
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


def _completion_logprobs(ev: Event, req: CompletionRequest, echo: str) -> CompletionLogprobs | None:
    """The whole ``logprobs`` object of a finished choice (the prompt's entries first
    with ``echo`` + ``logprobs``)."""
    if req.logprobs is None:
        return None
    builder = CompletionLogprobsBuilder(len(echo))
    if not req.echo_logprobs:
        return builder(ev.logprobs)
    head = builder.echoed(ev.prompt_logprobs or [], req.logprobs, echo)
    return _merge(head, builder(ev.logprobs))


def completion_response(
    events: list[Event], request_id: str, model: str, req: CompletionRequest, echo: str = ""
) -> CompletionResponse:
    """The non-streamed text completion of a finished request (``echo``: the prompt text,
    put before each choice's text; with ``logprobs`` too, the prompt's tokens lead
    ``logprobs``; ``prompt_logprobs``: vLLM's field)."""
    return CompletionResponse(
        id=request_id,
        model=model,
        choices=[
            CompletionChoice(
                index=i,
                text=echo + ev.final_text,
                finish_reason=ev.finish_reason,
                logprobs=_completion_logprobs(ev, req, echo),
                prompt_logprobs=prompt_logprobs_of(ev.prompt_logprobs, req.prompt_logprobs),
            )
            for i, ev in enumerate(events)
        ],
        usage=_usage(events),
    )


async def chat_stream(
    tickets: list[Ticket],
    request: Request,
    request_id: str,
    model: str,
    req: ChatCompletionRequest,
) -> AsyncIterator[str]:
    """SSE chunks of a streamed chat completion (one choice per ticket). With ``tools``,
    ``<tool_call>`` blocks go out as OpenAI tool-call deltas, their arguments piece by piece
    as they are generated (:class:`edgebuild.serve.tools.ToolCallStream`), the rest as
    content; a choice that made calls finishes with ``tool_calls``."""
    lines = _Chunks(ChatCompletionChunk, request_id, model)
    logprobs, tools = bool(req.logprobs), req.uses_tools

    def chunk(i: int, delta: DeltaMessage, finish=None, lp=None) -> str:
        return lines.of(ChatChunkChoice(index=i, delta=delta, finish_reason=finish, logprobs=lp))

    done: list[Event] = []
    streams = [ToolCallStream(req.forces_tool_call) if tools else None for _ in tickets]
    try:
        for i in range(len(tickets)):
            yield chunk(i, DeltaMessage(role="assistant", content=""))
        async for i, ev in merged(tickets, request.is_disconnected):
            if ev.kind == "error":
                yield sse(error_body(ev.status, ev.message, None, ev.code))
                break
            calls = streams[i]
            pieces = [{"content": ev.text}] if calls is None else calls.feed(ev.text)
            if ev.kind == "done" and calls is not None:
                pieces += calls.finish()
            lp = _chat_logprobs(ev, logprobs) if ev.logprobs else None
            if lp is not None and not pieces:
                pieces = [{"content": ""}]  # the entries of tokens held back
            for k, piece in enumerate(pieces):
                if piece.get("content") == "" and lp is None:
                    continue
                yield chunk(i, DeltaMessage(**piece), lp=lp if k == 0 else None)
            if ev.kind == "done":
                done.append(ev)
                finish = "tool_calls" if calls is not None and calls.calls else ev.finish_reason
                yield chunk(i, DeltaMessage(), finish)
        for line in lines.end(done, len(tickets), req.include_usage):
            yield line
    finally:
        for ticket in tickets:
            ticket.cancel()


async def completion_stream(
    tickets: list[Ticket],
    request: Request,
    request_id: str,
    model: str,
    req: CompletionRequest,
    echo: str = "",
) -> AsyncIterator[str]:
    """SSE chunks of a streamed text completion (one choice per ticket; ``echo`` first:
    with ``logprobs`` too each choice's echo chunk carries the prompt's entries, so it goes
    out once the prompt is prefilled)."""
    logprobs, echo_logprobs = req.logprobs, req.echo_logprobs
    lines = _Chunks(CompletionResponse, request_id, model)
    builders = [CompletionLogprobsBuilder(len(echo)) for _ in tickets]

    def chunk(i: int, text: str, finish=None, entries=None) -> str:
        lp = builders[i](entries or []) if logprobs is not None and entries is not None else None
        return _completion_chunk(i, text, finish, lp)

    def _completion_chunk(i: int, text: str, finish, lp) -> str:
        return lines.of(CompletionChoice(index=i, text=text, finish_reason=finish, logprobs=lp))

    done: list[Event] = []
    try:
        if echo and not echo_logprobs:
            for i in range(len(tickets)):
                yield chunk(i, echo)
        async for i, ev in merged(tickets, request.is_disconnected):
            if ev.kind == "error":
                yield sse(error_body(ev.status, ev.message, None, ev.code))
                break
            if echo_logprobs and ev.prompt_logprobs is not None:
                head = builders[i].echoed(ev.prompt_logprobs, logprobs, echo)
                yield _completion_chunk(i, echo, None, head)
            if ev.kind == "token":
                yield chunk(i, ev.text, entries=ev.logprobs)
            else:
                done.append(ev)
                yield chunk(i, ev.text, ev.finish_reason, ev.logprobs)
        for line in lines.end(done, len(tickets), req.include_usage):
            yield line
    finally:
        for ticket in tickets:
            ticket.cancel()
