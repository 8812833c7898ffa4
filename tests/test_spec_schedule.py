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
