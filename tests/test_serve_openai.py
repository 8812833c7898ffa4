"""The official `openai` client against `edgellm-serve` on loopback (real SmolLM2, CPU):
chat, completions, streaming (deltas concatenate to the non-streamed text), usage, models,
API keys and the Prometheus metrics."""

from __future__ import annotations

import httpx
import openai
import pytest
from serve_fixtures import serving, torch_threads

MODEL = "smollm2-135m"
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(smollm2_llm):
    with torch_threads(1), serving(smollm2_llm, served_model_name=MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(content):
    return [{"role": "user", "content": content}]


def test_models_advertises_the_real_limits(client, smollm2_llm):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    card = models[0].model_dump()
    assert card["max_input_len"] == smollm2_llm.options.max_input_len
    assert card["max_model_len"] == min(
        smollm2_llm.options.max_kv_rows, smollm2_llm.config.max_position_embeddings
    )


def test_chat_completion_has_text_finish_reason_and_usage(client, smollm2_llm):
    r = client.chat.completions.create(
        model=MODEL, messages=chat("What is the capital of France?"), max_tokens=8, **GREEDY
    )
    assert r.object == "chat.completion"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("length", "stop")
    prompt_ids = smollm2_llm.encode_messages(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_concatenates_to_the_non_streamed_text(client):
    kwargs = dict(model=MODEL, messages=chat("Name three colors."), max_tokens=10, **GREEDY)
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(usage_chunk.usage, k) for k in counts] == [
        getattr(full.usage, k) for k in counts
    ]
    # the same prompt again: its full KV pages come from the prefix cache
    cached = usage_chunk.usage.prompt_tokens_details.cached_tokens
    assert cached == (full.usage.prompt_tokens - 1) // 32 * 32
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == full.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason


def test_max_completion_tokens_is_honoured(client):
    r = client.chat.completions.create(
        model=MODEL, messages=chat("Count to ten."), max_completion_tokens=3, **GREEDY
    )
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_completion_with_a_string_or_token_ids_gives_the_same_text(client, smollm2_llm):
    prompt = "The capital of France is"
    by_text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, **GREEDY)
    ids = smollm2_llm.encode(prompt)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, **GREEDY)
    assert by_text.object == "text_completion"
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert "Paris" in by_text.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids)
    assert by_text.usage.completion_tokens == 6


def test_streamed_completion_with_a_stop_string_equals_the_non_streamed(client):
    kwargs = dict(
        model=MODEL, prompt="The capital of France is", max_tokens=12, stop=["\n\n"], **GREEDY
    )
    full = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    assert full.choices[0].finish_reason == "stop"
    assert "\n\n" not in full.choices[0].text
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_non_ascii_output_streams_without_replacement_characters(client):
    kwargs = dict(
        model=MODEL,
        messages=chat("Translate to Chinese and Japanese: good morning, thank you 🙂"),
        max_tokens=16,
        **GREEDY,
    )
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    deltas = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kwargs)
    ]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == full


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0.9, seed=7)
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    assert a == b


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=1)


def test_health_and_metrics(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, **GREEDY)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "edgellm_requests_total",
        "edgellm_prompt_tokens_total",
        "edgellm_generation_tokens_total",
        "edgellm_num_requests_waiting",
        "edgellm_num_requests_running",
        "edgellm_time_to_first_token_seconds_bucket",
        "edgellm_e2e_request_latency_seconds_bucket",
        'edgellm_http_responses_total{route="/v1/completions",status="200"}',
    ):
        assert name in text, name


def test_api_key_is_required_when_set(smollm2_llm, server):
    # the module server is idle here; a second scheduler may use the LLM meanwhile
    with serving(smollm2_llm, served_model_name=MODEL, api_key="s3cret") as srv:
        url = srv.url + "/v1"
        for key in ("wrong", "s3cret-and-more"):
            bad = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError, match="invalid API key"):
                bad.models.list()
        r = httpx.get(url + "/models")
        assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
        good = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
        assert good.models.list().data[0].id == MODEL
        assert httpx.get(srv.url + "/health").status_code == 200
