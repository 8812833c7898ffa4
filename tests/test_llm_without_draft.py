"""`LLM.without_draft()`: a target-only LLM over the speculative LLM's loaded target.

Oracles: a freshly loaded target-only LLM on the same checkpoint (greedy output ids), and the
speculative LLM itself (lossless: DSpark's greedy output is the target's).
"""

from __future__ import annotations

import pytest
from dspark_fixtures import make_random_draft
from serve_fixtures import write_tiny_chat_model

from edgebuild.runtime.decoding import DSparkDecoder, TargetOnlyDecoder
from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.runtime.sampling import SamplingParams

OPTIONS = RuntimeOptions(max_kv_rows=2048, page_size=8)
PROMPTS = [[3, 17, 42, 9], [5, 6, 7, 8, 9, 10, 11], [200]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("without_draft")
    target = write_tiny_chat_model(root / "target")
    draft = make_random_draft(root / "draft", target, block_size=4)
    spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": 3}
    return target, LLM(target, speculative=spec, options=OPTIONS)


def test_without_draft_shares_the_loaded_target_and_has_no_draft(pair):
    _, llm = pair
    plain = llm.without_draft()
    assert plain is not llm
    assert plain.draft is None and plain.speculative is None
    assert isinstance(plain.decoder, TargetOnlyDecoder)
    assert plain.target is llm.target and plain.target_model is llm.target_model
    assert plain.tokenizer is llm.tokenizer and plain.options is llm.options
    assert plain.config is llm.config and plain.generation is llm.generation


def test_the_speculative_llm_is_left_as_it_was(pair):
    _, llm = pair
    draft, decoder, spec = llm.draft, llm.decoder, llm.speculative
    llm.without_draft()
    assert llm.draft is draft and llm.decoder is decoder and llm.speculative is spec
    assert isinstance(llm.decoder, DSparkDecoder)


def test_without_draft_greedy_equals_a_fresh_target_only_llm_and_dspark(pair):
    target, llm = pair
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    got = [s.output_ids for s in llm.without_draft().generate_ids(PROMPTS, params)]
    fresh = [s.output_ids for s in LLM(target, options=OPTIONS).generate_ids(PROMPTS, params)]
    spec = [s.output_ids for s in llm.generate_ids(PROMPTS, params)]
    assert got == fresh == spec
    assert all(len(ids) == 12 for ids in got)


def test_without_draft_reserves_no_draft_pages_and_frees_what_it_took(pair):
    _, llm = pair
    plain = llm.without_draft()
    before = plain.free_pages()
    st = plain.new_request(PROMPTS[1], SamplingParams(max_tokens=4, ignore_eos=True))
    assert plain.step_pages(st)[1] == 0
    plain.finish(st)
    assert plain.free_pages() == before == (llm.target.allocator.free_pages, 0)
