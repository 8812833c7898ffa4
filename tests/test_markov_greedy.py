"""The greedy Markov walk in one call (edgebuild.ops.f32_linear.markov_greedy,
DSparkDraft.greedy_path) against an independent float64 walk written from spec §3, and against
the top-k lattice walk it replaces in TorchDraft.walk for greedy requests."""

from __future__ import annotations

import pytest
import torch
from dspark_fixtures import make_random_draft
from serve_fixtures import torch_threads, write_tiny_chat_model

from edgebuild.ops import f32_linear
from edgebuild.runtime import markov_walk
from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.runtime.sampling import SamplingParams

pytestmark = pytest.mark.skipif(
    not f32_linear.available(), reason="edgebuild's AVX2 kernels do not run on this CPU"
)


def reference_walk(base, anchors, counts, k, tmap, w1, w2, gate, h, conf):
    """Spec §3 in float64, slot by slot: top-k of the base logits (a stable descending sort),
    score = top + W2[cand] . u (u = W1[prev], gated: sigmoid(Wg [h; e] + bg) * e), the first
    argmax; confidence sigmoid(h . cw[:d] (+ W1[prev] . cw[d:]) + cb)."""
    batch, n, _ = base.shape
    cand = torch.zeros(batch, n, k, dtype=torch.long)
    choice = torch.zeros(batch, n, dtype=torch.long)
    confidence = torch.ones(batch, n, dtype=torch.float64)
    for b in range(batch):
        prev = int(anchors[b])
        for s in range(counts[b]):
            row = base[b, s].double()
            order = torch.sort(row, descending=True, stable=True).indices[:k]
            ids = order if tmap is None else tmap[order]
            score = row[order].clone()
            e = None
            if w1 is not None:
                e = w1[prev].double()
                u = e
                if gate is not None:
                    z = gate[0].double() @ torch.cat([h[b, s].double(), e]) + gate[1].double()
                    u = torch.sigmoid(z) * e
                score = score + w2[ids].double() @ u
            j = int(score.argmax())  # the first of equal maxima
            if conf is not None:
                cw, cb = conf[0].double(), conf[1]
                d = h.shape[-1]
                z = h[b, s].double() @ cw[:d] + cb
                if cw.shape[0] > d:
                    z = z + e @ cw[d:]
                confidence[b, s] = torch.sigmoid(z)
            cand[b, s], choice[b, s] = ids, j
            prev = int(ids[j])
    return cand, choice, confidence


def _case(g, head, conf_kind, mapped, dtype, integer):
    batch, n, vocab, cols, r, d, k = 3, 5, 300, 200, 8, 16, 12

    def rnd(*shape):  # small integers: many exact ties, sums exact in double and fp32
        if integer:
            return torch.randint(-2, 3, shape, generator=g).float()
        return torch.randn(*shape, generator=g)

    base = rnd(batch, n, cols if mapped else vocab)
    tmap = torch.sort(torch.randperm(vocab, generator=g)[:cols]).values if mapped else None
    w1 = w2 = gate = conf = None
    if head != "none":
        w1, w2 = rnd(vocab, r).to(dtype), rnd(vocab, r).to(dtype)
        if head == "gated":
            gate = (rnd(r, d + r), rnd(r))
    h = rnd(batch, n, d).to(dtype)
    if conf_kind == "h":
        conf = (rnd(d), 0.25)
    elif conf_kind == "markov":
        conf = (rnd(d + r), -0.5)
    anchors = torch.randint(0, vocab, (batch,), generator=g)
    counts = [n, 2, 0]
    return base, anchors, counts, k, tmap, w1, w2, gate, h, conf


@pytest.mark.parametrize("integer", [True, False], ids=["ties", "random"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mapped", [False, True], ids=["vocab", "token_map"])
@pytest.mark.parametrize(
    "head,conf_kind",
    [("vanilla", "markov"), ("vanilla", "h"), ("gated", "markov"), ("none", "h"),
     ("none", None), ("vanilla", None)],
)  # fmt: skip
def test_the_one_call_walk_is_the_exact_argmax_path(head, conf_kind, mapped, dtype, integer):
    g = torch.Generator().manual_seed(11)
    for _ in range(3):
        args = _case(g, head, conf_kind, mapped, dtype, integer)
        base, anchors, counts, k, tmap, w1, w2, gate, h, conf = args
        got = f32_linear.markov_greedy(
            base, anchors, torch.tensor(counts), k, tmap, w1, w2, gate, h, conf
        )
        cand, choice, confidence = got
        want = reference_walk(*args)
        for b, c in enumerate(counts):  # slots past counts[b]: zeros / ones
            assert torch.equal(cand[b, :c], want[0][b, :c]), (b, cand[b], want[0][b])
            assert torch.equal(choice[b, :c], want[1][b, :c]), (b, choice[b], want[1][b])
            assert not cand[b, c:].any() and not choice[b, c:].any()
            assert bool((confidence[b, c:] == 1).all())
        torch.testing.assert_close(confidence.double(), want[2], atol=1e-7, rtol=1e-6)


def test_the_one_call_walk_takes_the_first_of_tied_and_nan_scores():
    base = torch.zeros(1, 3, 10)
    base[0, 0, 3] = base[0, 0, 7] = 1.0  # candidates 3 then 7 (ties: the lower column first)
    base[0, 1, 4] = float("nan")  # NaN ranks above every number, and is chosen
    base[0, 2] = torch.arange(10, 0, -1).float()  # candidates 0, 1, 2 in that order
    w1, w2 = torch.ones(10, 4), torch.ones(10, 4)  # the same bias on every candidate
    w2[2, 1] = float("nan")  # slot 2's third candidate scores NaN: chosen over larger numbers
    w2[1, 0] = float("nan")  # ... and its second too: the first NaN wins
    cand, choice, _ = f32_linear.markov_greedy(
        base, torch.tensor([0]), torch.tensor([3]), 3, None, w1, w2
    )
    assert cand[0, 0].tolist()[:2] == [3, 7] and int(choice[0, 0]) == 0
    assert int(cand[0, 1, 0]) == 4 and int(choice[0, 1]) == 0
    assert cand[0, 2].tolist() == [0, 1, 2] and int(choice[0, 2]) == 1
    scores = base[0, 2, :3].double() + w2[:3].double() @ w1[0].double()
    assert int(scores.argmax()) == 1  # torch's rule: the first NaN


def test_the_one_call_walk_reads_h_by_its_own_rows():
    """h may hold more rows than the slots walked (the block's rows): slot s of request b
    reads h[b, s], not the flat index of base's row."""
    g = torch.Generator().manual_seed(8)
    base, anchors, counts, k, tmap, w1, w2, gate, h, conf = _case(
        g, "gated", "markov", False, torch.float32, False
    )
    wide = torch.cat([h, torch.randn(h.shape[0], 3, h.shape[2], generator=g)], 1)  # [B, n+3, d]
    got = f32_linear.markov_greedy(
        base, anchors, torch.tensor(counts), k, tmap, w1, w2, gate, wide, conf
    )
    want = reference_walk(base, anchors, counts, k, tmap, w1, w2, gate, h, conf)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2].double(), want[2], atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"counts": [4]}, "counts"),
        ({"anchors": [99]}, "outside the Markov head's vocabulary"),
        ({"k": 11}, "k must be in"),
        ({"w2": torch.ones(10, 3)}, "W1 and W2"),
    ],
)
def test_the_one_call_walk_refuses_what_does_not_fit(bad, match):
    args = {"counts": [2], "anchors": [0], "k": 3, "w2": torch.ones(10, 4)}
    args.update(bad)
    with pytest.raises(RuntimeError, match=match):
        f32_linear.markov_greedy(
            torch.zeros(1, 2, 10), torch.tensor(args["anchors"]), torch.tensor(args["counts"]),
            args["k"], None, torch.ones(10, 4), args["w2"],
        )  # fmt: skip


class AllowAll:  # a grammar's DraftMask that allows every token
    def allowed(self, ids):
        return torch.ones(ids.shape, dtype=torch.bool)

    def accept(self, token):
        return True


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.mark.parametrize("mapped", [False, True], ids=["vocab", "token_map"])
@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_greedy_requests_walk_the_path_as_the_lattice_walks_it(
    tiny_target, tmp_path, head, mapped, monkeypatch
):
    """TorchDraft.walk for a greedy batch: the one-call path gives the lattice walk's
    proposals (tokens, q, q_ids; confidences within fp32 rounding); an rnn head, a sampled
    request or a grammar take the walks they took before."""
    draft_dir = make_random_draft(
        tmp_path / "draft", tiny_target, markov_head_type=head, scale=0.5, seed=3
    )
    spec = {"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": 4}
    opts = RuntimeOptions(dtype=torch.float32, max_kv_rows=256, page_size=8)
    with torch_threads(1):
        draft = LLM(tiny_target, speculative=spec, options=opts).draft
        model = draft.model
        if mapped:
            model.pack_for_cpu(None, torch.arange(0, 256, 3))
        g = torch.Generator().manual_seed(2)
        batch, n = 3, 4
        h = torch.randn(batch, n, model.config.hidden_size, generator=g)
        base = model.base_logits(h) * 20  # spread: no near-ties between candidates
        anchors, counts = [5, 17, 200], [4, 1, 3]
        greedy = [SamplingParams(temperature=0.0)] * batch
        gens = [torch.Generator() for _ in range(batch)]
        ran = []
        path = model.greedy_path
        monkeypatch.setattr(model, "greedy_path", lambda *a: ran.append(path(*a)) or ran[-1])
        got = draft.walk(h, base, anchors, counts, greedy, gens)
        assert len(ran) == (0 if head == "rnn" else 1) and all(r is not None for r in ran)
        monkeypatch.undo()
        if head == "rnn":
            assert model.greedy_path(h, base, torch.tensor(anchors), counts, 8) is None
            return
        cand, scores, conf = model.lattice(h, base, torch.tensor(anchors), draft.top_k)
        want = markov_walk.walk_lattice(cand, scores, conf, counts, greedy, gens)
        for a, b in zip(got, want, strict=True):
            assert a.tokens == b.tokens
            assert torch.equal(a.q, b.q) and torch.equal(a.q_ids, b.q_ids)
            torch.testing.assert_close(a.confidence, b.confidence, atol=1e-6, rtol=1e-5)
        assert any(len(set(p.tokens)) > 1 for p in got)  # the walk moved between tokens
        calls = []
        monkeypatch.setattr(model, "greedy_path", lambda *a: calls.append(1))
        sampled = [SamplingParams(temperature=0.7, seed=1)] + greedy[1:]
        draft.walk(h, base, anchors, counts, sampled, gens)
        draft.walk(h, base, anchors, counts, greedy, gens, [AllowAll(), None, None])
        assert calls == []  # a sampled request or a grammar: the lattice
