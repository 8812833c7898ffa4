"""Chunked, batched prefill and prefix caching leave greedy outputs unchanged (real SmolLM2, bf16).

Requests with a shared long system prompt and the second turn of a chat, run together with
every prefill feature on (cache hits included), equal each request run alone with chunking
and caching off: target-only, and DSpark with the shipped draft (whose context on a hit comes
from the cached taps).
"""

from __future__ import annotations

import pytest
import torch

from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.runtime.prefill import PrefillConfig
from edgebuild.runtime.sampling import SamplingParams
from tests.conftest import ROOT

DRAFT = ROOT / "edgebuild" / "data" / "smollm2-135m-dspark"
# fixed lengths (scheduling is the default): the tau floor below is the draft's, not the schedule's
SPEC = {
    "method": "dspark",
    "model": str(DRAFT),
    "num_speculative_tokens": 7,
    "confidence_scheduling": False,
}
COLD = PrefillConfig(enable_chunked_prefill=False, enable_prefix_caching=False)
WARM = PrefillConfig(prefill_chunk=128, max_num_batched_tokens=400)
SYSTEM = " ".join(
    f"Rule {i}: answer briefly, stay polite, and mention {t} when it helps."
    for i, t in enumerate(["cats", "tea", "rivers", "clocks", "bread", "chess"] * 3)
)
PARAMS = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def conversations(llm: LLM, first_answer: str) -> list[list[int]]:
    """Three questions under the long system prompt and the second turn of the first."""

    def chat(*turns):
        msgs = [{"role": "system", "content": SYSTEM}]
        roles = ["user", "assistant"] * len(turns)
        msgs += [{"role": r, "content": t} for r, t in zip(roles, turns, strict=False)]
        return llm.encode_messages(msgs)

    return [
        chat("Tell me one fact about the moon."),
        chat("What is a good name for a cat?"),
        chat("Why is the sea salty?"),
        chat("Tell me one fact about the moon.", first_answer, "And one about the sun?"),
    ]


@pytest.mark.parametrize("speculative", [False, True], ids=["target", "dspark"])
def test_shared_system_prompt_and_second_turn_equal_cold_solo_runs(smollm2_dir, speculative):
    opts = RuntimeOptions(dtype=torch.bfloat16, max_kv_rows=4096)
    llm = LLM(smollm2_dir, speculative=SPEC if speculative else None, options=opts)
    llm.set_prefill(COLD)
    first = conversations(llm, "")[0]
    answer = llm.generate_ids([first], PARAMS)[0].stopper.final_text()
    prompts = conversations(llm, answer)
    assert min(map(len, prompts)) > 300
    cold = [llm.generate_ids([p], PARAMS)[0] for p in prompts]
    assert llm.decoder.stats.prefix_queries == 0

    llm.set_prefill(WARM)
    turn1 = llm.generate_ids(prompts[:1], PARAMS)  # caches the system prompt + first question
    rest = llm.generate_ids(prompts[1:], PARAMS)  # together: chunked, batched, cache hits
    got = turn1 + rest
    assert [s.output_ids for s in got] == [s.output_ids for s in cold]
    hits = [s.metrics.cached_prompt_tokens for s in rest]
    assert all(h >= 256 for h in hits), hits  # the system prompt's pages
    assert hits[-1] >= len(prompts[0]) - 32  # the second turn: the whole first prompt's pages
    assert llm.decoder.stats.passes < llm.decoder.stats.chunks  # prompts shared passes
    if speculative:
        assert all(s.metrics.tau > 1.2 for s in got)


TOPICS = ["cats", "the moon", "Paris", "the sea", "iron", "Python", "music", "tea",
          "bees", "snow", "trains", "stars", "bread", "chess", "rivers", "clocks"]  # fmt: skip


@pytest.mark.parametrize("scheduled", [False, True], ids=["fixed", "confidence-scheduled"])
def test_16_concurrent_dspark_requests_with_cache_hits_equal_their_cold_solo_runs(
    smollm2_dir, scheduled
):
    """16 greedy requests under one long system prompt, stepped together with chunked,
    batched prefill (the default row budget: several passes), 15 of them hitting the pages the first
    one cached; DSpark with the shipped draft, bf16; everything on: with confidence scheduling
    too (profiled costs, per-request lengths, draft-less steps)."""
    opts = RuntimeOptions(dtype=torch.bfloat16, max_kv_rows=16384)
    spec = {**SPEC, "confidence_scheduling": True} if scheduled else SPEC
    llm = LLM(smollm2_dir, speculative=spec, options=opts)
    if scheduled:
        llm.enable_confidence_scheduling(16, repeats=1)
    prompts = [
        llm.encode_messages(
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"One fact about {t}."},
            ]
        )
        for t in TOPICS
    ]
    params = [SamplingParams(max_tokens=10 + i % 5, temperature=0.0) for i in range(16)]
    llm.set_prefill(COLD)
    cold = [llm.generate_ids([p], sp)[0].output_ids for p, sp in zip(prompts, params, strict=True)]
    llm.set_prefill(PrefillConfig())  # the serving defaults
    got = llm.generate_ids(prompts[:1], params[:1])  # caches the system prompt's pages
    got += llm.generate_ids(prompts[1:], params[1:])  # together, each hitting those pages
    assert [s.output_ids for s in got] == cold
    assert all(s.metrics.cached_prompt_tokens >= 256 for s in got[1:])
    assert llm.decoder.stats.passes >= 2  # the budget split the prompts over passes
    if scheduled:
        assert llm.decoder.scheduler.stats.steps > 0
