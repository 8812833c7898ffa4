"""The sampling API clients send, through the official `openai` client, DSpark on and off:
logprobs (chat and legacy completions; streamed == non-streamed == the runtime's numbers),
n > 1 (per-choice seeds: choice i == a single request with seed + i; usage sums; prompt
pages shared through the prefix cache), penalties / logit_bias / min_tokens (== the runtime,
whose processors tests/test_logits_processors.py holds to a hand-written oracle), echo and
usage.prompt_tokens_details.cached_tokens.

A tiny random chat model (word tokenizer t0..t255, t1 = EOS) keeps every request cheap.
"""

from __future__ import annotations

import openai
import pytest
from dspark_fixtures import make_random_draft
from serve_fixtures import serving, torch_threads, write_tiny_chat_model

from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.runtime.sampling import SamplingParams

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "t7 t8 t9 t10"}]
NO_EOS = {"ignore_eos": True}
LONG = " ".join(f"t{10 + i % 200}" for i in range(90))  # three full 32-row KV pages


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module", params=["target-only", "dspark"])
def llm(request, model_dir, tmp_path_factory):
    spec = None
    if request.param == "dspark":
        draft = make_random_draft(tmp_path_factory.mktemp("d") / "d", model_dir, block_size=5)
        spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": 4}
    return LLM(model_dir, speculative=spec, options=RuntimeOptions(max_kv_rows=4096))


@pytest.fixture(scope="module")
def client(llm):
    with torch_threads(1), serving(llm, served_model_name=MODEL) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def runtime(llm, ids, **params) -> object:
    """The request run straight on the runtime (the reference)."""
    return llm.generate_ids([ids], SamplingParams(**params))[0]


def entries(choice_logprobs):
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
            for e in choice_logprobs.content]  # fmt: skip


def test_chat_logprobs_streamed_equal_non_streamed_equal_the_runtime(client, llm):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0.0, extra_body=NO_EOS)
    full = client.chat.completions.create(logprobs=True, top_logprobs=3, **kw)
    got = entries(full.choices[0].logprobs)
    assert len(got) == full.usage.completion_tokens == 12
    ids = llm.encode_messages(MESSAGES)
    ref = runtime(llm, ids, max_tokens=12, ignore_eos=True, logprobs=3)
    tok = llm.tokenizer
    assert [g[0] for g in got] == [tok.decode([e.token_id]) for e in ref.logprobs]
    for g, e in zip(got, ref.logprobs, strict=True):
        assert g[1] == pytest.approx(e.logprob, abs=1e-5)
        assert [t for t, _ in g[2]] == [tok.decode([t]) for t, _ in e.top]
        assert all(lp <= g[2][0][1] for _, lp in g[2])  # descending: the most likely first
    chunks = list(client.chat.completions.create(stream=True, logprobs=True, top_logprobs=3, **kw))
    streamed = [
        x
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for x in entries(c.choices[0].logprobs)
    ]
    assert streamed == got  # every token of every chunk carries its own entry
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert full.choices[0].logprobs.content[0].bytes == list(got[0][0].encode())


def test_completion_logprobs_and_echo(client, llm):
    kw = dict(model=MODEL, prompt="t7 t8 t9", max_tokens=6, temperature=0.0, extra_body=NO_EOS)
    full = client.completions.create(logprobs=2, **kw)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(
        len(t) <= 2 and max(t.values()) >= v
        for t, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    assert lp.text_offset[0] == 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    chunks = list(client.completions.create(stream=True, logprobs=2, **kw))
    st_tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    st_lps = [
        v
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for v in c.choices[0].logprobs.token_logprobs
    ]
    assert st_tokens == lp.tokens and st_lps == lp.token_logprobs
    echoed = client.completions.create(echo=True, **kw)
    assert echoed.choices[0].text == "t7 t8 t9" + full.choices[0].text
    streamed = client.completions.create(echo=True, stream=True, **kw)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text


def test_n_choices_follow_per_choice_seeds_and_usage_sums(client, llm):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, extra_body=NO_EOS)
    a = client.chat.completions.create(n=3, seed=11, **kw)
    b = client.chat.completions.create(n=3, seed=11, **kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in b.choices]  # reproducible
    assert len(set(texts)) > 1  # each choice its own stream
    for i, text in enumerate(texts):  # choice i == the single request with seed 11 + i
        one = client.chat.completions.create(seed=11 + i, **kw)
        if not llm.speculative:  # sampled DSpark: the fp32 draft pass of a batch of 3 is not
            # bit-equal to a batch of 1 here (no row-invariant fp32 kernels), so a sampled
            # draft can differ: same law (test_dspark_decoding), not the same sample
            assert one.choices[0].message.content == text
    assert a.usage.completion_tokens == 24
    assert a.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    chunks = list(client.chat.completions.create(
        n=3, seed=11, stream=True, stream_options={"include_usage": True}, **kw
    ))  # fmt: skip
    per = {i: "" for i in range(3)}
    for c in chunks[:-1]:
        per[c.choices[0].index] += c.choices[0].delta.content or ""
    assert [per[i] for i in range(3)] == texts
    assert chunks[-1].usage.completion_tokens == 24
    finishes = [c.choices[0].index for c in chunks[:-1] if c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]


def test_n_choices_share_the_prompt_pages(client, llm):
    stats = llm.decoder.stats
    before = stats.prefix_hits
    messages = [{"role": "user", "content": LONG + " t3"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, n=3, max_tokens=2, temperature=0.0
    )
    n_prompt = r.usage.prompt_tokens
    shared = (n_prompt - 1) // 32 * 32
    assert shared >= 64
    assert stats.prefix_hits - before == 2 * shared  # choices 1 and 2 attach choice 0's pages
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # the prompt itself was new
    again = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0.0
    )
    assert again.usage.prompt_tokens_details.cached_tokens == shared


def test_penalties_and_logit_bias_follow_the_runtime_processors(client, llm):
    ids = llm.encode_messages(MESSAGES)
    pen = dict(presence_penalty=1.5, frequency_penalty=1.0, logit_bias={"42": 4.0})
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0.0,
        extra_body={"repetition_penalty": 1.3, **NO_EOS}, **pen,
    )  # fmt: skip
    want = runtime(
        llm, ids, max_tokens=16, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0,
        repetition_penalty=1.3, logit_bias=((42, 4.0),),
    )  # fmt: skip
    plain = runtime(llm, ids, max_tokens=16, ignore_eos=True)
    assert r.choices[0].message.content == want.stopper.final_text()
    assert want.output_ids != plain.output_ids
    assert 42 in want.output_ids


def test_min_tokens_holds_back_eos(client, llm):
    ids = llm.encode_messages(MESSAGES)
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0.0,
        logit_bias={"1": 100.0}, extra_body={"min_tokens": 4},
    )  # fmt: skip
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "stop"
    ref = runtime(llm, ids, max_tokens=10, logit_bias=((1, 100.0),), min_tokens=4)
    assert ref.output_ids[-1] == 1 and len(ref.output_ids) == 5


def test_a_grammar_the_vocabulary_cannot_spell_fails_clearly(client, llm):
    # the word tokenizer has no "{": no JSON object can be written with it
    for temperature in (0.0, 1.0):
        with pytest.raises(openai.BadRequestError, match="cannot be continued") as err:
            client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=8, temperature=temperature,
                response_format={"type": "json_object"},
            )  # fmt: skip
        assert err.value.body["code"] == "grammar_unsatisfiable"
    ok = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0.0,
        extra_body={"guided_choice": ["t7", "t9"]},
    )  # fmt: skip
    # then only EOS may follow (t1, or config's id 2, which this word tokenizer prints)
    text = ok.choices[0].message.content
    assert text.removesuffix(" t2").removesuffix(" t1") in ("t7", "t9"), text
    assert ok.choices[0].finish_reason == "stop"
