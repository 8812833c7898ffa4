"""Logits processors (penalties, logit_bias, min_tokens, min_p) and log-probabilities: the
same in a decode row and in every verify row, so DSpark stays exact.

Oracles: a hand-written processor over plain Python lists (OpenAI / vLLM / HF formulas), a
fresh full-context target forward per generated position, and target-only decoding.
"""

from __future__ import annotations

import math

import pytest
import torch
from dspark_fixtures import make_random_draft

from edgebuild.checkpoint.source import WeightSource
from edgebuild.errors import RequestError
from edgebuild.models.llama import LlamaForCausalLM
from edgebuild.runtime.decoding import DSparkDecoder, RequestState, run_to_completion
from edgebuild.runtime.processors import apply_processors, token_logprobs
from edgebuild.runtime.rejection import probs_rows
from edgebuild.runtime.sampling import SamplingParams, target_probs
from edgebuild.runtime.torch_backend import TorchTarget
from tests.test_dspark_decoding import (
    RiggedDraft,
    load_draft,
    prompts_of,
    speculative,
    target_only,
    write_tiny_target,
)

PENALTIES = dict(presence_penalty=0.7, frequency_penalty=0.9, repetition_penalty=1.6)


def oracle(row, params, prompt, context, stop_ids):
    """vLLM's processor order on one row of logits (Python floats), ``context`` = the output
    tokens before this row."""
    z = list(map(float, row))
    for t, b in params.logit_bias:
        z[t] += b
    if len(context) < params.min_tokens:
        for t in stop_ids:
            z[t] = -math.inf
    for t in range(len(z)):
        c = context.count(t)
        if t in context or t in prompt:
            r = params.repetition_penalty
            z[t] = z[t] / r if z[t] > 0 else z[t] * r
        z[t] -= params.frequency_penalty * c + params.presence_penalty * (c > 0)
    return z


def assert_same_logprobs(got, ref):
    """The same tokens and alternatives, the same numbers: bit for bit where the kernels are
    row-invariant (bf16, tests/test_batch_invariance.py); fp32 here has no row-invariant
    matmul, so a verify row and a decode row agree within 1e-5 relative."""
    for g, r in zip(got, ref, strict=True):
        assert len(g.logprobs) == len(r.logprobs) == len(r.output_ids)
        for a, b in zip(g.logprobs, r.logprobs, strict=True):
            assert a.token_id == b.token_id
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            want = [b.logprob] + [v for _, v in b.top]
            assert [a.logprob] + [v for _, v in a.top] == pytest.approx(want, rel=1e-5, abs=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    target_dir = write_tiny_target(tmp_path_factory.mktemp("tiny") / "target")
    return target_dir, LlamaForCausalLM.from_source(WeightSource(target_dir))


def test_every_verify_row_sees_the_output_plus_the_earlier_drafts():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 12, generator=g) * 3
    params = SamplingParams(
        max_tokens=20, min_tokens=5, logit_bias=((3, 2.5), (7, -4.0)), **PENALTIES
    )
    prompt, output, drafts, stops = [1, 2, 2, 9], [4, 4, 5], [5, 11, 4], frozenset({0, 6})
    got = apply_processors(logits, params, prompt, output, drafts, stops)
    for i in range(4):
        want = oracle(logits[i].tolist(), params, prompt, output + drafts[:i], stops)
        assert got[i].tolist() == pytest.approx(want, rel=1e-6), i
    # min_tokens 5: rows 0 and 1 (outputs 3 and 4 long) mask the stops, rows 2 and 3 do not
    assert torch.isinf(got[:2, [0, 6]]).all() and torch.isfinite(got[2:, [0, 6]]).all()


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = SamplingParams(temperature=1.0, min_p=0.2)  # keep p >= 0.1
    want = torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95
    assert torch.allclose(target_probs(logits, params), want, atol=1e-6)
    rows = probs_rows(
        logits.repeat(2, 1),
        torch.ones(2),
        torch.zeros(2, dtype=torch.long),
        torch.ones(2),
        torch.tensor([0.2, 0.0]),
    )
    assert torch.allclose(rows[0], want[0], atol=1e-6)
    assert torch.allclose(rows[1], torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=1e-6)


def test_penalised_greedy_target_only_follows_the_hand_computed_processor(tiny):
    target_dir, model = tiny
    prompt = prompts_of([7])[0]
    params = SamplingParams(max_tokens=24, logit_bias=((5, 1.5),), **PENALTIES)
    out = target_only(model, [prompt], params)[0].output_ids
    plain = target_only(model, [prompt], SamplingParams(max_tokens=24))[0].output_ids
    assert out != plain  # the penalties change the output ...
    assert len(set(out)) > len(set(plain))  # ... towards fewer repeats
    tgt = TorchTarget(model, 4096, 8)
    for k, token in enumerate(out):  # ... and each token is the oracle's argmax
        ids = prompt + out[:k]
        seq = tgt.new_sequence()
        row = tgt.forward([seq], [torch.tensor(ids)], [[len(ids) - 1]]).logits[0][0]
        tgt.free(seq)
        z = oracle(row.tolist(), params, prompt, out[:k], frozenset())
        assert token == max(range(len(z)), key=z.__getitem__), k


@pytest.mark.parametrize("batch_lengths", [[9], [5, 17, 2]])
def test_penalised_greedy_dspark_equals_target_only(tiny, tmp_path, batch_lengths):
    target_dir, model = tiny
    prompts = prompts_of(batch_lengths)
    params = SamplingParams(max_tokens=30, logit_bias=((5, 1.5),), logprobs=3, **PENALTIES)
    ref = target_only(model, prompts, params)
    # a rigged draft proposing the penalised continuation: accepted only if verify row i
    # sees the drafts before it (else its penalised argmax differs from the decode row's)
    full = [p + s.output_ids for p, s in zip(prompts, ref, strict=True)]
    for n in (1, 4, 7):
        got = speculative(model, RiggedDraft(), prompts, params, n, full=full)
        assert [s.output_ids for s in got] == [s.output_ids for s in ref]
        assert all(a == 1.0 for s in got for a in s.metrics.acceptance_by_position)
        assert_same_logprobs(got, ref)
    draft_dir = make_random_draft(tmp_path / "draft", target_dir, block_size=7)
    for n in (3, 7):  # a random draft: rejections and corrections
        got = speculative(model, load_draft(draft_dir, target_dir, n), prompts, params, n)
        assert [s.output_ids for s in got] == [s.output_ids for s in ref]
        assert_same_logprobs(got, ref)


def test_logprobs_are_the_raw_target_log_softmax(tiny):
    _, model = tiny
    prompt = prompts_of([6])[0]
    params = SamplingParams(max_tokens=5, temperature=0.8, seed=3, logprobs=4, **PENALTIES)
    st = target_only(model, [prompt], params)[0]
    assert [e.token_id for e in st.logprobs] == st.output_ids
    tgt = TorchTarget(model, 4096, 8)
    for k, entry in enumerate(st.logprobs):
        ids = prompt + st.output_ids[:k]
        seq = tgt.new_sequence()
        row = tgt.forward([seq], [torch.tensor(ids)], [[len(ids) - 1]]).logits[0][0]
        tgt.free(seq)
        lp = torch.log_softmax(row, -1)
        assert entry.logprob == pytest.approx(float(lp[entry.token_id]), abs=1e-5)
        assert [t for t, _ in entry.top] == lp.topk(4).indices.tolist()
        assert len(entry.top) == 4
    assert token_logprobs(torch.zeros(1, 4), [2], 0)[0].logprob == pytest.approx(-math.log(4))


def test_min_tokens_masks_stop_ids_until_reached(tiny):
    _, model = tiny
    prompt = prompts_of([8])[0]
    free = target_only(model, [prompt], SamplingParams(max_tokens=12))[0].output_ids
    stop = free[0]
    stopped = target_only(model, [prompt], SamplingParams(max_tokens=12, stop_token_ids=(stop,)))
    assert stopped[0].output_ids == [stop]
    held = target_only(
        model, [prompt], SamplingParams(max_tokens=12, stop_token_ids=(stop,), min_tokens=6)
    )[0].output_ids
    assert stop not in held[:6] and len(held) >= 6


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("min_p", 1.5),
        ("min_tokens", 99),
        ("logprobs", 21),
        ("logit_bias", ((1, 101.0),)),
    ],
)
def test_out_of_range_values_are_refused_by_name(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(max_tokens=10, **{field: value})


def test_sampled_dspark_with_penalties_follows_the_processed_target_distribution(tmp_path):
    """Chi-square of (token 2, token 3) against the exact law of the *processed* target
    (penalties over the prompt / the tokens before, then temperature and min-p; vocab 8):
    with row 1 blind to draft 1 (a mutation tried once) chi2 was 185 against a limit of 95.
    tokens 2 and 3 are drafted and verified, so row 1 of a verify pass must see draft 1."""
    vocab, temp, prompt = 8, 1.3, [1, 2, 3]
    target_dir = write_tiny_target(tmp_path / "t", vocab=vocab, layers=2, seed=5, sharpen=1.0)
    model = LlamaForCausalLM.from_source(WeightSource(target_dir))
    draft_dir = make_random_draft(
        tmp_path / "d", target_dir, block_size=4, markov_rank=4, scale=0.5
    )
    draft = load_draft(draft_dir, target_dir, 3, top_k=4)
    pen = dict(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=1.5, min_p=0.05)
    tgt = TorchTarget(model, 4096, 8)
    ref = SamplingParams(max_tokens=4, temperature=temp, **pen)

    def next_probs(out):
        ids = prompt + out
        s = tgt.new_sequence()
        lg = tgt.forward([s], [torch.tensor(ids)], [[len(ids) - 1]]).logits[0]
        tgt.free(s)
        z = torch.tensor([oracle(lg[0].tolist(), ref, prompt, out, frozenset())])
        return target_probs(z, ref)[0]

    exact = torch.zeros(vocab, vocab)
    p1 = next_probs([])
    for t1 in range(vocab):
        p2 = next_probs([t1])
        for t2 in range(vocab):
            exact[t2] += p1[t1] * p2[t2] * next_probs([t1, t2])
    n = 1500
    target = TorchTarget(model, max_kv_rows=8192, page_size=8)
    dec = DSparkDecoder(target, draft, 3)
    counts = torch.zeros(vocab, vocab)
    for chunk in range(0, n, 50):
        states = [
            RequestState.create(
                f"r{i}", prompt, SamplingParams(max_tokens=4, temperature=temp, seed=7000 + i,
                                                ignore_eos=True, **pen)
            )
            for i in range(chunk, chunk + 50)
        ]  # fmt: skip
        run_to_completion(dec, states)
        for st in states:
            counts[st.output_ids[1], st.output_ids[2]] += 1
    expected = exact.flatten() * n
    keep = expected >= 5
    obs = torch.cat([counts.flatten()[keep], counts.flatten()[~keep].sum().reshape(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().reshape(1)])
    chi2 = float(((obs - exp) ** 2 / exp.clamp_min(1e-9)).sum())
    dof = int(keep.sum())
    limit = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3  # 0.999 quantile
    assert chi2 < limit, (chi2, limit, dof)
    # and the penalties matter: the unpenalised law is far from these counts
    plain = SamplingParams(max_tokens=4, temperature=temp)
    assert not torch.allclose(exact, _plain_law(tgt, prompt, plain, vocab), atol=0.02)


def _plain_law(tgt, prompt, params, vocab):
    def probs(ids):
        s = tgt.new_sequence()
        lg = tgt.forward([s], [torch.tensor(ids)], [[len(ids) - 1]]).logits[0]
        tgt.free(s)
        return target_probs(lg, params)[0]

    law = torch.zeros(vocab, vocab)
    p1 = probs(prompt)
    for t1 in range(vocab):
        p2 = probs(prompt + [t1])
        for t2 in range(vocab):
            law[t2] += p1[t1] * p2[t2] * probs(prompt + [t1, t2])
    return law
