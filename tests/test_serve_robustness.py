"""Issue 16 (server part): one bad request never takes the server down, and the limits
behave as documented. Every test runs a real uvicorn server on loopback over a tiny random
model (a decoder step takes about a millisecond), with client timeouts so a hang fails."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serve_fixtures import serving, torch_threads, write_tiny_chat_model

from edgebuild.runtime.llm import LLM, RuntimeOptions

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "t7 t8"}]
TIMEOUT = httpx.Timeout(15.0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture
def tiny_llm(tiny_dir):
    """A fresh tiny LLM per test: 64 prompt tokens, 256 KV rows."""
    return LLM(tiny_dir, options=RuntimeOptions(max_kv_rows=256, max_input_len=64))


def assert_serving(srv):
    """/health is 200 and a normal request on each endpoint is answered."""
    assert httpx.get(srv.url + "/health", timeout=TIMEOUT).status_code == 200
    r = httpx.post(srv.url + COMP, json={"prompt": "t7", "max_tokens": 2}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    r = httpx.post(srv.url + CHAT, json={"messages": MSGS, "max_tokens": 2}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text


def openai_error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# ---------------------------------------------------------------- item 1: seed, worker errors
@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
@pytest.mark.parametrize("path", [CHAT, COMP])
def test_an_out_of_range_seed_is_a_400_and_the_server_keeps_serving(tiny_llm, seed, path):
    body = {"messages": MSGS} if path == CHAT else {"prompt": "t7"}
    with serving(tiny_llm) as srv:
        r = httpx.post(
            srv.url + path, json={**body, "seed": seed, "max_tokens": 2}, timeout=TIMEOUT
        )
        err = openai_error(r, 400)
        assert "seed must be an integer in [-2**63, 2**64 - 1]" in err["message"]
        assert err["param"] == "seed"
        assert_serving(srv)


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), 0])
def test_seeds_at_the_edges_of_the_range_are_accepted(tiny_llm, seed):
    with serving(tiny_llm) as srv:
        r = httpx.post(
            srv.url + COMP, json={"prompt": "t7", "seed": seed, "max_tokens": 2}, timeout=TIMEOUT
        )
        assert r.status_code == 200, r.text


def test_an_unexpected_error_while_starting_a_request_fails_only_that_request(tiny_llm):
    real = tiny_llm.new_request
    calls = []

    def broken_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    tiny_llm.new_request = broken_once
    with serving(tiny_llm) as srv:
        r = httpx.post(srv.url + COMP, json={"prompt": "t7", "max_tokens": 2}, timeout=TIMEOUT)
        err = openai_error(r, 500)
        assert "injected failure" in err["message"] and err["type"] == "server_error"
        assert srv.state.scheduler.num_running == 0 and srv.state.scheduler._inflight == 0
        assert_serving(srv)


def test_an_error_while_publishing_one_request_fails_only_that_request(tiny_llm, monkeypatch):
    from edgebuild.serve import scheduler

    real = scheduler.next_delta

    def broken_for_budget_7(stopper, sent):
        if stopper.max_tokens == 7 and len(stopper.output_ids) >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(stopper, sent)

    monkeypatch.setattr(scheduler, "next_delta", broken_for_budget_7)
    batches = throttle(tiny_llm, 0.03)
    with serving(tiny_llm) as srv:
        bodies = [
            {"prompt": "t7", "max_tokens": 7, "ignore_eos": True},
            {"prompt": "t8", "max_tokens": 40, "ignore_eos": True},
        ]
        results = [None, None]

        def one(i):
            results[i] = httpx.post(srv.url + COMP, json=bodies[i], timeout=TIMEOUT)

        threads = [threading.Thread(target=one, args=(i,)) for i in (1, 0)]
        threads[0].start()  # the long one first: the short one joins it (40 x 30 ms)
        deadline = time.monotonic() + 10
        while srv.state.scheduler.num_running < 1:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        threads[1].start()
        for t in threads:
            t.join(30)
        assert "injected" in openai_error(results[0], 500)["message"]
        assert results[1].status_code == 200, results[1].text
        assert results[1].json()["usage"]["completion_tokens"] == 40
        assert max(batches) == 2  # they ran together
        assert_serving(srv)


# ---------------------------------------------------------------- item 2: deep JSON, surrogates
def raw_post(srv, path, raw: bytes):
    headers = {"content-type": "application/json"}
    return httpx.post(srv.url + path, content=raw, headers=headers, timeout=TIMEOUT)


DEEP = [
    ("100000 levels", b"[" * 100_000 + b"]" * 100_000),
    (
        "5000 levels in an ignored field",
        b'{"messages": [{"role": "user", "content": "t7"}], "ignored": '
        + b"[" * 5000
        + b"]" * 5000
        + b"}",
    ),
    ("5000 levels of objects", b'{"a":' * 5000 + b"1" + b"}" * 5000),
]


@pytest.mark.parametrize("raw", [r for _, r in DEEP], ids=[n for n, _ in DEEP])
def test_deeply_nested_json_is_a_400(tiny_llm, raw):
    with serving(tiny_llm) as srv:
        for path in (CHAT, COMP):
            err = openai_error(raw_post(srv, path, raw), 400)
            assert "nested too deeply" in err["message"] and err["code"] == "invalid_json"
        assert_serving(srv)


SURROGATES = [
    (CHAT, b'{"messages": [{"role": "user", "content": "t7 \\ud800"}]}', "messages.0.content"),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
        "messages.0.content.0.text",
    ),
    (COMP, b'{"prompt": "t7 \\ud800 t8"}', "prompt"),
    (COMP, b'{"prompt": "t7 \xed\xa0\x80"}', "prompt"),  # raw CESU bytes of U+D800
    (COMP, b'{"prompt": "t7", "stop": ["\\uDBFF"]}', "stop.0"),
]


@pytest.mark.parametrize("path,raw,where", SURROGATES)
def test_a_lone_surrogate_is_a_400_naming_the_field(tiny_llm, path, raw, where):
    with serving(tiny_llm) as srv:
        err = openai_error(raw_post(srv, path, raw), 400)
        assert f"'{where}' contains a lone UTF-16 surrogate" in err["message"]
        assert err["param"] == where.split(".")[0]
        assert_serving(srv)


def test_a_surrogate_pair_is_valid_text(tiny_llm):
    with serving(tiny_llm) as srv:
        r = raw_post(srv, COMP, b'{"prompt": "t7 \\ud83d\\ude00", "max_tokens": 2}')
        assert r.status_code == 200, r.text


# ---------------------------------------------------------------- item 3: long prompts, the loop
def counting(tiny_llm, name, sleep_s=0.0):
    """Wrap `tiny_llm.<name>` to record the threads it runs on (and to be slow)."""
    real, threads = getattr(tiny_llm, name), []

    def wrapper(*args, **kwargs):
        threads.append(threading.current_thread())
        time.sleep(sleep_s)
        return real(*args, **kwargs)

    setattr(tiny_llm, name, wrapper)
    return threads


@pytest.mark.parametrize("path", [CHAT, COMP])
def test_over_long_prompt_text_is_refused_before_tokenizing(tiny_llm, path):
    encodes, chat_encodes = counting(tiny_llm, "encode"), counting(tiny_llm, "encode_messages")
    with serving(tiny_llm) as srv:
        limit = 64 * 16  # max_input_len x the 16-character floor (the tiny tokens are short)
        text = "t7 " * (limit // 3 + 1)
        body = {"messages": [{"role": "user", "content": text}]} if path == CHAT else {}
        body = body or {"prompt": text}
        err = openai_error(httpx.post(srv.url + path, json=body, timeout=TIMEOUT), 400)
        assert (
            f"the prompt text has {len(text)} characters, more than the {limit}" in (err["message"])
        )
        assert err["code"] == "prompt_too_long"
        assert not encodes and not chat_encodes  # refused before any tokenizer work
        assert srv.state.prompt_char_limit == limit
        assert_serving(srv)


@pytest.mark.parametrize("path", [CHAT, COMP])
def test_prompts_are_tokenized_off_the_event_loop(tiny_llm, path):
    name = "encode_messages" if path == CHAT else "encode"
    threads = counting(tiny_llm, name, sleep_s=2.0)
    body = {"messages": MSGS} if path == CHAT else {"prompt": "t7"}
    with serving(tiny_llm) as srv:
        results = []
        worker = threading.Thread(
            target=lambda: results.append(
                httpx.post(srv.url + path, json={**body, "max_tokens": 2}, timeout=TIMEOUT)
            )
        )
        worker.start()
        while not threads:  # the slow tokenization has begun
            time.sleep(0.01)
        # the loop is free: /health answers while the tokenizer is busy (2 s)
        assert httpx.get(srv.url + "/health", timeout=1.0).status_code == 200
        worker.join(30)
        assert results and results[0].status_code == 200, results
    assert threads[0] is not srv.thread
    assert threads[0].name.startswith("edgellm-tokenizer")


# ---------------------------------------------------------------- item 4: a client that leaves
def throttle(llm, step_s: float):
    """Make every decoder step take at least `step_s` (tokens keep flowing: no idle gap)."""
    real, calls = llm.decoder.step, []

    def step(states, *args):
        calls.append(len(states))
        time.sleep(step_s)
        return real(states, *args)

    llm.decoder.step = step
    return calls


def metric(srv, name: str) -> float:
    return metric_at(srv.url, name)


def test_a_non_streamed_request_whose_client_left_is_aborted_at_once(tiny_llm):
    steps = throttle(tiny_llm, 0.02)  # 200 tokens: 4 s; an event every 20 ms
    body = json.dumps({"prompt": "t7", "max_tokens": 200, "ignore_eos": True}).encode()
    with serving(tiny_llm) as srv:
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 10
        while len(steps) < 5:  # it runs
            assert time.monotonic() < deadline
            time.sleep(0.005)
        sock.close()
        t0 = time.monotonic()
        while srv.state.scheduler.num_running:
            assert time.monotonic() - t0 < 2.0, "the request went on after its client left"
            time.sleep(0.005)
        assert metric(srv, 'edgellm_requests_total{finish_reason="abort"}') == 1
        assert metric(srv, "edgellm_generation_tokens_total") < 100
        assert srv.state.scheduler._inflight == 0
        assert_serving(srv)


# ---------------------------------------------------------------- item 7: 429, auth, models
def test_a_429_says_when_to_retry(tiny_llm):
    throttle(tiny_llm, 0.02)
    body = {"prompt": "t7", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with serving(tiny_llm, max_batch_size=1, max_queued_requests=0) as srv:
        with httpx.stream("POST", srv.url + COMP, json=body, timeout=TIMEOUT) as first:
            lines = first.iter_lines()
            assert next(lines).startswith("data: {")
            r = httpx.post(srv.url + COMP, json={"prompt": "t7"}, timeout=TIMEOUT)
            assert openai_error(r, 429)["code"] == "queue_full"
            assert int(r.headers["retry-after"]) >= 1


PROTECTED = ["/v1/models", "/metrics", "/docs", "/redoc", "/openapi.json"]


def test_the_api_key_protects_every_route_but_health(tiny_llm):
    with serving(tiny_llm, api_key="s3cret") as srv:
        for path in PROTECTED:
            r = httpx.get(srv.url + path, timeout=TIMEOUT)
            assert openai_error(r, 401)["code"] == "missing_api_key", path
            r = httpx.get(srv.url + path, headers={"authorization": "Bearer nope"})
            assert openai_error(r, 401)["code"] == "invalid_api_key", path
            r = httpx.get(srv.url + path, headers={"authorization": "Bearer s3cret"})
            assert r.status_code == 200, path
        assert httpx.get(srv.url + "/health").status_code == 200


def test_without_an_api_key_the_docs_and_metrics_are_open(tiny_llm):
    with serving(tiny_llm) as srv:
        for path in PROTECTED:
            assert httpx.get(srv.url + path, timeout=TIMEOUT).status_code == 200, path
        assert "/v1/chat/completions" in httpx.get(srv.url + "/openapi.json").json()["paths"]


def test_models_does_not_show_where_the_model_lives(tiny_llm, tiny_dir):
    with serving(tiny_llm) as srv:
        card = httpx.get(srv.url + "/v1/models", timeout=TIMEOUT).json()["data"][0]
    assert card["root"] == tiny_dir.name
    assert str(tiny_dir.parent) not in json.dumps(card)


# ---------------------------------------------------------------- item 6: SIGTERM past the grace
LAUNCHER = """
import sys, time
from edgebuild.runtime import decoding
real = decoding.TargetOnlyDecoder.step
def slow(self, states, *args):  # 20 ms a step: 200 tokens take 4 s, far past the grace period
    time.sleep(0.02)
    return real(self, states, *args)
decoding.TargetOnlyDecoder.step = slow
from edgebuild.serve.cli import main
main()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_past_the_grace_period_answers_every_request_with_the_503(tiny_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [str(tiny_dir), "--port", str(port), "--graceful-shutdown-s", "0.5", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, *args, "--log-level", "warning"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"prompt": "t7", "max_tokens": 200, "ignore_eos": True}
        plain, lines = [], []

        def non_streamed():
            plain.append(httpx.post(url + COMP, json=body, timeout=TIMEOUT))

        def streamed():
            with httpx.stream(
                "POST", url + COMP, json={**body, "stream": True}, timeout=TIMEOUT
            ) as r:
                lines.extend(r.iter_lines())

        clients = [threading.Thread(target=non_streamed), threading.Thread(target=streamed)]
        for t in clients:
            t.start()
        while metric_at(url, "edgellm_num_requests_running") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        for t in clients:
            t.join(30)
        assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    err = openai_error(plain[0], 503)
    assert err["code"] == "shutting_down" and err["type"] == "service_unavailable_error"
    assert int(plain[0].headers["retry-after"]) >= 1
    events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["error"]["code"] == "shutting_down"
    assert len(events) > 3  # it was streaming tokens before the signal


def metric_at(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=TIMEOUT).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


# ---------------------------------------------------------------- item 5: pages grow as needed
def chat_body(content, **fields):
    return {"messages": [{"role": "user", "content": content}], "temperature": 0.0, **fields}


def solo(llm, content, max_tokens):
    """Greedy output of one chat request run alone on the runtime (target only)."""
    from edgebuild.runtime.sampling import SamplingParams

    ids = llm.encode_messages([{"role": "user", "content": content}])
    st = llm.generate_ids([ids], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
    return st.stopper.final_text(), len(st.output_ids)


def run_together(srv, bodies):
    results = [None] * len(bodies)

    def one(i):
        results[i] = httpx.post(srv.url + CHAT, json=bodies[i], timeout=httpx.Timeout(60.0))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for i, t in enumerate(threads):  # each joins the running ones
        deadline = time.monotonic() + 10
        while srv.state.scheduler.num_running < i:
            assert time.monotonic() < deadline, "a request did not start"
            time.sleep(0.002)
        t.start()
    for t in threads:
        t.join(90)
    return results


@pytest.mark.parametrize("with_draft", [False, True], ids=["target-only", "dspark"])
def test_two_requests_without_max_tokens_run_together_and_equal_solo_runs(
    tiny_dir, tmp_path, with_draft
):
    from dspark_fixtures import make_random_draft

    spec = None
    if with_draft:
        draft = make_random_draft(tmp_path / "draft", tiny_dir, block_size=4)
        spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": 3}
    llm = LLM(tiny_dir, speculative=spec, options=RuntimeOptions(max_kv_rows=256, max_input_len=64))
    reference = LLM(tiny_dir, options=RuntimeOptions(max_kv_rows=256, max_input_len=64))
    prompts = ["t7 t8 t9", "t20 t21"]
    batch_sizes = throttle(llm, 0.005)  # ~250 steps: the second request joins the first
    with serving(llm) as srv:
        room = [
            srv.state.max_model_len
            - len(llm.encode_messages(chat_msgs(p)))
            - (3 if with_draft else 0)
            for p in prompts
        ]
        results = run_together(srv, [chat_body(p, ignore_eos=True) for p in prompts])
        preemptions = metric(srv, "edgellm_num_preemptions_total")
        assert srv.state.scheduler._inflight == 0
    assert max(batch_sizes) == 2  # both ran at once: nothing reserved the whole context
    assert preemptions >= 1  # 2 x ~250 rows do not fit 256: one was preempted and resumed
    for r, p, n in zip(results, prompts, room, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == n
        assert (r.json()["choices"][0]["message"]["content"], n) == solo(reference, p, n)
    assert llm.free_pages() == (
        llm.target.allocator.num_pages,
        llm.draft.allocator.num_pages if llm.draft else 0,
    )


def chat_msgs(content):
    return [{"role": "user", "content": content}]
