"""DSpark speculative decoding is lossless; the verifier, stops and cache rollback are exact.

Oracles: the target-only decoder (greedy), the exact target distribution enumerated from the
target model (sampling), and hand-built p/q tables (verifier).
"""

from __future__ import annotations

import math

import pytest
import torch
from dspark_fixtures import make_random_draft
from tiny_checkpoints import write_tiny_llama

from edgebuild.checkpoint.source import WeightSource
from edgebuild.errors import ConfigError, PairingError
from edgebuild.models.llama import LlamaForCausalLM
from edgebuild.ops.attention import gather_kv
from edgebuild.runtime.backend import Proposal
from edgebuild.runtime.decoding import (
    DSparkDecoder,
    RequestState,
    TargetOnlyDecoder,
    accept,
    bonus,
    resample,
    run_to_completion,
)
from edgebuild.runtime.dspark_loader import prepare_torch_draft as prepare_draft
from edgebuild.runtime.llm import RuntimeOptions
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.runtime.torch_backend import TorchTarget
from edgebuild.speculative.config import SpeculativeConfig

transformers = pytest.importorskip("transformers")


# ---------------------------------------------------------------------- fixtures
def write_tiny_target(path, vocab=96, layers=4, seed=0, sharpen=20.0):
    """The tiny tied Llama target of these tests (tests/tiny_checkpoints.py)."""
    return write_tiny_llama(path, vocab, layers, seed, sharpen)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target_dir = write_tiny_target(root / "target")
    model = LlamaForCausalLM.from_source(WeightSource(target_dir))
    return target_dir, model


def load_draft(draft_dir, target_dir, n, top_k=16, threshold=0.0):
    spec = SpeculativeConfig.parse(
        {
            "method": "dspark",
            "model": str(draft_dir),
            "num_speculative_tokens": n,
            "draft_top_k": top_k,
            "confidence_threshold": threshold,
            # the draft as stored: the engines' graphs and the reference forwards these tests
            # compare it with are unquantized (the default int4 packing: test_draft_quant.py)
            "quantization": "none",
        }
    )
    return prepare_draft(spec, WeightSource(target_dir))(
        RuntimeOptions(max_kv_rows=4096, page_size=8)
    )


class RiggedDraft:
    """A draft that proposes the target's own greedy continuation (everything is accepted).

    `continuations[seq_id]` is the full greedy token list (prompt + output); the anchor sits at
    position s = context length, so the drafts are full[s+1 : s+1+n].
    """

    block_size = 7

    def __init__(self, target_layer_ids=(0,), vocab=96, wrong_at: int | None = None):
        from edgebuild.runtime.kv_cache import PageAllocator

        self.target_layer_ids = target_layer_ids
        self.alloc = PageAllocator(4096, 16)
        self.full: dict[int, list[int]] = {}
        self.vocab = vocab
        self.wrong_at = wrong_at  # propose a wrong token at this draft index (rejection tests)

    def new_sequence(self):
        return self.alloc.new_sequence()

    def free(self, seq):
        self.alloc.free(seq)

    def update_context(self, seqs, features):
        for s, f in zip(seqs, features, strict=True):
            self.alloc.reserve(s, f.shape[0])
            self.alloc.advance(s, f.shape[0])

    def propose(self, seqs, anchors, num_tokens, params, generators):
        out = []
        for s, n in zip(seqs, num_tokens, strict=True):
            full = self.full[s.seq_id]
            toks = list(full[s.length + 1 : s.length + 1 + n])
            toks += [0] * (n - len(toks))
            if self.wrong_at is not None and self.wrong_at < len(toks):
                toks[self.wrong_at] = (toks[self.wrong_at] + 1) % self.vocab
            q = torch.nn.functional.one_hot(
                torch.tensor(toks, dtype=torch.long), self.vocab
            ).float()
            out.append(Proposal(toks, q.reshape(n, self.vocab), torch.ones(n)))
        return out


def target_only(model, prompts, params, stop_ids=frozenset()):
    dec = TargetOnlyDecoder(TorchTarget(model, max_kv_rows=4096, page_size=8))
    states = [RequestState.create(f"r{i}", p, params, stop_ids) for i, p in enumerate(prompts)]
    run_to_completion(dec, states)
    return states


def speculative(model, draft, prompts, params, n, stop_ids=frozenset(), full=None, keep=False):
    target = TorchTarget(model, max_kv_rows=4096, page_size=8)
    dec = DSparkDecoder(target, draft, n)
    states = [RequestState.create(f"r{i}", p, params, stop_ids) for i, p in enumerate(prompts)]
    for i, st in enumerate(states):
        dec.start(st)
        if full is not None:
            draft.full[st.draft_seq.seq_id] = full[i]
    if keep:  # step manually and keep the caches for inspection
        active = list(states)
        while any(not s.finished for s in active):
            dec.step([s for s in active if not s.finished])
        return states, target
    run_to_completion(dec, states)
    return states


def prompts_of(lengths, vocab=96, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 1, (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------------- greedy losslessness
@pytest.mark.parametrize("batch_lengths", [[9], [5, 17, 2, 11]])
def test_random_draft_greedy_output_equals_target_only_for_every_n(tiny, tmp_path, batch_lengths):
    target_dir, model = tiny
    draft_dir = make_random_draft(tmp_path / "draft", target_dir, block_size=7, num_layers=2)
    prompts = prompts_of(batch_lengths)
    params = SamplingParams(max_tokens=40)
    ref = [s.output_ids for s in target_only(model, prompts, params)]
    total = 0
    for n in range(1, 8):
        draft = load_draft(draft_dir, target_dir, n)
        got = speculative(model, draft, prompts, params, n)
        assert [s.output_ids for s in got] == ref, f"num_speculative_tokens={n}"
        total += sum(len(s.output_ids) for s in got)
    assert total >= 7 * 40 * len(prompts)


def test_a_lattice_over_the_memory_bound_is_walked_token_by_token_with_the_same_drafts(
    tiny, tmp_path, monkeypatch
):
    """A large draft_top_k must not build a K x K lattice (it OOM-killed a 24 GB host at
    K=4096): over LATTICE_MAX_BYTES the walk goes token by token, with the same proposals
    (and the greedy one-call path, which builds no lattice at any K, with them too)."""
    import edgebuild.runtime.dspark_backend as backend

    target_dir, model = tiny
    draft_dir = make_random_draft(tmp_path / "draft", target_dir, block_size=7, num_layers=2)
    prompts = prompts_of([5, 17, 2, 11])
    params = SamplingParams(max_tokens=30)
    ref = [s.output_ids for s in target_only(model, prompts, params)]
    runs = {}
    for bound, one_call in ((backend.LATTICE_MAX_BYTES, False), (0, False), (0, True)):
        monkeypatch.setattr(backend, "LATTICE_MAX_BYTES", bound)  # 0: every lattice is over
        draft = load_draft(draft_dir, target_dir, 7, top_k=16)
        # TorchDraft.walk's own paths: not the walk inside the one-call draft pass (equal to
        # greedy_path: tests/test_draft_program.py)
        draft.model.pass_args = None
        calls = []
        lattice = draft.model.lattice
        monkeypatch.setattr(
            draft.model, "lattice", lambda *a, c=calls, f=lattice: c.append(1) or f(*a)
        )
        path, ran = draft.model.greedy_path, []
        if not one_call:  # the lattice / token-by-token walks the greedy path replaces
            monkeypatch.setattr(draft.model, "greedy_path", lambda *a: None)
        else:  # the one-call path, seen to run (not a fallback)
            monkeypatch.setattr(
                draft.model, "greedy_path", lambda *a, f=path, r=ran: r.append(f(*a)) or r[-1]
            )
        got = speculative(model, draft, prompts, params, 7)
        assert [s.output_ids for s in got] == ref  # lossless either way
        assert not one_call or (ran and all(r is not None for r in ran))
        runs[bound, one_call] = ([s.metrics.acceptance_by_position for s in got], bool(calls))
    (acc_lattice, used), (acc_token, used_small), (acc_path, used_path) = runs.values()
    assert used and not used_small and not used_path
    assert acc_token == acc_lattice == acc_path  # the same drafts were proposed and accepted
    assert backend.lattice_bytes(28, 7, 4096, 576) > 10 * 2**30  # the case that was killed


def test_the_decoder_proposes_in_one_call_and_stays_lossless(tiny, tmp_path, monkeypatch):
    """DSparkDecoder.propose hands the pending context rows and the block to the draft in one
    call (TorchDraft.propose_after_context, the C++ draft_pass where the draft runs on the
    kernels): greedy output equals target-only and the same as with the two passes (the
    decoder on a draft class without the method), with the same acceptance."""
    from edgebuild.ops import f32_linear
    from edgebuild.runtime.dspark_backend import TorchDraft

    if not f32_linear.available():
        pytest.skip("edgebuild's kernels do not run on this CPU")
    target_dir, model = tiny
    draft_dir = make_random_draft(tmp_path / "draft", target_dir, block_size=7, num_layers=2)
    prompts = prompts_of([5, 17, 2, 11])
    params = SamplingParams(max_tokens=30)
    ref = [s.output_ids for s in target_only(model, prompts, params)]
    draft = load_draft(draft_dir, target_dir, 4)
    assert draft.model.pass_args is not None
    calls = []
    real = draft.model.draft_pass
    monkeypatch.setattr(draft.model, "draft_pass", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = speculative(model, draft, prompts, params, 4)
    assert [s.output_ids for s in got] == ref and calls  # the one call ran
    monkeypatch.delattr(TorchDraft, "propose_after_context")  # the decoder's two passes
    two = speculative(model, load_draft(draft_dir, target_dir, 4), prompts, params, 4)
    assert [s.output_ids for s in two] == ref
    acc = [[s.metrics.acceptance_by_position for s in states] for states in (got, two)]
    assert acc[0] == acc[1]  # the same drafts were proposed and accepted
    assert any(a > 0 for per in acc[0] for a in per)  # some drafts were accepted


@pytest.mark.parametrize("batch_lengths", [[9], [5, 17, 2, 11]])
def test_rigged_draft_accepts_everything_and_stays_lossless(tiny, batch_lengths):
    _, model = tiny
    prompts = prompts_of(batch_lengths)
    params = SamplingParams(max_tokens=50)
    ref = target_only(model, prompts, params)
    full = [p + s.output_ids for p, s in zip(prompts, ref, strict=True)]
    for n in range(1, 8):
        got = speculative(model, RiggedDraft(), prompts, params, n, full=full)
        assert [s.output_ids for s in got] == [s.output_ids for s in ref]
        for st in got:  # every proposal accepted: tau == n + 1 except the budget-cut last step
            acc = st.metrics.acceptance_by_position
            assert acc and all(a == 1.0 for a in acc), acc
            assert st.metrics.tau > min(n + 1, 50) * 0.8


def test_kv_cache_after_rejections_equals_target_only_cache(tiny):
    _, model = tiny
    prompts = prompts_of([7, 12])
    params = SamplingParams(max_tokens=30)
    ref_states, ref_target = None, TorchTarget(model, max_kv_rows=4096, page_size=8)
    dec = TargetOnlyDecoder(ref_target)
    ref_states = [RequestState.create(f"r{i}", p, params) for i, p in enumerate(prompts)]
    for st in ref_states:
        dec.start(st)
    while any(not s.finished for s in ref_states):
        dec.step([s for s in ref_states if not s.finished])
    full = [p + s.output_ids for p, s in zip(prompts, ref_states, strict=True)]
    rigged = RiggedDraft(wrong_at=2)  # every step rejects at the third draft
    states, target = speculative(model, rigged, prompts, params, 5, full=full, keep=True)
    for st, ref in zip(states, ref_states, strict=True):
        assert st.output_ids == ref.output_ids
        length = min(st.seq.length, ref.seq.length)
        assert length >= len(st.prompt_ids) + 20
        for layer in range(model.config.num_hidden_layers):
            k1, v1 = gather_kv(
                target.pools[layer], target.allocator.page_table([st.seq]), 0, length
            )
            k2, v2 = gather_kv(
                ref_target.pools[layer], ref_target.allocator.page_table([ref.seq]), 0, length
            )
            torch.testing.assert_close(k1, k2, atol=1e-5, rtol=0)
            torch.testing.assert_close(v1, v2, atol=1e-5, rtol=0)
        # rejected rows were rolled back: the cache holds prompt + committed tokens minus the anchor
        assert st.seq.length == len(st.prompt_ids) + len(st.output_ids) - 1


def test_budget_shrinks_the_last_block_without_negative_rollback(tiny):
    _, model = tiny
    prompts = prompts_of([6])
    for max_tokens in (1, 2, 3, 8, 9):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        ref = target_only(model, prompts, params)
        full = [prompts[0] + ref[0].output_ids + [0] * 10]
        got = speculative(model, RiggedDraft(), prompts, params, 7, full=full)
        assert got[0].output_ids == ref[0].output_ids
        assert len(got[0].output_ids) == max_tokens
        assert got[0].stopper.finish_reason == "length"


# ---------------------------------------------------------------------- stops inside a block
def test_stop_token_inside_an_accepted_block_truncates_exactly(tiny):
    _, model = tiny
    prompts = prompts_of([6])
    ref = target_only(model, prompts, SamplingParams(max_tokens=12, ignore_eos=True))[0].output_ids
    stop = ref[2]
    first = ref.index(stop)
    full = [prompts[0] + ref]
    got = speculative(
        model, RiggedDraft(), prompts, SamplingParams(max_tokens=5), 7, frozenset({stop}), full
    )
    assert got[0].output_ids == ref[: first + 1]
    assert got[0].stopper.finish_reason == "stop"
    # the same stop beyond the cap: exactly max_tokens tokens and finish "length"
    cap = first  # stop would be token number first+1 > cap
    if cap >= 1:
        got = speculative(
            model,
            RiggedDraft(),
            prompts,
            SamplingParams(max_tokens=cap),
            7,
            frozenset({stop}),
            full,
        )
        assert got[0].output_ids == ref[:cap] and got[0].stopper.finish_reason == "length"


def test_stop_checker_sequence_cases():
    from edgebuild.runtime.stopping import StopChecker

    a, b, stop, c, d, e = 10, 11, 99, 12, 13, 14
    s = StopChecker(5, frozenset({stop}))
    assert s.feed_many([a, b, stop, c, d, e]) == [a, b, stop]
    assert s.output_ids == [a, b, stop] and s.finish_reason == "stop"
    s = StopChecker(5, frozenset({stop}))
    assert s.feed_many([a, b, c, d, e, stop]) == [a, b, c, d, e]
    assert s.finish_reason == "length"


def test_stop_string_completed_at_first_position_of_a_long_block_is_caught():
    from edgebuild.runtime.stopping import IncrementalDetokenizer, StopChecker

    class Tok:
        pieces = {1: "Hello", 2: " wor", 3: "ld", 4: "!", 5: " more", 6: " text"}

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.pieces[i] for i in ids)

    s = StopChecker(50, frozenset(), ("world",), IncrementalDetokenizer(Tok()))
    assert s.feed_many([1, 2]) == [1, 2]  # previous step ended mid-string
    assert s.feed_many([3, 4, 5, 6]) == [3]  # a block whose first token completes the stop
    assert s.finish_reason == "stop" and s.final_text() == "Hello "


# ---------------------------------------------------------------------- verifier parts
def test_verifier_with_forced_argmax():
    v = 6
    p = torch.zeros(4, v)
    p[0, 2] = p[1, 3] = p[2, 1] = p[3, 5] = 1.0  # target argmax: 2, 3, 1 then bonus 5
    q = torch.zeros(3, v)
    g = torch.Generator().manual_seed(0)
    assert accept(p, q, [2, 3, 1], True, g) == 3
    assert bonus(p[3], True, g) == 5
    assert accept(p, q, [2, 4, 1], True, g) == 1
    assert resample(p[1], q[1], True, g) == 3
    assert accept(p, q, [0, 3, 1], True, g) == 0


def test_rejection_sampling_residual_and_acceptance_rates():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    # draft always proposes 1: accepted with prob p/q = 0.5
    hits = sum(accept(p, q, [1], False, g) for _ in range(4000))
    assert abs(hits / 4000 - 0.5) < 0.03
    # on rejection the residual max(0, p - q) puts all mass on token 0
    assert all(resample(p[0], q[0], False, g) == 0 for _ in range(200))
    # a draft token the draft could not have produced (q = 0) is rejected
    assert accept(p, torch.tensor([[1.0, 0.0, 0.0]]), [1], False, g) == 0


@pytest.mark.parametrize("scheduled", [False, True])
def test_sampled_speculative_output_follows_the_target_distribution(tmp_path, scheduled):
    """Chi-square of (token 2, token 3) vs the exact target distribution (vocab 8).

    Token 1 comes from the prefill; tokens 2 and 3 are drafted (2 drafts per step with
    max_tokens 4), so their joint law is what speculative sampling must preserve. With
    confidence scheduling the verified length varies (0, 1 or 2 drafts) from request to
    request and step to step: the law must not change.
    """
    vocab = 8
    target_dir = write_tiny_target(tmp_path / "t", vocab=vocab, layers=2, seed=5, sharpen=1.0)
    model = LlamaForCausalLM.from_source(WeightSource(target_dir))
    draft_dir = make_random_draft(
        tmp_path / "d", target_dir, block_size=4, markov_rank=4, scale=0.5
    )
    draft = load_draft(draft_dir, target_dir, 3, top_k=4)
    prompt = [1, 2, 3]
    temp = 1.3
    tgt = TorchTarget(model, 4096, 8)

    def next_probs(ids):
        s = tgt.new_sequence()
        lg = tgt.forward([s], [torch.tensor(ids)], [[len(ids) - 1]]).logits[0][0]
        tgt.free(s)
        return torch.softmax(lg / temp, -1)

    exact = torch.zeros(vocab, vocab)  # marginal law of (t2, t3)
    p1 = next_probs(prompt)
    for t1 in range(vocab):
        p2 = next_probs(prompt + [t1])
        for t2 in range(vocab):
            exact[t2] += p1[t1] * p2[t2] * next_probs(prompt + [t1, t2])
    n = 1500
    counts = torch.zeros(vocab, vocab)
    params = [
        SamplingParams(max_tokens=4, temperature=temp, seed=1000 + i, ignore_eos=True)
        for i in range(n)
    ]
    target = TorchTarget(model, max_kv_rows=8192, page_size=8)
    sch = None
    if scheduled:
        from edgebuild.runtime.spec_schedule import ConfidenceScheduler, StepCosts

        widths = (1, 2, 3, 4)  # verify rows cost more and more: lengths 0..2 all pay somewhere
        verify = [[0.01 * b * (1 + 0.05 * (w - 1) ** 2) for w in widths] for b in (1, 64)]
        costs = StepCosts((1, 64), widths, verify, [0.0, 0.0], [[0.0, 0.001, 0.001, 0.001]] * 2)
        costs.observe = lambda *a: None  # no wall-clock noise in the choice
        sch = ConfidenceScheduler(costs, 3)
        # raw confidences decide (no calibration drift): the lengths follow each proposal
        sch.calibrated = lambda c: torch.cumprod(c.float(), 0).tolist()
        sch.predicted_profile = lambda r: [0.9, 0.8, 0.7]
    dec = DSparkDecoder(target, draft, 3, scheduler=sch)
    accepted = 0
    for chunk in range(0, n, 50):
        states = [RequestState.create(f"r{i}", prompt, params[i]) for i in range(chunk, chunk + 50)]
        run_to_completion(dec, states)
        for st in states:
            counts[st.output_ids[1], st.output_ids[2]] += 1
            accepted += st.metrics.accepted_at[0] if st.metrics.accepted_at else 0
    expected = exact.flatten() * n
    keep = expected >= 5  # chi-square validity; pool the rest
    obs = torch.cat([counts.flatten()[keep], counts.flatten()[~keep].sum().reshape(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().reshape(1)])
    chi2 = float(((obs - exp) ** 2 / exp.clamp_min(1e-9)).sum())
    dof = int(keep.sum())
    # threshold: chi-square 0.999 quantile (Wilson-Hilferty approximation)
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, (chi2, limit, dof)
    # and the drafts were actually used (some accepted, some rejected)
    assert 0.05 * n < accepted < 0.95 * n
    if scheduled:  # and the scheduler really varied the verified lengths
        assert sch.stats.chosen[1] > 0 and sch.stats.chosen[2] > 0, sch.stats


# ---------------------------------------------------------------------- config errors
def _spec(draft_dir, **kw):
    d = {"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": 3}
    d.update(kw)
    return d


def test_bad_speculative_configs_fail_before_any_model_runs(tiny, tmp_path):
    target_dir, _ = tiny
    src = WeightSource(target_dir)
    good = make_random_draft(tmp_path / "good", target_dir, block_size=7)
    with pytest.raises(ConfigError, match="supported: dspark"):
        SpeculativeConfig.parse(_spec(good, method="medusa"))
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SpeculativeConfig.parse(_spec(good, num_speculative_tokens=0))
    with pytest.raises(ConfigError, match="block_size 7"):
        prepare_draft(SpeculativeConfig.parse(_spec(good, num_speculative_tokens=8)), src)
    cases = {
        "hidden": ({"hidden_size": 32}, PairingError, "hidden_size"),
        "vocab": ({"vocab_size": 50}, PairingError, "vocab_size"),
        "mask": ({"dflash_config.mask_token_id": 96}, ConfigError, "mask_token_id"),
        "empty-taps": ({"dflash_config.target_layer_ids": []}, ConfigError, "target_layer_ids"),
        "unsorted": ({"dflash_config.target_layer_ids": [2, 1]}, ConfigError, "target_layer_ids"),
        "negative": ({"dflash_config.target_layer_ids": [-2, 1]}, ConfigError, "target_layer_ids"),
        "beyond": ({"dflash_config.target_layer_ids": [1, 9]}, PairingError, "target_layer_ids"),
        "head": ({"dflash_config.markov_head_type": "mlp"}, ConfigError, "markov_head_type"),
    }
    for name, (override, exc, text) in cases.items():
        bad = make_random_draft(tmp_path / name, target_dir, block_size=7, overrides=override)
        with pytest.raises(exc, match=text):
            prepare_draft(SpeculativeConfig.parse(_spec(bad)), src)


def test_draft_top_k_defaults_to_the_drafts_markov_topk(tiny, tmp_path):
    """vLLM's hf_config ``markov_topk`` (top level or in dflash_config) sets the default."""
    target_dir, _ = tiny
    plain = make_random_draft(tmp_path / "plain", target_dir, block_size=7)
    assert SpeculativeConfig.parse(_spec(plain)).draft_top_k == 16
    top = make_random_draft(
        tmp_path / "top", target_dir, block_size=7, overrides={"markov_topk": 5}
    )
    nested = make_random_draft(
        tmp_path / "nested", target_dir, block_size=7, overrides={"dflash_config.markov_topk": 0}
    )
    assert SpeculativeConfig.parse(_spec(top)).draft_top_k == 5
    assert SpeculativeConfig.parse(_spec(nested)).draft_top_k == 0
    assert SpeculativeConfig.parse(_spec(top, draft_top_k=3)).draft_top_k == 3  # explicit wins
    for value in (-1, "16", True):
        bad = make_random_draft(
            tmp_path / f"bad{value}", target_dir, block_size=7, overrides={"markov_topk": value}
        )
        with pytest.raises(ConfigError, match=r"config.json: field 'markov_topk'"):
            SpeculativeConfig.parse(_spec(bad))
