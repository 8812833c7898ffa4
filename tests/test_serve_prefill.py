"""Issue 18 (prefill): the prefix cache shows in /metrics, the flags switch chunked prefill
and caching, and a long prompt is prefilled chunk by chunk while running streams go on.

Counted in steps, chunks and rows, never in time: a tiny random model, a real uvicorn server
on loopback for the HTTP parts, the decoder driven step by step for the rest.
"""

from __future__ import annotations

import re

import httpx
import pytest
import torch
from click.testing import CliRunner
from serve_fixtures import serving, torch_threads, write_tiny_chat_model
from test_dspark_decoding import write_tiny_target

from edgebuild.checkpoint.source import WeightSource
from edgebuild.errors import ConfigError
from edgebuild.models.llama import LlamaForCausalLM
from edgebuild.runtime.decoding import RequestState, TargetOnlyDecoder
from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.runtime.prefill import PrefillConfig
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.runtime.torch_backend import TorchTarget
from edgebuild.serve.config import ServeConfig

CHAT = "/v1/chat/completions"
TIMEOUT = httpx.Timeout(30.0)
SYSTEM = " ".join(f"t{2 + i % 8}" for i in range(150))  # 150 tokens: 4 full pages of 32


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture
def tiny_llm(tiny_dir):
    return LLM(tiny_dir, options=RuntimeOptions(max_kv_rows=2048, max_input_len=200))


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def ask(srv, question: str) -> str:
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 4,
        "temperature": 0.0,
    }
    r = httpx.post(srv.url + CHAT, json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_a_repeated_system_prompt_shows_as_prefix_cache_hits_in_metrics(tiny_llm):
    with serving(tiny_llm) as srv:
        ask(srv, "t7 t8")
        before = httpx.get(srv.url + "/metrics").text
        ask(srv, "t9")
        after = httpx.get(srv.url + "/metrics").text
    assert metric(before, "edgellm_prefix_cache_hits_total") == 0
    hits = metric(after, "edgellm_prefix_cache_hits_total")
    queries = metric(after, "edgellm_prefix_cache_queries_total")
    assert hits == 128  # the system prompt's 4 full pages of 32 tokens
    assert queries > 300  # both prompts' tokens
    assert metric(after, "edgellm_prefix_cache_hit_rate") == pytest.approx(hits / queries)
    # max_input_len 200: 192-row chunks, so each ~160-token prompt is one chunk
    assert metric(after, "edgellm_prefill_chunks_total") == 2


def test_no_enable_prefix_caching_recomputes_every_prompt(tiny_llm):
    with serving(tiny_llm, enable_prefix_caching=False) as srv:
        first, second = ask(srv, "t7 t8"), ask(srv, "t7 t8")
        text = httpx.get(srv.url + "/metrics").text
    assert first == second
    assert metric(text, "edgellm_prefix_cache_queries_total") == 0
    assert metric(text, "edgellm_prefix_cache_hits_total") == 0


def test_no_enable_chunked_prefill_runs_whole_prompts_one_per_pass(tiny_llm):
    long_q = " ".join(f"t{2 + i % 7}" for i in range(40))  # ~195 tokens with the system prompt
    with serving(tiny_llm, enable_chunked_prefill=False, enable_prefix_caching=False) as srv:
        ask(srv, long_q)
        off = httpx.get(srv.url + "/metrics").text
    with serving(tiny_llm, enable_prefix_caching=False) as srv:
        ask(srv, long_q)
        on = httpx.get(srv.url + "/metrics").text
    assert metric(off, "edgellm_prefill_chunks_total") == 1
    assert metric(on, "edgellm_prefill_chunks_total") == 2  # 192 rows, then the rest


def test_the_flags_reach_the_config_and_bad_values_name_the_flag(tiny_dir, monkeypatch):
    import edgebuild.deploy
    from edgebuild.serve import cli

    seen = {}

    def fake_loader(config, probe=None):
        seen["config"] = config
        raise ConfigError("stop here")

    monkeypatch.setattr(edgebuild.deploy, "serve_loader", fake_loader)
    args = [str(tiny_dir), "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
            "--max-num-batched-tokens", "64"]  # fmt: skip
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 2
    cfg = seen["config"]
    assert (cfg.enable_prefix_caching, cfg.enable_chunked_prefill) == (False, False)
    assert cfg.prefill == PrefillConfig(False, 256, 64, False)
    CliRunner().invoke(cli.main, [str(tiny_dir)])
    assert seen["config"].prefill == PrefillConfig()  # on by default
    with pytest.raises(ConfigError, match="--max-num-batched-tokens"):
        ServeConfig(model=tiny_dir, max_num_batched_tokens=0).validate()
    with pytest.raises(ConfigError, match="--max-num-batched-tokens"):
        PrefillConfig(max_num_batched_tokens=-1).resolved(32, 4096)
    CliRunner().invoke(cli.main, [str(tiny_dir), "--batch-wait-ms", "0"])
    assert seen["config"].batch_wait_ms == 0.0
    with pytest.raises(ConfigError, match="--batch-wait-ms"):
        ServeConfig(model=tiny_dir, batch_wait_ms=-1).validate()


def test_a_burst_arriving_while_nothing_runs_is_admitted_together(tiny_llm):
    """--batch-wait-ms: the worker waits for the burst to stop arriving, then runs one step
    over all of it (counted in decoder steps and prefill passes, not time)."""
    import asyncio

    from edgebuild.serve.scheduler import Scheduler

    calls = []
    real = tiny_llm.decoder.step

    def step(states, *args):
        calls.append(len(states))
        return real(states, *args)

    tiny_llm.decoder.step = step
    sch = Scheduler(tiny_llm, max_batch_size=8, batch_wait_s=0.2)

    async def burst():
        sch.start()
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        tickets = []
        for i in range(4):  # arrivals 20 ms apart: well inside the 200 ms quiet window
            tickets.append(sch.submit([5 + i, 6, 7], params))
            await asyncio.sleep(0.02)
        for t in tickets:
            async for _ in t.events():
                pass

    try:
        asyncio.run(burst())
    finally:
        sch.close()
    assert calls[0] == 4  # the first step saw the whole burst (without the wait: 1)


# ---------------------------------------------------------------------- counted in steps
@pytest.fixture(scope="module")
def tiny_target_model(tmp_path_factory):
    path = write_tiny_target(tmp_path_factory.mktemp("tgt") / "target")
    return LlamaForCausalLM.from_source(WeightSource(path), torch.bfloat16)


def stepped(model, prefill: PrefillConfig):
    """A decoder whose target records the rows of every prefill pass."""
    target = TorchTarget(model, max_kv_rows=4096, page_size=16)
    passes: list[int] = []
    forward = target.forward

    def recording(seqs, rows, *args, prefill=False, **kw):
        if prefill:
            passes.append(sum(int(r.shape[0]) for r in rows))
        return forward(seqs, rows, *args, prefill=prefill, **kw)

    target.forward = recording
    return TargetOnlyDecoder(target, prefill.resolved(16, 4096)), passes


@pytest.mark.parametrize("chunked", [True, False])
def test_a_long_prompt_costs_a_running_stream_one_chunk_per_step(tiny_target_model, chunked):
    cfg = PrefillConfig(enable_chunked_prefill=chunked, prefill_chunk=128)
    dec, passes = stepped(tiny_target_model, cfg)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    running = RequestState.create("a", [5, 6, 7], params)
    long = RequestState.create("b", list(torch.arange(600).remainder(90).add(2).tolist()), params)
    for st in (running, long):
        dec.start(st)
    dec.step([running])  # the stream is running
    steps = 0
    while not long.output_ids:
        dec.step([running, long])
        steps += 1
        assert len(running.new_tokens) == 1  # the stream got its token in every step
    if chunked:
        assert steps == 5 and passes[1:] == [128, 128, 128, 128, 88]
    else:
        assert steps == 1 and passes[1:] == [600]
    dec.finish(running)
    dec.finish(long)


def test_new_prompts_share_a_prefill_pass_within_the_token_budget(tiny_target_model):
    dec, passes = stepped(tiny_target_model, PrefillConfig(max_num_batched_tokens=100))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    states = [RequestState.create(f"r{i}", [3 + i] * 30, params) for i in range(7)]
    for st in states:
        dec.start(st)
    dec.step(states)
    assert passes == [90]  # three 30-row prompts fit 100 rows; the fourth waits (FIFO)
    assert [bool(s.output_ids) for s in states] == [True] * 3 + [False] * 4
    dec.step(states)  # 3 decode rows + three more prompts
    assert passes == [90, 90]
    dec.step(states)
    assert passes == [90, 90, 30] and all(s.output_ids for s in states)
    for st in states:
        dec.finish(st)


def test_admission_counts_the_first_chunk_beyond_the_cached_prefix(tiny_llm):
    """LLM.first_step_pages (the scheduler's admission): the first chunk's pages; with a hit,
    the rest of the chunk plus the hit pages that were evictable (counted free before)."""
    llm = tiny_llm
    llm.set_prefill(PrefillConfig(prefill_chunk=64))
    prompt = llm.encode_messages([{"role": "system", "content": SYSTEM}])
    assert len(prompt) == 153  # 4 full pages of 32 and 25 rows
    assert llm.first_step_pages(prompt) == (2, 0)  # 64 rows: 2 pages of 32
    params = SamplingParams(max_tokens=2, temperature=0.0)
    holder = llm.new_request(prompt, params)
    while not holder.output_ids:
        llm.decoder.step([holder])
    assert llm.first_step_pages(prompt + [5]) == (1, 0)  # 4 pages shared, rows 128..153
    llm.finish(holder)  # its prompt pages stay cached, evictable
    assert llm.first_step_pages(prompt + [5]) == (1 + 4, 0)
    # prompt logprobs skip the cache: the first chunk from row 0, no hit pages
    assert llm.first_step_pages(prompt + [5], prompt_logprobs=True) == (2, 0)
    llm.set_prefill(PrefillConfig(enable_chunked_prefill=False, enable_prefix_caching=False))
    assert llm.first_step_pages(prompt) == (5, 0)  # the whole prompt, no cache


def test_first_tokens_are_reported_after_the_prefill_pass_before_the_decode_pass(
    tiny_target_model,
):
    """The server streams a new request's first token one pass earlier (TTFT): the decoder
    hands it over between the step's prefill pass and its decode pass."""
    dec, passes = stepped(tiny_target_model, PrefillConfig())
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    running = RequestState.create("run", [5, 6, 7], params)
    fresh = RequestState.create("new", [8, 9, 10, 11], params)
    for st in (running, fresh):
        dec.start(st)
    dec.step([running])
    seen = []

    def on_prefilled(states):
        seen.append(([s.request_id for s in states], list(passes), len(running.new_tokens)))

    dec.step([running, fresh], on_prefilled)
    # called once, with the new request, after its prefill pass and before the decode pass
    assert seen == [(["new"], [3, 4], 0)]
    assert len(fresh.output_ids) == 1 and len(running.new_tokens) == 1
    for st in (running, fresh):
        dec.finish(st)
