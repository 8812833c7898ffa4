"""A seeded request fuzzer: 1,200 random and mutated bodies on both generation endpoints
one at a time, then 240 more eight at a time.

Every body is generated from one seeded `random.Random` (reproducible: the failing index and
body are in the assertion message): valid requests, then field-level mutations (a field set
to a random JSON value of any type, huge and negative numbers, NaN, lone surrogates, long
and deep values, random message lists and content parts, unknown fields, dropped fields),
byte-level mutations of the serialized body (truncated, bytes flipped or inserted), and
non-object bodies. The server runs in-process (httpx's ASGI transport) with its real
scheduler worker over a tiny random model, so valid bodies do run through the decoder.

The oracle: no 5xx at all (the only documented 5xx, 503, happens only while shutting down),
every error is an OpenAI error object, every 200 is a well-formed completion or a stream
ending in `[DONE]`, `/health` is 200 after every request (after every group of eight in the
second phase), and at the end nothing is left in flight and every KV page is free.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from pathlib import Path

import httpx
import pytest
from serve_fixtures import torch_threads, write_tiny_chat_model

from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.serve.app import create_app
from edgebuild.serve.config import ServeConfig, ServeState

SEED = 20261201
N_BODIES = 1200  # one at a time, /health after each
N_CONCURRENT = 240  # then 8 at a time
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "stream",
    "stream_options", "n", "presence_penalty", "frequency_penalty", "logit_bias", "user",
    "logprobs", "top_logprobs", "tools", "response_format", "echo", "suffix", "best_of",
    "repetition_penalty", "min_tokens", "min_p", "prompt_logprobs",
]  # fmt: skip
STRINGS = ["", "t7", "t7 t8 t9", "tiny", "hello world", "é😀 中文", "\x00\x1f", "\ud800",
           "\udfff t7", "\ud83d\ude00", "t1", "{\"a\": 1}", "data: [DONE]", "\\", "\n\n"]  # fmt: skip
HUGE = [2**31, 2**53 + 1, 2**63, 2**64, 2**64 - 1, -(2**63), -(2**63) - 1, 10**30, -(10**30)]
FLOATS = [0.0, 0.5, 1.0, 1.5, -1.0, 1e-300, 1e308, 100.0, 100.0001, float("nan"), float("inf")]


def rand_string(rng: random.Random) -> str:
    if rng.random() < 0.1:
        return "t7 " * rng.randint(100, 2000)  # over the prompt limits
    if rng.random() < 0.3:
        return "".join(chr(rng.randint(1, 0x10FFFF)) for _ in range(rng.randint(1, 12)))
    return rng.choice(STRINGS)


def rand_value(rng: random.Random, depth: int = 0):
    """A random JSON value of any type (bounded size)."""
    kind = rng.randrange(11 if depth < 3 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randint(-5, 300)
    if kind == 3:
        return rng.choice(HUGE)
    if kind == 4:
        return rng.choice(FLOATS)
    if kind in (5, 6):
        return rand_string(rng)
    if kind == 7:
        return [rand_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == 8:
        return {rand_string(rng): rand_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    if kind == 9:
        return [rng.randint(-3, 300) for _ in range(rng.randint(0, 8))]
    return deep(rng.randint(10, 3000))


def deep(levels: int) -> str:
    """A marker that :func:`expand_deep` turns into `levels` nested arrays in the raw body
    (json.dumps itself cannot write values nested that deep)."""
    return f"@@DEEP:{levels}@@"


def expand_deep(raw: bytes) -> bytes:
    return re.sub(rb'"@@DEEP:(\d+)@@"', lambda m: b"[" * int(m[1]) + b"1" + b"]" * int(m[1]), raw)


def rand_part(rng: random.Random):
    kind = rng.choice(["text", "text", "image_url", "input_image", "image", "audio", None])
    part = {"type": kind}
    if kind == "text":
        part["text"] = rand_string(rng) if rng.random() < 0.8 else rand_value(rng)
    elif kind in ("image_url", "input_image", "image"):
        url = rng.choice(
            ["http://127.0.0.1:9/x.png", "file:///etc/passwd", "data:image/png;base64,AAAA"]
        )
        part["image_url"] = {"url": url} if rng.random() < 0.7 else rand_value(rng)
    return part if rng.random() < 0.9 else rand_value(rng)


def rand_messages(rng: random.Random):
    out = []
    for _ in range(rng.randint(0, 4)):
        role = rng.choice(["user", "user", "system", "assistant", "developer", "tool", "wizard"])
        content = rng.choice([rand_string(rng), [rand_part(rng) for _ in range(rng.randint(0, 3))]])
        msg = {"role": role, "content": content}
        if rng.random() < 0.1:
            msg = rand_value(rng)
        elif rng.random() < 0.1:
            msg.pop(rng.choice(["role", "content"]))
        out.append(msg)
    return out


def valid_body(rng: random.Random, path: str) -> dict:
    body: dict = {"max_tokens": rng.randint(1, 3), "temperature": rng.choice([0.0, 0.7, 1.0])}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": rng.choice(["t7 t8", "hello", "é"])}]
    else:
        body["prompt"] = rng.choice(["t7 t8", "hello", [5, 9, 2]])
    if rng.random() < 0.5:
        body["model"] = "tiny"
    if rng.random() < 0.3:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": rng.random() < 0.5}
    if rng.random() < 0.2:
        body["seed"] = rng.randint(0, 2**32)
    if rng.random() < 0.2:
        body["stop"] = rng.choice(["t9", ["t3", "t4"]])
    return body


def mutate(rng: random.Random, body: dict, path: str) -> dict:
    body = dict(body)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(6)
        if op == 0:  # a known field, any value
            body[rng.choice(FIELDS)] = rand_value(rng)
        elif op == 1 and body:  # drop a field
            body.pop(rng.choice(sorted(body)))
        elif op == 2:  # an unknown field
            body[rand_string(rng)] = rand_value(rng)
        elif op == 3 and path == CHAT:
            body["messages"] = rand_messages(rng)
        elif op == 4:
            body["prompt"] = rng.choice([rand_string(rng), rand_value(rng)])
        else:  # a generation field set to a plausible-looking extreme
            body[rng.choice(["max_tokens", "seed", "top_k", "n", "best_of"])] = rng.choice(HUGE)
    # keep the run short: most valid-looking token budgets stay tiny (a few run to the limit)
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if isinstance(v, int) and 3 < v <= 10**6 and rng.random() < 0.9:
            body[key] = rng.randint(1, 3)
    return body


def byte_mutate(rng: random.Random, raw: bytes) -> bytes:
    op = rng.randrange(4)
    if op == 0 and raw:
        return raw[: rng.randrange(len(raw))]
    if op == 1 and raw:
        i = rng.randrange(len(raw))
        return raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1 :]
    if op == 2:
        i = rng.randrange(len(raw) + 1)
        return raw[:i] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))) + raw[i:]
    return rng.choice([b"", b"null", b"[]", b"42", b'"x"', b"[" * 20000, b"{" * 5000, b"\xff\xfe"])


def generate(seed: int, n: int):
    """`n` (path, raw body) pairs, reproducibly from `seed`."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        path = CHAT if i % 2 == 0 else COMP
        body = valid_body(rng, path)
        r = rng.random()
        if r < 0.6:
            body = mutate(rng, body, path)
        if rng.random() < 0.05:  # the other endpoint's body
            path = COMP if path == CHAT else CHAT
        raw = expand_deep(json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass"))
        if 0.6 <= r < 0.8:
            raw = byte_mutate(rng, raw)
        out.append((path, raw))
    return out


def check_response(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text[:500]
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", r.text[-300:]
        for line in events[:-1]:
            payload = json.loads(line.removeprefix("data: "))
            assert "error" not in payload, payload
        return
    body = r.json()
    assert body["object"] in ("chat.completion", "text_completion")
    assert 1 <= body["usage"]["completion_tokens"], body


@pytest.fixture(scope="module")
def fuzz_state(tmp_path_factory):
    path = write_tiny_chat_model(tmp_path_factory.mktemp("fuzz") / "tiny")
    llm = LLM(path, options=RuntimeOptions(max_kv_rows=256, max_input_len=64))
    cfg = ServeConfig(
        model=Path(path), served_model_name="tiny", max_batch_size=4, max_request_bytes=65536
    )
    return ServeState.from_llm(cfg, llm)


def test_1440_random_and_mutated_bodies_get_no_5xx_and_the_server_stays_healthy(fuzz_state):
    bodies = generate(SEED, N_BODIES)
    concurrent = generate(SEED + 1, N_CONCURRENT)
    assert len(bodies) >= 1000 and {p for p, _ in bodies} == {CHAT, COMP}
    state = fuzz_state
    app = create_app(state)  # the lifespan does not run on this transport: start by hand
    statuses: dict[int, int] = {}

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://fuzz") as client:
            headers = {"content-type": "application/json"}
            for i, (path, raw) in enumerate(bodies):
                try:
                    r = await asyncio.wait_for(
                        client.post(path, content=raw, headers=headers), timeout=60
                    )
                    check_response(r)
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                    health = await asyncio.wait_for(client.get("/health"), timeout=10)
                    assert health.status_code == 200
                except (AssertionError, TimeoutError, KeyError, ValueError) as exc:
                    raise AssertionError(f"body {i} to {path}: {raw[:300]!r}: {exc!r}") from exc
            # then the same kind of bodies 8 at a time: valid and invalid ones share batches
            for start in range(0, len(concurrent), 8):
                group = concurrent[start : start + 8]
                sends = [client.post(p, content=raw, headers=headers) for p, raw in group]
                replies = await asyncio.wait_for(asyncio.gather(*sends), timeout=120)
                for k, r in enumerate(replies):
                    path, raw = group[k]
                    try:
                        check_response(r)
                    except (AssertionError, KeyError, ValueError) as exc:
                        raise AssertionError(
                            f"concurrent body {start + k} to {path}: {raw[:300]!r}: {exc!r}"
                        ) from exc
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                assert (await client.get("/health")).status_code == 200

    with torch_threads(1):
        state.scheduler.start()
        app.state.serve = state  # what the lifespan's _begin_serving does
        try:
            asyncio.run(main())
        finally:
            state.scheduler.close()
    assert statuses.get(200, 0) >= 200, statuses  # the valid ones really ran
    assert sum(v for k, v in statuses.items() if 400 <= k < 500) >= 300, statuses
    assert state.scheduler._inflight == 0 and state.scheduler.num_running == 0
    llm = state.llm
    assert llm.target.allocator.free_pages == llm.target.allocator.num_pages
