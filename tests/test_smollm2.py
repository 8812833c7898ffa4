"""The real SmolLM2-135M checkpoint: greedy output equals transformers' `generate`."""

from __future__ import annotations

import pytest
import torch

from edgebuild.runtime.sampling import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
]


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def test_greedy_continuations_equal_transformers_generate(smollm2_llm, reference):
    llm = smollm2_llm
    ids = [llm.encode(p) for p in PROMPTS]
    states = llm.generate_ids(ids, SamplingParams(max_tokens=32))
    compared = 0
    for prompt_ids, st in zip(ids, states, strict=True):
        with torch.no_grad():
            ref = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False)
        assert st.output_ids == ref[0, len(prompt_ids) :].tolist()  # both stop at EOS
        compared += len(st.output_ids)
    assert compared >= 5 * 32


def test_paris_is_the_answer(smollm2_llm):
    st = smollm2_llm.generate("The capital of France is", SamplingParams(max_tokens=8))
    assert "Paris" in st.stopper.final_text()


def test_chat_template_matches_transformers(smollm2_llm, reference):
    llm = smollm2_llm
    ids = llm.encode("What is the capital of France?", chat=True)
    expected = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert llm.tokenizer.decode(ids) == expected
    st = llm.generate_ids([ids], SamplingParams(max_tokens=16))[0]
    with torch.no_grad():
        ref = reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    assert st.output_ids == ref[0, len(ids) :].tolist()
