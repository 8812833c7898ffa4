"""Continuous batching is invisible in the outputs: 16 concurrent greedy streams each equal the
request run alone (target-only and DSpark with a random 7-token draft); a short request after
a long one equals a fresh server's; DSpark honours max_tokens 1 and 2; a client that leaves
frees its pages; a full queue answers 429; shutdown with work in flight is clean."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
from dspark_fixtures import make_random_draft
from serve_fixtures import free_pages, serving, torch_threads

from edgebuild.runtime.llm import LLM
from edgebuild.runtime.sampling import SamplingParams

TOPICS = ["cats", "the moon", "Paris", "the sea", "iron", "Python", "music", "tea",
          "bees", "snow", "trains", "stars", "bread", "chess", "rivers", "clocks"]  # fmt: skip
PROMPTS = [f"Tell me one short fact about {t}." for t in TOPICS]
MAX_TOKENS = [10 + i % 5 for i in range(16)]  # different lengths: requests leave at different steps


def chat(text):
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def alone(smollm2_llm):
    """(text, token count) of each request run alone, target-only, straight on the runtime."""
    out = []
    for prompt, n in zip(PROMPTS, MAX_TOKENS, strict=True):
        ids = smollm2_llm.encode_messages(chat(prompt))
        st = smollm2_llm.generate_ids([ids], SamplingParams(max_tokens=n, temperature=0.0))[0]
        out.append((st.stopper.final_text(), len(st.output_ids)))
    return out


@pytest.fixture(scope="module")
def draft_dir(smollm2_dir, tmp_path_factory):
    return make_random_draft(tmp_path_factory.mktemp("draft") / "d", smollm2_dir, block_size=7)


def load_dspark(smollm2_dir, draft_dir):
    spec = {"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": 7,
            "confidence_scheduling": False}  # fmt: skip
    return LLM(smollm2_dir, speculative=spec)


@pytest.fixture(scope="module")
def dspark_llm(smollm2_dir, draft_dir):
    return load_dspark(smollm2_dir, draft_dir)


async def stream_one(client, prompt, max_tokens, **extra):
    stream = await client.chat.completions.create(
        model=client.served, messages=chat(prompt), max_tokens=max_tokens, temperature=0.0,
        stream=True, stream_options={"include_usage": True}, **extra,
    )  # fmt: skip
    text, usage = [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text.append(c.delta.content or "")
    return "".join(text), usage.completion_tokens


def run_concurrently(url, prompts, max_tokens):
    async def main():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        client.served = "smollm2-135m"
        try:
            jobs = [stream_one(client, p, n) for p, n in zip(prompts, max_tokens, strict=True)]
            return await asyncio.gather(*jobs)
        finally:
            await client.close()

    return asyncio.run(main())


def steps(server) -> float:
    return server.state.metrics.steps._value.get()


def test_16_concurrent_streams_equal_each_request_alone_target_only(smollm2_llm, alone):
    pages = free_pages(smollm2_llm)
    # batch of 5: the other requests queue and join as running ones leave
    with serving(smollm2_llm, max_batch_size=5) as srv:
        results = run_concurrently(srv.url, PROMPTS, MAX_TOKENS)
        assert steps(srv) < sum(n for _, n in alone) / 2  # tokens really were batched
    assert results == alone
    assert free_pages(smollm2_llm) == pages


def test_16_concurrent_streams_equal_each_request_alone_with_dspark(dspark_llm, alone):
    pages = free_pages(dspark_llm)
    with serving(dspark_llm, max_batch_size=16) as srv:
        results = run_concurrently(srv.url, PROMPTS, MAX_TOKENS)
        # the same requests alone on the DSpark server (a few: the decoder is the same)
        solo = [
            run_concurrently(srv.url, [p], [n])[0]
            for p, n in zip(PROMPTS[:3], MAX_TOKENS[:3], strict=True)
        ]
        metrics = httpx.get(srv.url + "/metrics").text
    assert results == alone  # greedy DSpark is lossless: equal to target-only alone
    assert solo == alone[:3]
    assert 'edgellm_spec_decode_draft_proposed_total{position="7"}' in metrics
    assert "edgellm_spec_decode_mean_accepted_length" in metrics
    assert free_pages(dspark_llm) == pages


def test_a_short_request_after_a_long_one_equals_a_fresh_server(dspark_llm, smollm2_dir, draft_dir):
    long_prompt = "Summarize: " + " ".join(
        f"Sentence {i} is about {t}." for i, t in enumerate(TOPICS * 2)
    )
    short = ("Say hello.", 12)
    with serving(dspark_llm) as srv:
        run_concurrently(srv.url, [long_prompt], [16])
        after_long = run_concurrently(srv.url, *zip(short))
    fresh_llm = load_dspark(smollm2_dir, draft_dir)
    with serving(fresh_llm) as srv:
        fresh = run_concurrently(srv.url, *zip(short))
    assert after_long == fresh


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_dspark_with_a_7_token_block_emits_exactly_max_tokens(dspark_llm, max_tokens):
    with serving(dspark_llm) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        kwargs = dict(
            model="smollm2-135m", prompt="Once upon a time", max_tokens=max_tokens,
            temperature=0.0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        r = client.completions.create(**kwargs)
        chunks = list(
            client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
        )
    assert r.usage.completion_tokens == max_tokens
    assert r.choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == max_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_a_client_that_disconnects_mid_stream_frees_its_pages(dspark_llm):
    pages = free_pages(dspark_llm)
    with serving(dspark_llm) as srv:
        body = {"prompt": "Once upon a time", "max_tokens": 500, "stream": True,
                "temperature": 0.0, "ignore_eos": True}  # fmt: skip
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
            assert free_pages(dspark_llm) != pages  # it holds pages while running
        deadline = time.monotonic() + 30
        while srv.state.scheduler.num_running or free_pages(dspark_llm) != pages:
            assert time.monotonic() < deadline, "the aborted request kept its pages"
            time.sleep(0.1)
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'edgellm_requests_total{finish_reason="abort"} 1.0' in metrics
        # the server goes on serving
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200


def test_a_full_queue_answers_429_and_recovers(smollm2_llm):
    body = {"prompt": "Once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with serving(smollm2_llm, max_batch_size=1, max_queued_requests=1) as srv:
        url = srv.url + "/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=60) as first:
            lines = first.iter_lines()  # keep a reference: a dropped iterator closes the stream
            assert next(lines).startswith("data: {")
            with httpx.stream("POST", url, json=body, timeout=60) as second:
                assert second.status_code == 200  # queued behind the first
                r = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2})
                assert r.status_code == 429
                err = r.json()["error"]
                assert err["type"] == "rate_limit_error" and "busy" in err["message"]
        deadline = time.monotonic() + 30
        while srv.state.scheduler.num_running or srv.state.scheduler.num_waiting:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        r = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200


def test_shutdown_with_a_request_in_flight_is_clean(smollm2_llm):
    pages = free_pages(smollm2_llm)
    srv_ctx = serving(smollm2_llm)
    srv = srv_ctx.__enter__()
    seen, errors = [], []

    def client():
        body = {"prompt": "Once upon a time", "max_tokens": 400, "stream": True,
                "ignore_eos": True}  # fmt: skip
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    seen.append(line)
        except httpx.HTTPError as exc:  # the server may cut the stream at the deadline
            errors.append(exc)

    t = threading.Thread(target=client)
    t.start()
    while len(seen) < 3:
        time.sleep(0.05)
    t0 = time.monotonic()
    srv_ctx.__exit__(None, None, None)  # graceful period (5 s), then cancel and join
    t.join(30)
    assert not t.is_alive()
    assert time.monotonic() - t0 < 25
    assert not srv.state.scheduler.alive
    assert free_pages(smollm2_llm) == pages
