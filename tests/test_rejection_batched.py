"""The batched verifier and the vectorised walk against the per-request rules and exact laws.

Oracles: the per-request parts ``accept`` / ``resample`` / ``bonus`` of runtime/decoding.py
(forced-argmax cases), ``target_probs`` (row-wise probabilities), and closed forms: the
committed token of a sampled step follows p exactly, and a draft is accepted with
probability sum_x min(p(x), q(x)) (Leviathan et al. 2023, section 3).
"""

from __future__ import annotations

import math

import pytest
import torch

from edgebuild.runtime.backend import Proposal
from edgebuild.runtime.decoding import accept, bonus, resample
from edgebuild.runtime.markov_walk import inverse_cdf, walk_lattice
from edgebuild.runtime.rejection import probs_rows, verify_batch
from edgebuild.runtime.sampling import SamplingParams, target_probs

GREEDY = SamplingParams(max_tokens=8)


def _chi2_limit(dof: int) -> float:
    """0.999 quantile of chi-square (Wilson-Hilferty)."""
    z = 3.0902
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_greedy_batch_matches_the_per_request_rules():
    g = torch.Generator().manual_seed(0)
    v = 12
    logits, props, want = [], [], []
    for b, drafts in enumerate([[2, 3, 1], [4], [], [7, 7, 7, 7], [9, 6]]):
        lg = torch.randn(len(drafts) + 1, v, generator=g)
        if b == 0:  # rig: rows 0 and 1 agree with the drafts, row 2 does not
            lg[0, 2] = lg[1, 3] = 50.0
        if b == 4:  # ties: the first index wins (row 0 accepts 9, row 1 rejects 6 for 2)
            lg[0, 9] = 50.0
            lg[1, 2] = lg[1, 6] = 50.0
        logits.append(lg)
        q = torch.nn.functional.one_hot(torch.tensor(drafts, dtype=torch.long), v).float()
        props.append(Proposal(drafts, q.reshape(len(drafts), v), torch.ones(len(drafts))))
        p = target_probs(lg, GREEDY)
        a = accept(p, q, drafts, True, g)
        nxt = resample(p[a], q[a], True, g) if a < len(drafts) else bonus(p[a], True, g)
        want.append((a, nxt))
    got = verify_batch(logits, props, [GREEDY] * 5, [g] * 5)
    assert [(x.accepted, x.next_token) for x in got] == want
    assert want[0][0] == 2 and want[4] == (1, 2)  # the rigs worked


def test_probs_rows_equal_target_probs_for_every_setting():
    g = torch.Generator().manual_seed(1)
    settings = [(0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.5, 3, 0.6), (2.0, 40, 0.95)]
    logits = torch.randn(len(settings), 40, generator=g)
    got = probs_rows(
        logits,
        torch.tensor([s[0] for s in settings]),
        torch.tensor([s[1] for s in settings]),
        torch.tensor([s[2] for s in settings]),
    )
    for i, (t, k, p) in enumerate(settings):
        want = target_probs(logits[i], SamplingParams(temperature=t, top_k=k, top_p=p))
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-7)


def test_sampled_step_commits_tokens_that_follow_p_exactly():
    """One draft with q != p: the first committed token must be distributed as p (chi-square),
    and the acceptance rate must be sum min(p, q)."""
    v, n = 6, 3000
    p_logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.0], [0.0, 1.0, 0.0, 1.0, 0.0, 0.0]])
    params = SamplingParams(temperature=1.0, seed=0)
    p = torch.softmax(p_logits[0], -1)
    q_ids = torch.tensor([[3, 1, 4]])  # sparse draft distribution on 3 candidates
    q_vals = torch.tensor([[0.2, 0.5, 0.3]])
    drafts = inverse_cdf(
        q_vals.expand(n, -1), torch.rand(n, generator=torch.Generator().manual_seed(7))
    )
    props = [
        Proposal([int(q_ids[0, d])], q_vals, torch.ones(1), q_ids=q_ids) for d in drafts.tolist()
    ]
    gens = [torch.Generator().manual_seed(100 + i) for i in range(n)]
    out = verify_batch([p_logits] * n, props, [params] * n, gens)
    first = torch.tensor([o.tokens(pr.tokens)[0] for o, pr in zip(out, props, strict=True)])
    obs = torch.bincount(first, minlength=v).double()
    exp = p.double() * n
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert chi2 < _chi2_limit(v - 1), (chi2, obs.tolist(), exp.tolist())
    q_dense = torch.zeros(v).scatter_(0, q_ids[0], q_vals[0])
    rate = sum(o.accepted for o in out) / n
    want = float(torch.minimum(p, q_dense).sum())
    assert abs(rate - want) < 4 * math.sqrt(want * (1 - want) / n), (rate, want)


def test_a_draft_outside_its_candidates_is_rejected():
    params = SamplingParams(temperature=1.0, seed=0)
    prop = Proposal([5], torch.tensor([[1.0, 0.0]]), torch.ones(1), q_ids=torch.tensor([[2, 3]]))
    out = verify_batch([torch.zeros(2, 8)], [prop], [params], [torch.Generator().manual_seed(0)])
    assert out[0].accepted == 0


def test_walk_lattice_greedy_follows_the_chain_and_samples_by_softmax():
    cand = torch.tensor([[[10, 11, 12], [20, 21, 22]]])  # [1, n=2, K=3]
    scores = torch.zeros(1, 2, 3, 3)
    scores[0, 0, :, 1] = 5.0  # slot 0 (row 0 read): candidate 1 -> token 11
    scores[0, 1, 1, 2] = 5.0  # slot 1 given candidate 1: candidate 2 -> token 22
    conf = torch.tensor([[[0.9, 0.8, 0.7], [0.6, 0.5, 0.4]]])
    (prop,) = walk_lattice(cand, scores, conf, [2], [GREEDY], [torch.Generator()])
    assert prop.tokens == [11, 22]
    assert prop.confidence.tolist() == pytest.approx([0.9, 0.5])
    assert prop.dense_q(30)[0, 11] == 1.0 and prop.token_q().tolist() == [1.0, 1.0]
    # sampled: slot 0 frequencies follow softmax(scores / T) (chi-square)
    s = torch.zeros(1, 1, 3, 3)
    s[0, 0, 0] = torch.tensor([0.0, 1.0, -1.0])
    params = SamplingParams(temperature=0.8, seed=0)
    n = 4000
    props = walk_lattice(
        cand[:, :1].expand(n, -1, -1),
        s.expand(n, -1, -1, -1),
        None,
        [1] * n,
        [params] * n,
        [torch.Generator().manual_seed(i) for i in range(n)],
    )
    counts = torch.bincount(torch.tensor([pr.tokens[0] - 10 for pr in props]), minlength=3)
    exp = torch.softmax(s[0, 0, 0] / 0.8, -1).double() * n
    chi2 = float(((counts.double() - exp) ** 2 / exp).sum())
    assert chi2 < _chi2_limit(2), (chi2, counts.tolist())


def test_inverse_cdf_never_returns_a_zero_probability_index():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(200, -1)
    u = torch.linspace(0, 1, 200)
    idx = inverse_cdf(probs, u)
    assert set(idx.tolist()) == {1, 3}
