"""Issue 27: the DSpark draft's KV cache is part of the budget.

A full-attention draft holds one context row per target position in its own paged pool
(``RuntimeOptions.max_draft_kv_rows``). Oracles: the draft's pages counted by the scheduler's
step-page arithmetic against the allocator's own counts; a pool that holds two requests on
the target but one on the draft preempts (``edgellm_num_preemptions_total``) and both
requests still equal their solo target-only runs token for token; the bytes per token stated
by ``edgebuild inspect --draft`` against the draft's config.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from click.testing import CliRunner
from dspark_fixtures import make_random_draft
from serve_fixtures import torch_threads, write_tiny_chat_model

from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.serve.scheduler import Scheduler

BLOCK = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = write_tiny_chat_model(root / "tiny")
    return target, make_random_draft(root / "draft", target, block_size=BLOCK)


def _spec(draft):
    # fixed lengths: every step drafts, so the draft's pages grow with each step's context
    return {"method": "dspark", "model": str(draft), "num_speculative_tokens": 3,
            "confidence_scheduling": False}  # fmt: skip


def run_scheduler(llm, prompts, params, max_batch_size):
    """Final events of ``prompts`` submitted together, and the preemption count."""

    async def main():
        sched = Scheduler(llm, max_batch_size=max_batch_size)
        sched.start()
        try:
            tickets = [sched.submit(p, params) for p in prompts]
            ends = []
            for t in tickets:
                async for ev in t.events():
                    if ev.kind != "token":
                        ends.append(ev)
            return ends, sched.metrics.preemptions._value.get()
        finally:
            await asyncio.to_thread(sched.close)

    return asyncio.run(asyncio.wait_for(main(), 300))


def test_a_full_attention_drafts_pages_are_counted_per_context_row(pair):
    target, draft = pair
    opts = RuntimeOptions(max_kv_rows=512, max_input_len=64, page_size=8, max_draft_kv_rows=96)
    llm = LLM(target, speculative=_spec(draft), options=opts)
    d = llm.draft.allocator
    assert d.num_pages * d.page_size == 96 + 4 * 8  # 96 rows + one page per reserved block
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    st = llm.generate_ids([list(range(5, 30))], params)[0]  # 25 prompt rows, 12 generated
    assert len(st.output_ids) == 12
    # the draft's pages grow with its context: one row per target position it has seen
    free_t, free_d = llm.free_pages()
    assert (free_t, free_d) == (llm.target.allocator.num_pages, d.num_pages)  # all freed
    new = llm.new_request(list(range(5, 30)), params, "r")
    while new.anchor is None:
        llm.decoder.step([new])
    need_t, need_d = llm.step_pages(new)
    pending = len(new.pending_features) if new.pending_features is not None else 0
    want = d.pages_for(new.draft_seq.length + pending + BLOCK) - len(new.draft_seq.pages)
    assert need_d == max(want, 0) and need_d > 0
    # /metrics: both pools, with the draft's K+V bytes per row from its config
    from prometheus_client import generate_latest

    from edgebuild.serve.metrics import ServeMetrics

    llm.decoder.step([new])  # the draft takes its pending context: pages in use
    assert new.draft_seq.length > 0
    metrics = ServeMetrics("m")
    metrics.attach_kv(llm)
    text = generate_latest(metrics.registry).decode()
    cfg = llm.draft.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # fp32
    assert f'edgellm_kv_cache_bytes_per_token{{pool="draft"}} {float(per_token)}' in text
    used = 1 - d.free_pages / d.num_pages
    assert used > 0 and f'edgellm_kv_cache_usage_perc{{pool="draft"}} {used}' in text
    assert f'edgellm_kv_cache_capacity_bytes{{pool="draft"}} {float(128 * per_token)}' in text
    llm.finish(new)


def test_a_pool_big_enough_for_the_targets_alone_preempts_on_the_draft_and_stays_exact(pair):
    """Target pool: 2 x 60 rows fit; draft pool: 64 rows hold one request's context only.
    Both requests run, one is preempted (never a crash), both equal target-only."""
    target, draft = pair
    prompts = [[5, 9, 2, 33, 7, 11], [12, 4, 80, 3, 19]]
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    reference = LLM(target, options=RuntimeOptions(max_kv_rows=512, max_input_len=64))
    want = [reference.generate_ids([p], params)[0].stopper.final_text() for p in prompts]
    opts = RuntimeOptions(max_kv_rows=256, max_input_len=64, page_size=8, max_draft_kv_rows=64)
    llm = LLM(target, speculative=_spec(draft), options=opts)
    assert llm.target.allocator.num_pages * 8 >= 2 * (6 + 50 + 4)  # the target holds both
    ends, preemptions = run_scheduler(llm, prompts, params, max_batch_size=2)
    assert [e.kind for e in ends] == ["done", "done"], [e.message for e in ends]
    assert preemptions >= 1  # the draft's pages did not hold both contexts
    assert [e.completion_tokens for e in ends] == [50, 50]
    assert llm.free_pages() == (llm.target.allocator.num_pages, llm.draft.allocator.num_pages)
    assert [e.final_text for e in ends] == want


def test_inspect_and_the_manifest_state_the_drafts_kv_bytes_per_token(pair, tmp_path):
    from edgebuild.bundle.build import BuildOptions, build_bundle, recipe_from_flags
    from edgebuild.cli import main

    target, draft = pair
    cfg = json.loads((draft / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * heads * head_dim * 2  # K+V, bf16
    result = CliRunner().invoke(main, ["inspect", str(target), "--draft", str(draft), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["draft"]["kv_cache_bf16"] == {"attention": "full", "bytes_per_token": per_token}
    recipe = recipe_from_flags(target, draft, max_input_len=32, max_kv_cache_capacity=64)
    out = tmp_path / "bundle"
    build_bundle(recipe, out, BuildOptions(onnx_only=True, progress=False))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dspark"]["kv_cache"] == {"attention": "full", "bytes_per_token": per_token}


def test_the_serve_flag_sizes_the_drafts_cache_and_bad_values_name_it(pair, monkeypatch):
    """--max-draft-kv-cache-capacity reaches RuntimeOptions.max_draft_kv_rows (whose effect
    on the pool is the first test's); 0, a non-torch backend and a model without a draft are
    refused naming the flag."""
    from types import SimpleNamespace

    import edgebuild.deploy
    from edgebuild.errors import ConfigError
    from edgebuild.serve import cli
    from edgebuild.serve import config as cfg

    target, draft = pair
    seen = {}

    def fake_loader(config, probe=None):
        seen["config"] = config
        raise ConfigError("stop here")

    monkeypatch.setattr(edgebuild.deploy, "serve_loader", fake_loader)
    flags = [str(target), "--speculative-config", json.dumps(_spec(draft))]
    result = CliRunner().invoke(cli.main, [*flags, "--max-draft-kv-cache-capacity", "96"])
    assert result.exit_code == 2 and seen["config"].max_draft_kv_cache_capacity == 96
    seen.clear()  # without a draft: refused before the loader runs (no model loaded)
    result = CliRunner().invoke(cli.main, [str(target), "--max-draft-kv-cache-capacity", "100"])
    assert result.exit_code == 2 and not seen, result.output
    assert (
        "--max-draft-kv-cache-capacity 100" in result.output and "without a draft" in result.output
    )
    assert "--max-draft-kv-cache-capacity" in CliRunner().invoke(cli.main, ["--help"]).output
    CliRunner().invoke(cli.main, [str(target)])
    assert seen["config"].max_draft_kv_cache_capacity is None  # default: the target's rows
    with pytest.raises(ConfigError, match="--max-draft-kv-cache-capacity must be >= 1"):
        cfg.ServeConfig(model=target, max_draft_kv_cache_capacity=0).validate()

    loaded = {}

    def fake_llm(model, **kw):
        loaded["options"] = kw["options"]
        return SimpleNamespace(draft=None)  # a model without a draft

    monkeypatch.setattr(cfg, "LLM", fake_llm)
    config = cfg.ServeConfig(
        model=target, speculative_config=json.dumps(_spec(draft)), max_draft_kv_cache_capacity=96
    )
    with pytest.raises(ConfigError, match="--max-draft-kv-cache-capacity 96 .* without a draft"):
        cfg.load_state(config)
    assert loaded["options"].max_draft_kv_rows == 96
    assert loaded["options"].max_kv_rows == config.max_kv_cache_capacity
    ort = cfg.ServePlan(target, cfg.BackendChoice("onnxruntime", "asked"))
    loaded.clear()
    with pytest.raises(ConfigError, match="onnxruntime backend's draft pool is fixed by the"):
        cfg.load_state(config, ort)
    assert not loaded  # refused before loading


@pytest.mark.parametrize(("rows", "draft_rows"), [(200, None), (512, 200), (64, 24)])
def test_the_start_up_profile_fits_small_pools_instead_of_failing(pair, rows, draft_rows):
    """Confidence scheduling profiles the step costs at start-up with ``--max-batch-size``
    sequences: with a small pool (200 rows = 7 pages of 32 for 8 sequences; a 200-row draft
    pool) it once asked for more pages than exist and the server exited 2. The profile's
    shape now fits both pools in whole pages (checked against the allocators' sizes), and
    the profile runs and leaves every page free."""
    target, draft = pair
    opts = RuntimeOptions(max_kv_rows=rows, max_input_len=16, max_draft_kv_rows=draft_rows)
    llm = LLM(target, _spec(draft), opts)
    t, d = llm.target.allocator, llm.draft.allocator
    batch, ctx = llm._profile_shape(8)
    assert batch >= 1 and ctx >= 8
    assert batch * t.pages_for(ctx + llm.decoder.n + 2) <= t.num_pages
    assert batch * d.pages_for(ctx + 2 * llm.draft.block_size) <= d.num_pages
    assert llm.enable_confidence_scheduling(8, repeats=1) is not None
    assert t.free_pages == t.num_pages and d.free_pages == d.num_pages


def test_one_requests_limit_is_the_smaller_of_the_target_and_draft_pools(pair):
    """max_model_len, the prompt check and the default max_tokens come from the draft's pool
    when it is the smaller (oracle: the draft allocator's rows minus one reserved block,
    capped by the flag's rows); an over-long request is a 400 naming the draft's flag, up
    front, never a 500 from the draft's pool mid-request."""
    import httpx
    from serve_fixtures import serving

    from edgebuild.errors import RequestError

    target, draft = pair
    opts = RuntimeOptions(max_kv_rows=256, max_input_len=200, page_size=8, max_draft_kv_rows=64)
    llm = LLM(target, speculative=_spec(draft), options=opts)
    d = llm.draft.allocator
    assert llm.draft_seq_capacity == min(64, d.num_pages * d.page_size - BLOCK) == 64
    assert llm.max_model_len == 64
    prompt = list(range(5, 45))  # 40 tokens: 40 + 30 + 3 > 64
    with pytest.raises(RequestError, match="capacity of 64 tokens.*--max-draft-kv-cache-capacity"):
        llm.check_request(prompt, SamplingParams(max_tokens=30))
    llm.check_request(prompt, SamplingParams(max_tokens=21))  # 40 + 21 + 3 = 64: fits
    assert LLM(target, options=opts).max_model_len == 256  # no draft: the target's pool
    words = " ".join(f"t{i}" for i in range(5, 45))
    with serving(llm) as srv:
        model = httpx.get(srv.url + "/v1/models").json()["data"][0]
        assert (model["max_model_len"], model["max_input_len"]) == (64, 63)
        body = {"prompt": words, "max_tokens": 30, "temperature": 0.0}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and "--max-draft-kv-cache-capacity" in r.text, r.text
        body = {"prompt": words + " " + words, "max_tokens": 1}  # 80 tokens > 63
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 400
        chat = {"messages": [{"role": "user", "content": words}], "temperature": 0.0}
        chat["ignore_eos"] = True  # no max_tokens: the rest of the context, on the draft's pool
        r = httpx.post(srv.url + "/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] + 3 == 64
        assert r.json()["choices"][0]["finish_reason"] == "length"
    assert llm.free_pages() == (llm.target.allocator.num_pages, d.num_pages)


def test_a_lone_request_past_the_drafts_pool_finishes_with_length_not_a_500(pair, monkeypatch):
    """Admission bypassed (check_request a no-op): a request whose context outgrows the
    draft's pool ends with finish_reason "length", its text a prefix of the target-only
    run's, and every page is freed."""
    target, draft = pair
    prompt = [5, 9, 2, 33, 7, 11]
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    reference = LLM(target, options=RuntimeOptions(max_kv_rows=512, max_input_len=64))
    want = reference.generate_ids([prompt], params)[0].stopper.final_text()
    opts = RuntimeOptions(max_kv_rows=256, max_input_len=64, page_size=8, max_draft_kv_rows=48)
    llm = LLM(target, speculative=_spec(draft), options=opts)
    monkeypatch.setattr(llm, "check_request", lambda *a: None)
    ends, _ = run_scheduler(llm, [prompt], params, max_batch_size=1)
    assert [e.kind for e in ends] == ["done"], [e.message for e in ends]
    assert ends[0].finish_reason == "length" and 0 < ends[0].completion_tokens < 120
    assert want.startswith(ends[0].final_text)
    assert llm.free_pages() == (llm.target.allocator.num_pages, llm.draft.allocator.num_pages)


def test_a_max_model_len_one_request_cannot_hold_is_refused_not_clamped(pair):
    """As vLLM: --max-model-len above the per-request capacity is a ConfigError naming the
    flag that bounds it (before loading on the torch backend; after, for the draft's pool)."""
    from edgebuild.errors import ConfigError
    from edgebuild.serve import config as cfg

    target, draft = pair
    flags = dict(model=target, max_kv_cache_capacity=512, max_model_len=2000, backend="torch")
    with pytest.raises(ConfigError, match="--max-model-len 2000 .* 512 tokens .*--max-kv-cache"):
        cfg.ServeConfig(**flags).validate()
    config = cfg.ServeConfig(
        model=target,
        speculative_config=json.dumps(_spec(draft)),
        max_kv_cache_capacity=256,
        max_draft_kv_cache_capacity=64,
        max_model_len=100,
        backend="torch",
    )
    plan = cfg.ServePlan(target, cfg.BackendChoice("torch", "asked"), config.speculative_config)
    with pytest.raises(ConfigError, match="--max-model-len 100 .* 64 tokens .*--max-draft-kv"):
        cfg.load_state(config, plan)
