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


# ---------------------------------------------------------------------- prompt logprobs
PROMPT_IDS = [2] + [10 + (i * 7) % 200 for i in range(90)]  # 91 rows: 3 chunks of 32


@pytest.fixture(scope="module")
def hf_prompt_logprobs(model_dir):
    """The oracle: log_softmax of a transformers fp32 forward over PROMPT_IDS, [91, V]."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([PROMPT_IDS])).logits[0].float(), -1)


def test_prompt_logprobs_equal_a_transformers_forward_chunked_and_past_the_cache(
    llm, model_dir, tmp_path, hf_prompt_logprobs
):
    import torch

    from edgebuild.runtime.prefill import PrefillConfig

    options = RuntimeOptions(
        max_kv_rows=4096, dtype=torch.float32, prefill=PrefillConfig(prefill_chunk=32)
    )
    spec = None
    if llm.speculative:
        draft = make_random_draft(tmp_path / "d", model_dir, block_size=5)
        spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": 4}
    fp32 = LLM(model_dir, speculative=spec, options=options)
    kw = dict(max_tokens=6, ignore_eos=True)
    plain = fp32.generate_ids([PROMPT_IDS], SamplingParams(**kw))[0]  # caches 2 pages
    again = fp32.generate_ids([PROMPT_IDS], SamplingParams(**kw))[0]
    assert again.metrics.cached_prompt_tokens == 64  # the cache is live
    st = fp32.generate_ids([PROMPT_IDS], SamplingParams(prompt_logprobs=3, **kw))[0]
    assert st.metrics.cached_prompt_tokens == 0  # skipped: every prompt row computed
    assert st.output_ids == plain.output_ids
    ref, nxt = hf_prompt_logprobs[:-1], torch.tensor(PROMPT_IDS[1:])
    assert st.prompt_logprobs[0] is None and len(st.prompt_logprobs) == len(PROMPT_IDS)
    got = torch.tensor([e.logprob for e in st.prompt_logprobs[1:]])
    torch.testing.assert_close(got, ref[torch.arange(90), nxt], atol=1e-4, rtol=0)
    ranks = (ref > ref[torch.arange(90), nxt][:, None]).sum(-1) + 1
    assert [e.rank for e in st.prompt_logprobs[1:]] == ranks.tolist()
    top = torch.tensor([[t for t, _ in e.top] for e in st.prompt_logprobs[1:]])
    assert torch.equal(top, ref.topk(3, dim=-1).indices)
    # chunked prefill off: still at most prefill_chunk rows of logits a pass, same numbers
    fp32.set_prefill(PrefillConfig(enable_chunked_prefill=False, prefill_chunk=32))
    whole = fp32.generate_ids([PROMPT_IDS], SamplingParams(prompt_logprobs=3, **kw))[0]
    again = torch.tensor([e.logprob for e in whole.prompt_logprobs[1:]])
    torch.testing.assert_close(again, got, atol=1e-5, rtol=0)
    assert whole.output_ids == plain.output_ids


def test_echo_logprobs_lead_with_the_prompt_streamed_and_not(client, llm):
    kw = dict(model=MODEL, prompt="t7 t8 t9", max_tokens=5, temperature=0.0, extra_body=NO_EOS)
    ids = llm.encode("t7 t8 t9")
    ref = runtime(llm, ids, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    plain_choice = client.completions.create(logprobs=2, **kw).choices[0]
    plain = plain_choice.logprobs
    full = client.completions.create(echo=True, logprobs=2, **kw).choices[0]
    lp, n = full.logprobs, len(ids)
    tok = llm.tokenizer
    assert lp.tokens[:n] == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # OpenAI's shape
    want = [e.logprob for e in ref.prompt_logprobs[1:]]
    assert lp.token_logprobs[1:n] == pytest.approx(want, abs=1e-5)
    assert [list(d) for d in lp.top_logprobs[1:n]] == [
        [tok.decode([t]) for t, _ in e.top] for e in ref.prompt_logprobs[1:]
    ]
    assert lp.tokens[n:] == plain.tokens and lp.token_logprobs[n:] == plain.token_logprobs
    assert lp.text_offset[: n + 1] == [0, 2, 4, len("t7 t8 t9")]
    assert full.text == "t7 t8 t9" + plain_choice.text
    chunks = list(client.completions.create(echo=True, logprobs=2, stream=True, **kw))
    parts = [c.choices[0] for c in chunks if c.choices]
    assert parts[0].text == "t7 t8 t9" and parts[0].logprobs.tokens == lp.tokens[:n]
    assert "".join(p.text for p in parts) == full.text
    assert [v for p in parts if p.logprobs for v in p.logprobs.token_logprobs] == [
        *lp.token_logprobs
    ]


def test_vllm_prompt_logprobs_on_both_endpoints(client, llm):
    ids = llm.encode("t7 t8 t9")
    ref = runtime(llm, ids, max_tokens=2, prompt_logprobs=1)
    body = {"prompt_logprobs": 1, "ignore_eos": True}
    out = client.completions.create(
        model=MODEL, prompt="t7 t8 t9", max_tokens=2, temperature=0.0, extra_body=body
    )
    got = out.choices[0].prompt_logprobs
    assert got[0] is None and len(got) == len(ids)
    for d, token, e in zip(got[1:], ids[1:], ref.prompt_logprobs[1:], strict=True):
        assert d[str(token)]["logprob"] == pytest.approx(e.logprob, abs=1e-5)
        assert d[str(token)]["rank"] == e.rank
        best = str(e.top[0][0])
        assert d[best]["rank"] == 1 and d[best]["decoded_token"] == llm.tokenizer.decode(
            [e.top[0][0]]
        )
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0.0, extra_body=body
    )
    chat_ids = llm.encode_messages(MESSAGES)
    assert len(chat.prompt_logprobs) == len(chat_ids) and chat.prompt_logprobs[0] is None
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs") as err:
        client.completions.create(
            model=MODEL, prompt="t7", max_tokens=2, stream=True, extra_body=body
        )
    assert err.value.body["param"] == "prompt_logprobs"


def test_prompt_logprobs_survive_a_preemption_in_the_middle_of_the_prefill(model_dir):
    from edgebuild.runtime.decoding import run_to_completion
    from edgebuild.runtime.prefill import PrefillConfig

    options = RuntimeOptions(max_kv_rows=4096, prefill=PrefillConfig(prefill_chunk=32))
    llm = LLM(model_dir, options=options)
    params = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    ref = llm.generate_ids([PROMPT_IDS], params)[0]
    st = llm.new_request(PROMPT_IDS, params)
    llm.decoder.step([st])  # the first 32 rows
    assert len(st.prompt_logprobs) == 1 + 32 and st.anchor is None  # None, then rows 1..32
    llm.preempt(st)
    need_t, need_d = llm.step_pages(st)  # its first step again, from row 0 (no cache read)
    assert (need_t, need_d) == (1, 0)
    llm.resume(st)
    run_to_completion(llm.decoder, [st])
    assert st.prompt_logprobs == ref.prompt_logprobs and st.output_ids == ref.output_ids
