"""DSpark on the real SmolLM2-135M target is lossless (>= 2,000 generated tokens in all).

A random-weight draft (mostly rejected) and a draft rigged to propose the target's own greedy
continuation (everything accepted), for every num_speculative_tokens in 1..7 and batch sizes 1
and 4 with unequal prompt lengths; the oracle is the target-only decoder on the same weights.
"""

from __future__ import annotations

import pytest
from dspark_fixtures import make_random_draft
from test_dspark_decoding import RiggedDraft, load_draft, speculative, target_only

from edgebuild.runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea and the wind that moves it.",
    "List three uses of copper:",
    "def add(a, b):\n    return",
]
TOKENS = 30


@pytest.fixture(scope="module")
def setup(smollm2_llm, tmp_path_factory):
    llm = smollm2_llm
    prompts = [llm.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    ref = [s.output_ids for s in target_only(llm.target_model, prompts, params)]
    draft_dir = make_random_draft(
        tmp_path_factory.mktemp("d") / "draft", llm.model_dir, block_size=7
    )
    return llm, prompts, params, ref, draft_dir


def test_random_and_rigged_drafts_are_lossless_on_smollm2(setup):
    llm, prompts, params, ref, draft_dir = setup
    model = llm.target_model
    vocab = llm.config.vocab_size
    full = [p + r for p, r in zip(prompts, ref, strict=True)]
    taps = tuple(load_draft(draft_dir, llm.model_dir, 1).target_layer_ids)
    total = 0
    for n in range(1, 8):
        draft = load_draft(draft_dir, llm.model_dir, n)
        for idx in ([1], [0, 1, 2, 3]):  # batch 1 and batch 4 (unequal prompt lengths)
            batch = [prompts[i] for i in idx]
            got = speculative(model, draft, batch, params, n)
            assert [s.output_ids for s in got] == [ref[i] for i in idx], f"random draft n={n}"
            rigged = RiggedDraft(target_layer_ids=taps, vocab=vocab)
            got_r = speculative(model, rigged, batch, params, n, full=[full[i] for i in idx])
            assert [s.output_ids for s in got_r] == [ref[i] for i in idx], f"rigged n={n}"
            assert all(a == 1.0 for s in got_r for a in s.metrics.acceptance_by_position)
            total += sum(len(s.output_ids) for s in got + got_r)
    assert total >= 2000
