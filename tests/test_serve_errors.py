"""Malformed requests get a 4xx in the OpenAI error format with a clear message, every time,
before any model work; and the server still answers a normal request afterwards."""

from __future__ import annotations

import httpx
import pytest
from serve_fixtures import free_pages, serving, torch_threads

MODEL = "smol"
MSGS = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


def chat(**fields):
    return {"model": MODEL, "messages": MSGS, **fields}


# (name, method, path, body (dict = JSON, bytes = raw), status, words in the message)
CASES = [
    ("invalid json", "POST", CHAT, b'{"messages": [', 400, "not valid JSON"),
    ("empty body", "POST", CHAT, b"", 400, "empty"),
    ("invalid utf-8", "POST", CHAT, b'{"model": "\xff\xfe"}', 400, "not valid JSON"),
    ("array body", "POST", CHAT, b"[1, 2]", 400, "must be a JSON object, got list"),
    ("string body", "POST", COMP, b'"hello"', 400, "must be a JSON object, got str"),
    ("number body", "POST", COMP, b"42", 400, "must be a JSON object, got int"),
    ("missing messages", "POST", CHAT, {"model": MODEL}, 400, "'messages': this field is required"),
    ("empty messages", "POST", CHAT, {"messages": []}, 400, "at least one message"),
    ("messages a string", "POST", CHAT, {"messages": "hi"}, 400, "'messages'"),
    ("message without role", "POST", CHAT, {"messages": [{"content": "x"}]}, 400, "role"),
    ("bad role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    (
        "content a number",
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "content must be a string or a list",
    ),
    (
        "unknown part type",
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
        400,
        "'type' must be",
    ),
    (
        "image part",
        "POST",
        CHAT,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    ],
                }
            ]
        },
        400,
        "no visual component",
    ),
    ("max_tokens 0", "POST", CHAT, chat(max_tokens=0), 400, "max_tokens must be at least 1"),
    ("max_tokens -5", "POST", CHAT, chat(max_tokens=-5), 400, "max_tokens must be at least 1"),
    ("max_tokens 0 again", "POST", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    (
        "max_tokens 0 completion",
        "POST",
        COMP,
        {"prompt": "Hi", "max_tokens": 0},
        400,
        "max_tokens must be at least 1",
    ),
    ("max_tokens a string", "POST", CHAT, chat(max_tokens="ten"), 400, "'max_tokens'"),
    ("max_tokens a float", "POST", CHAT, chat(max_tokens=1.5), 400, "'max_tokens'"),
    ("max_tokens a bool", "POST", CHAT, chat(max_tokens=True), 400, "'max_tokens'"),
    ("max_completion_tokens 0", "POST", CHAT, chat(max_completion_tokens=0), 400, "max_tokens"),
    ("temperature negative", "POST", CHAT, chat(temperature=-1), 400, "temperature"),
    ("temperature huge", "POST", CHAT, chat(temperature=1000), 400, "temperature"),
    ("temperature a string", "POST", CHAT, chat(temperature="hot"), 400, "'temperature'"),
    (
        "temperature NaN",
        "POST",
        CHAT,
        b'{"messages":[{"role":"user","content":"x"}],"temperature":NaN}',
        400,
        "temperature",
    ),
    ("top_p 0", "POST", CHAT, chat(top_p=0), 400, "top_p"),
    ("top_p 1.5", "POST", CHAT, chat(top_p=1.5), 400, "top_p"),
    ("top_k negative", "POST", COMP, {"prompt": "Hi", "top_k": -1}, 400, "top_k"),
    ("stream a string", "POST", CHAT, chat(stream="yes"), 400, "'stream'"),
    ("stop a number", "POST", CHAT, chat(stop=5), 400, "stop must be a string"),
    ("empty stop string", "POST", CHAT, chat(stop=[""]), 400, "must not be empty"),
    ("seed a string", "POST", CHAT, chat(seed="abc"), 400, "'seed'"),
    ("n 0", "POST", CHAT, chat(n=0), 400, "n must be in [1, 16]"),
    ("n 17", "POST", CHAT, chat(n=17), 400, "n must be in [1, 16]"),
    ("top_logprobs 21", "POST", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top_logprobs alone", "POST", CHAT, chat(top_logprobs=2), 400, "needs logprobs"),
    ("completion logprobs 6", "POST", COMP, {"prompt": "Hi", "logprobs": 6}, 400, "logprobs"),
    ("presence_penalty 3", "POST", CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    ("repetition_penalty 0", "POST", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("logit_bias key", "POST", CHAT, chat(logit_bias={"x": 1}), 400, "logit_bias keys"),
    ("logit_bias id", "POST", CHAT, chat(logit_bias={"999999": 1}), 400, "logit_bias keys"),
    ("logit_bias 101", "POST", CHAT, chat(logit_bias={"5": 101}), 400, "logit_bias values"),
    ("min_tokens > max", "POST", CHAT, chat(min_tokens=9, max_tokens=2), 400, "min_tokens"),
    ("best_of 2", "POST", COMP, {"prompt": "Hi", "best_of": 2}, 400, "best_of is not supported"),
    ("suffix", "POST", COMP, {"prompt": "Hi", "suffix": "x"}, 400, "suffix"),
    (
        "stream_options without stream",
        "POST",
        CHAT,
        chat(stream_options={"include_usage": True}),
        400,
        "only allowed with stream=true",
    ),
    (
        "stop_token_ids out of range",
        "POST",
        COMP,
        {"prompt": "Hi", "stop_token_ids": [-1]},
        400,
        "stop_token_ids",
    ),
    ("unknown model", "POST", CHAT, chat(model="gpt-9"), 404, "'gpt-9' does not exist"),
    (
        "unknown model completions",
        "POST",
        COMP,
        {"model": "x", "prompt": "Hi"},
        404,
        "does not exist",
    ),
    ("missing prompt", "POST", COMP, {"model": MODEL}, 400, "'prompt': this field is required"),
    ("empty prompt", "POST", COMP, {"prompt": ""}, 400, "prompt is empty"),
    ("empty token list", "POST", COMP, {"prompt": []}, 400, "prompt is empty"),
    ("token id out of range", "POST", COMP, {"prompt": [1, 999999]}, 400, "must be in [0,"),
    ("batched prompts", "POST", COMP, {"prompt": ["a", "b"]}, 400, "batched prompts"),
    ("prompt a dict", "POST", COMP, {"prompt": {"text": "hi"}}, 400, "prompt must be a string"),
    (
        "prompt too long",
        "POST",
        COMP,
        {"prompt": "word " * 200},
        400,
        "more than the max input length 64",
    ),
    (
        "prompt + max_tokens over capacity",
        "POST",
        COMP,
        {"prompt": "Hi", "max_tokens": 500},
        400,
        "exceeds the capacity of 256 tokens",
    ),
    ("oversized body", "POST", CHAT, chat(pad="x" * 5000), 413, "larger than 4096 bytes"),
    ("GET on a POST route", "GET", CHAT, None, 405, "Method Not Allowed"),
    ("unknown route", "POST", "/v1/nope", {}, 404, "Not Found"),
    # structured outputs and tools (the break-it tester's findings: each was a 200 before)
    (
        "schema with not",
        "POST",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {"not": {}}}}),
        400,
        "JSON Schema keyword 'not'",
    ),
    (
        "unknown structured_outputs field",
        "POST",
        CHAT,
        chat(structured_outputs={"bogus": 1}),
        400,
        "structured_outputs.bogus",
    ),
    (
        "tool without a name",
        "POST",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": ""}}]),
        400,
        "tools[0].function.name",
    ),
    (
        "user content null",
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": None}]},
        400,
        "needs 'content'",
    ),
]


@pytest.fixture(scope="module")
def small_llm(smollm2_dir):
    """The real model with small limits: 64 prompt tokens, 256 KV rows."""
    from edgebuild.runtime.llm import LLM, RuntimeOptions

    return LLM(smollm2_dir, options=RuntimeOptions(max_kv_rows=256, max_input_len=64))


@pytest.fixture(scope="module")
def server(small_llm):
    with (
        torch_threads(1),
        serving(small_llm, max_request_bytes=4096, served_model_name=MODEL) as srv,
    ):
        yield srv


def send(url, method, path, body):
    if isinstance(body, bytes):
        return httpx.request(
            method, url + path, content=body, headers={"content-type": "application/json"}
        )
    return httpx.request(method, url + path, json=body)


def test_there_are_at_least_30_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_request_gets_a_clear_openai_error(server, case):
    _, method, path, body, status, words = case
    before = free_pages(server.state.llm)
    r = send(server.url, method, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"].endswith("_error")
    assert free_pages(server.state.llm) == before  # no model work, nothing allocated
    assert server.state.scheduler.num_running == 0


def test_token_counts_are_in_the_limit_messages(server):
    msg = send(server.url, "POST", COMP, {"prompt": [42] * 100}).json()["error"]["message"]
    assert "the prompt has 100 tokens, more than the max input length 64" in msg
    msg = send(server.url, "POST", COMP, {"prompt": "Hi", "max_tokens": 500}).json()
    assert "prompt (1 tokens) + max_tokens (500)" in msg["error"]["message"]


def test_the_server_still_serves_after_all_the_errors(server):
    r = httpx.post(
        server.url + COMP, json={"prompt": "The capital of France is", "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    metrics = httpx.get(server.url + "/metrics").text
    assert 'edgellm_http_responses_total{route="/v1/chat/completions",status="400"}' in metrics
