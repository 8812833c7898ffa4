"""Load-aware confidence scheduling: the choice is Algorithm 1's optimum, costs and
calibration are learnt, and scheduled DSpark stays lossless.

Oracles: brute force over every length vector (the choice), a fake clock (profiling), a
synthetic acceptance process (calibration), the target-only decoder (greedy, tiny model and
real SmolLM2 bf16) and the exact target distribution (sampling, in test_dspark_decoding.py).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import httpx
import pytest
import torch
from dspark_fixtures import make_random_draft
from test_dspark_decoding import load_draft, prompts_of, target_only, tiny  # noqa: F401

from edgebuild.errors import ConfigError
from edgebuild.runtime import spec_schedule
from edgebuild.runtime.decoding import DSparkDecoder, RequestState, run_to_completion
from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.runtime.spec_schedule import ConfidenceScheduler, StepCosts, profile_step_costs
from edgebuild.runtime.torch_backend import TorchTarget
from edgebuild.speculative.config import SpeculativeConfig

DRAFT = Path(__file__).resolve().parent.parent / "edgebuild" / "data" / "smollm2-135m-dspark"


def rows_only_costs(per_row: float, base: float, draft: float) -> StepCosts:
    """A cost model linear in the total rows of a pass (no ragged or draft-width term)."""
    batches, widths = (1, 2, 4, 8), (1, 2, 4, 8)
    verify = [[base + per_row * b * w for w in widths] for b in batches]
    drafts = [[0.0] + [draft] * (len(widths) - 1) for _ in batches]
    return StepCosts(batches, widths, verify, [0.0] * len(batches), drafts)


def rate(sch: ConfidenceScheduler, profiles, lengths, draft_rows=None) -> float:
    choice = sch._evaluate(list(lengths), len(lengths) + sum(
        sum(p[:k]) for p, k in zip(profiles, lengths, strict=True)
    ), draft_rows)  # fmt: skip
    return choice.expected_tokens / choice.predicted_s


@pytest.mark.parametrize("seed", range(6))
def test_choice_is_the_brute_force_optimum_when_cost_depends_on_rows_only(seed):
    g = torch.Generator().manual_seed(seed)
    n, batch = 3, 3
    sch = ConfidenceScheduler(rows_only_costs(0.004 + 0.004 * seed, 0.05, 0.0), n)
    profiles = [torch.cumprod(torch.rand(n, generator=g), 0).tolist() for _ in range(batch)]
    budgets = [n, 2, n]
    # post-draft (draft cost sunk, draft_rows fixed): no margin, cost = rows only
    got = sch.choose(profiles, budgets, draft_rows=n)
    best = max(
        rate(sch, profiles, ls, n) for ls in itertools.product(*[range(b + 1) for b in budgets])
    )
    assert rate(sch, profiles, got.lengths, n) == pytest.approx(best, rel=1e-12)
    assert all(k <= b for k, b in zip(got.lengths, budgets, strict=True))


def test_heavy_load_skips_the_draft_and_light_load_verifies_everything():
    n = 7
    sure = [[0.95**k for k in range(1, n + 1)]] * 4
    cheap = ConfidenceScheduler(rows_only_costs(1e-5, 0.05, 1e-4), n)
    assert cheap.choose(sure, [n] * 4).lengths == [n] * 4
    # every verify row costs as much as a decode step: drafting can only lose
    dear = ConfidenceScheduler(rows_only_costs(0.05, 0.0, 0.01), n)
    assert dear.choose(sure, [n] * 4).lengths == [0] * 4
    plan = dear.plan(["a", "b", "c", "d"], [n] * 4)
    assert plan.lengths == [0] * 4 and dear.stats.skipped_drafts == 1
    # budgets bound the choice (a request at its last token verifies nothing)
    assert cheap.choose(sure, [n, 0, 2, n]).lengths == [n, 0, 2, n]


def test_low_confidence_positions_are_cut_first():
    n = 4
    costs = rows_only_costs(0.01, 0.05, 0.0)
    sch = ConfidenceScheduler(costs, n)
    profiles = [[0.99, 0.98, 0.97, 0.96], [0.3, 0.05, 0.01, 0.001]]
    got = sch.choose(profiles, [n, n], draft_rows=n)
    assert got.lengths[0] > got.lengths[1]


def test_calibration_learns_a_miscalibrated_confidence_head():
    sch = ConfidenceScheduler(rows_only_costs(0.001, 0.05, 0.0), 3)
    g = torch.Generator().manual_seed(0)
    conf = torch.tensor([0.9, 0.9, 0.9])  # the head claims 0.9 per position
    for _ in range(3000):  # really: position 1 accepted 30% of the time, then 50%
        a = 0
        while a < 3 and float(torch.rand((), generator=g)) < (0.3 if a == 0 else 0.5):
            a += 1
        sch.record("r", conf, 3, a)
    p = sch.calibrated(conf)
    assert p[0] == pytest.approx(0.3, abs=0.05)
    assert p[1] == pytest.approx(0.15, abs=0.04)
    assert sch.stats.chosen[3] == 3000
    assert sch.stats.predicted_accepted > 0 and sch.stats.realised_accepted > 0


def test_online_correction_follows_measured_steps():
    costs = rows_only_costs(0.001, 0.05, 0.01)
    before = costs.step_s([2, 2], 1)
    for _ in range(200):
        costs.observe([2, 2], 1, 2 * before)  # the machine got twice as slow
    assert costs.spec_scale == pytest.approx(2.0, rel=0.01)
    assert costs.decode_scale == 1.0  # draft-less steps keep their own correction


def test_a_load_seen_by_draft_less_steps_moves_the_drafting_cost_alike():
    """Draft-less steps slower than profiled (a busy host) while no drafting step runs: once
    drafting is stale (STALE_DRAFTING steps) both corrections follow the load, so the
    drafting steps' relative cost (and the choice) stops moving; before, spec_scale stayed
    where it was and drafting looked ever cheaper."""
    costs = rows_only_costs(0.001, 0.05, 0.01)
    for _ in range(3):
        costs.observe([1], 1, 1.5 * costs.step_s([2], 1))  # drafting: 1.5x its own profile
    rel = costs.spec_scale / costs.decode_scale
    decode = costs.verify_s([1])
    for _ in range(spec_schedule.STALE_DRAFTING):  # drafting was recent: no carry yet
        costs.observe([1], 0, 2 * decode)
    assert costs.spec_scale / costs.decode_scale < 0.8 * rel
    for _ in range(300):
        costs.observe([1], 0, 2 * decode)
    assert costs.decode_scale == pytest.approx(2.0, rel=0.01)
    # from the stale point on, the ratio is kept (and the load is carried)
    assert costs.spec_scale / costs.decode_scale == pytest.approx(rel * 0.65, rel=0.2)
    frozen = costs.spec_scale / costs.decode_scale
    for _ in range(50):
        costs.observe([1], 0, 3 * decode)
    assert costs.spec_scale / costs.decode_scale == pytest.approx(frozen, rel=1e-9)
    assert costs.decode_scale > 2.5  # the load rose again: spec_scale rose alike
    # the choice is the one of a quiet host with that ratio
    sch = ConfidenceScheduler(costs, 3)
    quiet = ConfidenceScheduler(rows_only_costs(0.001, 0.05, 0.01), 3)
    quiet.costs.spec_scale = frozen
    for p in (0.02, 0.1, 0.5, 0.9):
        assert sch.choose([[p, p * p]], [2]).lengths == quiet.choose([[p, p * p]], [2]).lengths


def test_profile_fills_the_grid_from_the_passes(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(spec_schedule.time, "perf_counter", lambda: clock[0])

    def verify(rows):  # 10 ms + 1 ms per row + 2 ms per row level beyond the mean
        mean = sum(rows) / len(rows)
        clock[0] += 0.010 + 0.001 * sum(rows) + 0.002 * (max(rows) - mean)

    def draft(batch, drafted):
        clock[0] += 0.004 + 0.0005 * batch * drafted

    costs = profile_step_costs(verify, draft, max_batch=4, num_speculative_tokens=3, repeats=1)
    assert costs.batch_sizes == (1, 2, 4) and costs.widths == (1, 2, 3, 4)
    assert costs.verify_s([3, 3]) == pytest.approx(0.010 + 0.006)
    assert costs.draft_s(4, 2) == pytest.approx(0.004 + 0.004)
    assert costs.ragged[2] == pytest.approx(0.002 + 0.001 / 1, rel=0.5)  # level + row cost


def test_bad_confidence_scheduling_value_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="confidence_scheduling"):
        SpeculativeConfig.parse(
            {"method": "dspark", "model": str(tmp_path), "num_speculative_tokens": 3,
             "confidence_scheduling": "yes"}
        )  # fmt: skip


# ---------------------------------------------------------------------- losslessness
def varied_costs() -> StepCosts:
    """Costs that make the scheduler verify different lengths per request and step."""
    batches, widths = (1, 2, 4, 8), (1, 2, 4, 8)
    verify = [[0.02 + 0.0005 * b * (w - 1) ** 1.5 for w in widths] for b in batches]
    drafts = [[0.0] + [0.001 * b] * (len(widths) - 1) for b in batches]
    return StepCosts(batches, widths, verify, [0.0005] * 4, drafts)


@pytest.mark.parametrize("batch_lengths", [[9], [5, 17, 2, 11]])
def test_scheduled_greedy_output_equals_target_only(tiny, tmp_path, batch_lengths):  # noqa: F811
    target_dir, model = tiny
    draft_dir = make_random_draft(tmp_path / "draft", target_dir, block_size=7, num_layers=2)
    prompts = prompts_of(batch_lengths)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = [s.output_ids for s in target_only(model, prompts, params)]
    draft = load_draft(draft_dir, target_dir, 7, top_k=8)
    target = TorchTarget(model, max_kv_rows=4096, page_size=8)
    sch = ConfidenceScheduler(varied_costs(), 7)
    sch.costs.observe = lambda *a: None  # keep the synthetic costs (no wall-clock noise)
    dec = DSparkDecoder(target, draft, 7, scheduler=sch)
    states = [RequestState.create(f"r{i}", p, params) for i, p in enumerate(prompts)]
    run_to_completion(dec, states)
    assert [s.output_ids for s in states] == ref
    # the random draft is tried (prior), then learnt useless: both kinds of step ran
    assert 0 < sch.stats.skipped_drafts < sch.stats.steps
    assert sum(sch.stats.chosen[1:]) > 0
    assert target.allocator.free_pages == target.allocator.num_pages


def test_bf16_scheduled_dspark_equals_target_only_on_smollm2(smollm2_dir):
    """The default dtype, the shipped draft, a batch of 4 with profiled costs."""
    opts = RuntimeOptions(dtype=torch.bfloat16, max_kv_rows=4096)
    spec = {"method": "dspark", "model": str(DRAFT), "num_speculative_tokens": 7,
            "confidence_scheduling": True}  # fmt: skip
    llm = LLM(smollm2_dir, spec, opts)
    sch = llm.enable_confidence_scheduling(4, repeats=1)
    ref = LLM(smollm2_dir, None, opts)
    prompts = [
        ref.encode(f"Tell me about {t}.", chat=True) for t in ("cats", "tea", "iron", "rain")
    ]
    params = SamplingParams(max_tokens=40)
    want = [s.output_ids for s in ref.generate_ids(prompts, params)]
    got = [s.output_ids for s in llm.generate_ids(prompts, params)]
    assert got == want
    assert sch.stats.steps > 0
    assert llm.target.allocator.free_pages == llm.target.allocator.num_pages


def test_server_exports_the_schedule_in_metrics(smollm2_dir):
    from serve_fixtures import serving

    spec = {"method": "dspark", "model": str(DRAFT), "num_speculative_tokens": 7,
            "confidence_scheduling": True}  # fmt: skip
    llm = LLM(smollm2_dir, spec, RuntimeOptions(max_kv_rows=4096))
    with serving(llm, max_batch_size=2) as srv:
        body = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 12,
                "temperature": 0}  # fmt: skip
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        text = httpx.get(srv.url + "/metrics").text
    assert "edgellm_spec_decode_scheduled_steps_total" in text
    assert 'edgellm_spec_decode_verify_length_total{length="0"}' in text
    assert "edgellm_spec_decode_predicted_accepted_tokens_total" in text
    assert 'edgellm_spec_decode_cost_scale{step="speculative"}' in text
    scheduled = float(
        next(ln for ln in text.splitlines() if ln.startswith("edgellm_spec_decode_scheduled_steps_total")).split()[-1]
    )  # fmt: skip
    assert scheduled >= 1


# ---------------------------------------------------------------------- batch 1 (the default)
def batch1_costs(decode_ms: float, per_row_ms: float, draft_ms: float) -> StepCosts:
    """Batch-1 costs: verify of w rows = decode + per_row * (w - 1), one draft pass."""
    widths = (1, 2, 3, 5, 8)
    verify = [[(decode_ms + per_row_ms * (w - 1)) * 1e-3 for w in widths]]
    return StepCosts((1,), widths, verify, [0.0], [[0.0] + [draft_ms * 1e-3] * 4])


BATCH1_CASES = [
    # k=0: 1/10 = .100; k=1: 1.8/17 = .106; k=2: 2.4/20 = .120; k=3: 2.8/23 = .1217;
    # k=4: 3.0/26 = .1154 -> 3
    (10.0, 3.0, 4.0, 3),
    # every verify row costs a decode: k=1: 1.8/24 = .075 < .100 -> no draft
    (10.0, 10.0, 4.0, 0),
    # rows nearly free, draft dear: k=1 1.8/20.1 = .0896, k=4: 3.0/20.4 = .147,
    # k=5: 3.1/20.5 = .1512, k=6: 3.15/20.6 = .1529, k=7: 3.175/20.7 = .1534 -> 7
    (10.0, 0.1, 10.0, 7),
    # the draft pass alone costs a decode: k=2: 2.4/(10+12) = .109; k=3: 2.8/23 = .1217;
    # k=4: 3.0/(10+14) = .125; k=5: 3.1/25 = .124 -> 4
    (10.0, 1.0, 10.0, 4),
]
PROFILE = [0.8, 0.6, 0.4, 0.2, 0.1, 0.05, 0.025]


@pytest.mark.parametrize(("decode_ms", "per_row_ms", "draft_ms", "want"), BATCH1_CASES)
def test_batch1_choice_matches_hand_computed_rate(decode_ms, per_row_ms, draft_ms, want):
    """At batch 1 (no margin) the plan verifies the k of the highest (1 + sum_{i<k} P_i) /
    (draft + verify(k + 1)) seconds, k = 0 meaning a plain decode step without a draft."""
    sch = ConfidenceScheduler(batch1_costs(decode_ms, per_row_ms, draft_ms), 7)
    sch.mean_profile = list(PROFILE)
    assert sch.plan(["r"], [7]).lengths == [want]
    assert sch.stats.skipped_drafts == (1 if want == 0 else 0)


@pytest.mark.parametrize(("decode_ms", "per_row_ms", "draft_ms", "want"), BATCH1_CASES)
def test_a_pinned_request_chooses_by_the_reference_costs_not_the_measured_ones(
    decode_ms, per_row_ms, draft_ms, want
):
    """The same hand-computed choice from the reference table, whatever the measured costs
    say (here: every row free, so the batch's own plan would verify all 7); after the draft
    pass, the confidences this proposal reports (profile [.8 .6 .4 ...] again) keep it.
    (Were the draft pass run anyway in the no-draft case, its 4 ms are paid: k=1 1.8/24 =
    .075 beats k=0 1/14 = .071.)"""
    ref = batch1_costs(decode_ms, per_row_ms, draft_ms)
    sch = ConfidenceScheduler(batch1_costs(10.0, 0.0, 0.0), 7, reference=ref)
    sch.mean_profile = list(PROFILE)
    assert sch.plan(["free"], [7]).lengths == [7]
    sch.pinned["p"] = ConfidenceScheduler(ref, 7)
    sch.pinned["p"].mean_profile = list(PROFILE)
    assert sch.plan_pinned("p", 7) == want
    conf = torch.tensor([PROFILE[0]] + [PROFILE[i] / PROFILE[i - 1] for i in range(1, 7)])
    assert sch.choose_pinned("p", conf) == (want or 1)
    sch.forget("p")
    assert "p" not in sch.pinned


def test_without_reference_costs_a_pinned_request_verifies_every_draft():
    sch = ConfidenceScheduler(batch1_costs(10.0, 10.0, 4.0), 7)  # drafting loses
    assert sch.plan(["free"], [7]).lengths == [0]
    assert sch.plan_pinned("p", 7) == 7 and sch.plan_pinned("p", 3) == 3
    assert sch.choose_pinned("p", torch.full((5,), 0.01)) == 5


def test_the_shipped_reference_table_covers_the_cpu_modes_and_bad_entries_are_named(tmp_path):
    for dtype, quant in [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "int4")]:
        ref = spec_schedule.reference_step_costs("torch", dtype, quant)
        assert ref is not None and ref.widths[0] == 1
        assert ref.verify[0][0] == pytest.approx(1.0)  # in decode passes
        assert ref.verify[0] == sorted(ref.verify[0]) and ref.draft[0][0] == 0.0
    assert spec_schedule.reference_step_costs("tensorrt", torch.float16, None) is None
    bad = tmp_path / "costs.json"
    bad.write_text('{"entries": {"torch/float32": {"widths": [1, 2], "verify": [1.0]}}}')
    with pytest.raises(ValueError, match="torch/float32"):
        spec_schedule.reference_step_costs("torch", torch.float32, None, path=bad)


def test_speculative_config_schedules_by_default_and_false_forces_fixed_lengths(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    base = {"method": "dspark", "model": str(tmp_path), "num_speculative_tokens": 3}
    assert SpeculativeConfig.parse(base).confidence_scheduling is True
    off = SpeculativeConfig.parse({**base, "confidence_scheduling": False})
    assert off.confidence_scheduling is False


# ---------------------------------------------------------------------- seeded reproducibility
SEEDED = SamplingParams(max_tokens=40, temperature=0.9, seed=11, ignore_eos=True)


def run_scheduled(model, draft, prompts, params, costs, reference=None):
    """DSpark over `prompts` (params[i] each): scheduled on fixed synthetic `costs` (and
    `reference`), or with fixed lengths when `costs` is None."""
    target = TorchTarget(model, max_kv_rows=4096, page_size=8)
    sch = None
    if costs is not None:
        sch = ConfidenceScheduler(costs, 7, reference=reference)
        sch.costs.observe = lambda *a: None  # no wall-clock noise in the test
    dec = DSparkDecoder(target, draft, 7, scheduler=sch)
    states = [
        RequestState.create(f"r{i}", p, sp)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    run_to_completion(dec, states)
    assert target.allocator.free_pages == target.allocator.num_pages
    return states


def test_a_seeded_sampled_request_is_reproducible_whatever_the_costs_and_the_batch(
    tiny,  # noqa: F811
    tmp_path,
):
    """Measured costs that make the batch verify everything, or nothing, and greedy
    companions that come and go: the seeded request's text is the same as alone; its own
    drafts are still verified (by the reference costs), and the greedy companions equal
    target-only."""
    target_dir, model = tiny
    draft_dir = make_random_draft(tmp_path / "draft", target_dir, block_size=7, num_layers=2)
    draft = load_draft(draft_dir, target_dir, 7, top_k=8)
    ref = batch1_costs(10.0, 0.5, 2.0)  # drafting a few pays for a confident proposal
    prompts = prompts_of([7, 12, 3, 9])
    greedy = SamplingParams(max_tokens=25, ignore_eos=True)
    alone = run_scheduled(model, draft, prompts[:1], [SEEDED], varied_costs(), ref)
    cheap = rows_only_costs(1e-6, 0.05, 1e-6)  # verifying everything is free
    dear = rows_only_costs(0.05, 0.0, 0.01)  # every row costs a decode: never draft
    want = [s.output_ids for s in target_only(model, prompts[1:], greedy)]
    for costs in (cheap, dear):
        states = run_scheduled(model, draft, prompts, [SEEDED] + [greedy] * 3, costs, ref)
        assert states[0].output_ids == alone[0].output_ids
        assert [s.output_ids for s in states[1:]] == want
        assert sum(states[0].metrics.proposed_at) > 0  # the pinned request drafted
    assert sum(states[1].metrics.proposed_at) == 0  # under `dear` the greedy ones never did
    # the reference steered it: without one the same request verifies every draft
    every = run_scheduled(model, draft, prompts[:1], [SEEDED], varied_costs(), None)
    assert sum(every[0].metrics.proposed_at) > sum(alone[0].metrics.proposed_at)


def test_a_pinned_request_without_reference_costs_equals_fixed_lengths(tiny, tmp_path):  # noqa: F811
    """No reference table (TensorRT, onnxruntime): a seeded request drafts and verifies n
    every step, token for token the output of `"confidence_scheduling": false`."""
    target_dir, model = tiny
    draft_dir = make_random_draft(tmp_path / "draft", target_dir, block_size=7, num_layers=2)
    draft = load_draft(draft_dir, target_dir, 7, top_k=8)
    prompts = prompts_of([6, 10])
    params = [
        SamplingParams(max_tokens=30, temperature=t, seed=5 + i) for i, t in enumerate((3, 9))
    ]
    fixed = run_scheduled(model, draft, prompts, params, None)
    sched = run_scheduled(model, draft, prompts, params, rows_only_costs(0.05, 0.0, 0.01))
    assert [s.output_ids for s in sched] == [s.output_ids for s in fixed]
    # the test can tell: other lengths (a reference on which drafting loses) give other text
    never = run_scheduled(
        model, draft, prompts, params, rows_only_costs(0.05, 0.0, 0.01), batch1_costs(1, 1, 1)
    )
    assert sum(never[0].metrics.proposed_at) == 0
    assert [s.output_ids for s in never] != [s.output_ids for s in fixed]


def test_a_request_asking_for_logprobs_is_pinned_too(tiny, tmp_path):  # noqa: F811
    """Greedy, but its logprobs' last bits follow the verify width in fp32: under costs on
    which the batch never drafts it still verifies what the reference says, and its
    logprobs equal a run alone under other costs bit for bit."""
    target_dir, model = tiny
    draft_dir = make_random_draft(tmp_path / "draft", target_dir, block_size=7, num_layers=2)
    draft = load_draft(draft_dir, target_dir, 7, top_k=8)
    ref = batch1_costs(10.0, 0.5, 2.0)
    prompts = prompts_of([8, 5])
    lp = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2)
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    dear = rows_only_costs(0.05, 0.0, 0.01)
    both = run_scheduled(model, draft, prompts, [lp, greedy], dear, ref)
    alone = run_scheduled(model, draft, prompts[:1], [lp], varied_costs(), ref)
    assert sum(both[0].metrics.proposed_at) > 0 and sum(both[1].metrics.proposed_at) == 0
    got = [(e.token_id, e.logprob) for e in both[0].logprobs]
    assert got == [(e.token_id, e.logprob) for e in alone[0].logprobs]


def test_drafting_stopped_by_its_measured_correction_is_probed_again():
    """Drafting steps measured above their profile (a burst of load, a host hiccup) lift
    spec_scale past break-even and drafting stops; draft-less steps cannot lower it. After
    PROBE_AFTER of them a lone request probes: the correction is forgotten, the probe's own
    step (the draft context's catch-up) is not measured, and drafting resumes while the steps
    measure at their profile. A scheduler whose profiled costs say drafting loses, or a batch
    of two, never probes."""
    n = 2
    costs = rows_only_costs(0.02, 0.05, 0.02)  # a 2-draft step pays by ~30% on its profile
    sch = ConfidenceScheduler(costs, n)
    sch.mean_profile = [0.8, 0.64]
    assert max(sch.plan(["r"], [n]).lengths) > 0
    costs.spec_scale = 1.4  # what a few slowed drafting steps leave
    decode = costs.verify_s([1])
    tried = []
    for i in range(3 * spec_schedule.PROBE_AFTER):
        plan = sch.plan(["r"], [n])
        k = max(plan.lengths)
        tried.append(k)
        if k == 0:
            costs.observe([1], 0, decode)  # a draft-less step at its profile
        else:  # a drafting step at its profile; the first (the probe) 10x: the catch-up
            at = costs.step_s([1 + k], k) / costs.spec_scale
            costs.observe([1 + k], k, at * (10 if i == spec_schedule.PROBE_AFTER else 1))
    first = next(i for i, k in enumerate(tried) if k > 0)
    assert first == spec_schedule.PROBE_AFTER  # draft-less steps until the probe
    assert sch.stats.probes == 1
    assert costs.spec_scale == pytest.approx(1.0)  # forgotten; the probe's step not counted
    assert all(k > 0 for k in tried[first:])  # drafting resumed for good
    # drafting that loses on the profile itself (every verify row as dear as a decode)
    dear = ConfidenceScheduler(rows_only_costs(0.05, 0.0, 0.01), n)
    dear.mean_profile = [0.8, 0.64]
    dear.costs.spec_scale = 2.0
    for _ in range(3 * spec_schedule.PROBE_AFTER):
        assert dear.plan(["r"], [n]).lengths == [0]
        dear.costs.observe([1], 0, dear.costs.verify_s([1]))
    assert dear.stats.probes == 0 and dear.costs.spec_scale > 1.9
    two = ConfidenceScheduler(rows_only_costs(0.02, 0.05, 0.02), n)
    two.mean_profile = [0.8, 0.64]
    two.costs.spec_scale = 3.0
    for _ in range(3 * spec_schedule.PROBE_AFTER):
        two.plan(["a", "b"], [n, n])
        two.costs.observe([1, 1], 0, two.costs.verify_s([1, 1]))
    assert two.stats.probes == 0
    # one request beside a pinned one (plan sees one id, the step runs two): no probe either
    beside = ConfidenceScheduler(rows_only_costs(0.02, 0.05, 0.02), n)
    beside.mean_profile = [0.8, 0.64]
    beside.costs.spec_scale = 1.4
    for _ in range(3 * spec_schedule.PROBE_AFTER):
        assert beside.plan(["r"], [n], batch=2).lengths == [0]
        beside.costs.observe([1, 1], 0, beside.costs.verify_s([1, 1]))
    assert beside.stats.probes == 0
    # a probe's zero weight is dropped by the next plan when its step never got measured
    sch.costs.next_spec_weight = 0.0
    sch.plan(["r"], [n])
    assert sch.costs.next_spec_weight is None
