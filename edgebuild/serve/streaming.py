"""Turning a ticket's events into HTTP answers: SSE chunks for streams, one body otherwise.

Streamed chat: a first chunk with `role`, one chunk per text delta, a chunk with the
`finish_reason`, then (with `stream_options.include_usage`) a usage chunk with empty
`choices`, then `data: [DONE]`. A failure after the stream started is sent as an SSE
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
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    Usage,
)
from edgebuild.serve.scheduler import Event, Ticket

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


def _usage(ev: Event) -> Usage:
    return Usage.of(ev.prompt_tokens, ev.completion_tokens)


async def watch_disconnect(request: Request, ticket: Ticket) -> None:
    """Cancel `ticket` as soon as the client's connection closes (the request body has been
    read, so the next ASGI message is the disconnect), so that the worker drops it before
    its next decoder step."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            ticket.cancel()
            return


async def collect(ticket: Ticket, request: Request) -> Event:
    """Wait for the terminal event of a non-streamed request (cancelled at once when the
    client goes away: :func:`watch_disconnect`).

    Raises:
        APIError: the request failed (status from the worker) or the client went away.
    """
    watcher = asyncio.ensure_future(watch_disconnect(request, ticket))
    try:
        async for ev in ticket.events():
            if ev.kind == "done":
                return ev
            if ev.kind == "error":
                raise APIError(ev.status, ev.message, None, ev.code, ev.retry_after)
        raise APIError(400, "the client disconnected", None, "client_disconnected")
    finally:
        watcher.cancel()
        ticket.cancel()


def chat_response(ev: Event, request_id: str, model: str) -> ChatCompletionResponse:
    """The non-streamed chat completion of a finished request."""
    return ChatCompletionResponse(
        id=request_id,
        model=model,
        choices=[
            ChatChoice(
                message=AssistantMessage(content=ev.final_text), finish_reason=ev.finish_reason
            )
        ],
        usage=_usage(ev),
    )


def completion_response(ev: Event, request_id: str, model: str) -> CompletionResponse:
    """The non-streamed text completion of a finished request."""
    return CompletionResponse(
        id=request_id,
        model=model,
        choices=[CompletionChoice(text=ev.final_text, finish_reason=ev.finish_reason)],
        usage=_usage(ev),
    )


async def chat_stream(
    ticket: Ticket, request: Request, request_id: str, model: str, include_usage: bool
) -> AsyncIterator[str]:
    """SSE chunks of a streamed chat completion."""
    created = int(time.time())

    def chunk(delta: DeltaMessage, finish: str | None = None, usage: Usage | None = None) -> str:
        choices = [] if usage is not None else [ChatChunkChoice(delta=delta, finish_reason=finish)]
        return _chunk(
            ChatCompletionChunk(
                id=request_id, created=created, model=model, choices=choices, usage=usage
            )
        )

    try:
        yield chunk(DeltaMessage(role="assistant", content=""))
        async for ev in ticket.events(request.is_disconnected):
            if ev.kind == "error":
                yield sse(error_body(ev.status, ev.message, None, ev.code))
                break
            if ev.text:
                yield chunk(DeltaMessage(content=ev.text))
            if ev.kind == "done":
                yield chunk(DeltaMessage(), ev.finish_reason)
                if include_usage:
                    yield chunk(DeltaMessage(), usage=_usage(ev))
        yield DONE
    finally:
        ticket.cancel()


async def completion_stream(
    ticket: Ticket, request: Request, request_id: str, model: str, include_usage: bool
) -> AsyncIterator[str]:
    """SSE chunks of a streamed text completion."""
    created = int(time.time())

    def chunk(text: str, finish: str | None = None, usage: Usage | None = None) -> str:
        choices = [] if usage is not None else [CompletionChoice(text=text, finish_reason=finish)]
        return _chunk(
            CompletionResponse(
                id=request_id, created=created, model=model, choices=choices, usage=usage
            )
        )

    try:
        async for ev in ticket.events(request.is_disconnected):
            if ev.kind == "error":
                yield sse(error_body(ev.status, ev.message, None, ev.code))
                break
            if ev.kind == "token":
                yield chunk(ev.text)
            else:
                yield chunk(ev.text, ev.finish_reason)
                if include_usage:
                    yield chunk("", usage=_usage(ev))
        yield DONE
    finally:
        ticket.cancel()
