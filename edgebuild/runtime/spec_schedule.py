"""Load-aware confidence scheduling of DSpark verification (DSpark paper, Algorithm 1).

Fixed-length speculation verifies ``n`` drafts of every request each step. Under load that
costs more than it returns: a verify row is cheap only while the pass is bound by reading the
weights, and on a CPU (or a small accelerator) a batch of 16 requests x 8 rows is compute
bound. The scheduler instead decides, every step, how many drafts of each request to verify:

1. **Rank.** Draft position k of request b is accepted (together with every position before
   it) with probability ``P[b, k] = f_k * prod_{i<=k} c[b, i]``: the cumulative product of the
   draft's confidence head ``c``, times a per-position calibration ``f_k`` learnt online from
   what verification realises (so a miscalibrated head, or a draft without one, still gets
   sensible numbers). The expected tokens a step commits are ``B + sum of the chosen P``.
2. **Cost.** :class:`StepCosts` predicts the seconds of a verify pass from the batch size and
   the rows per sequence, and of a draft pass from the batch size and the drafted rows:
   profiled on this backend at start-up (:func:`profile_step_costs`) and corrected online by
   the ratio of measured to predicted time (which also follows the machine's load).
3. **Choose.** Positions are taken in order of decreasing ``P`` (per request this is its
   prefix order, P being a cumulative product) and the prefix that maximises
   ``expected tokens / predicted step seconds`` wins. Before the draft pass the same choice
   runs on *predicted* confidences (each request's last profile, else the running mean): when
   verifying nothing wins, the step skips the draft and runs a plain decode pass (the draft
   context catches up later), so under heavy load DSpark costs what target-only costs.
   With several requests the draft pass must promise a margin (:func:`draft_margin`). A lone
   request whose drafting stopped on the measured correction alone drafts again after
   :data:`PROBE_AFTER` draft-less steps (:meth:`ConfidenceScheduler._probe`).

Lossless: the lengths depend only on the draft's own outputs, the cost model and past steps,
never on this step's target output, so acceptance stays the exact rule of
:mod:`edgebuild.runtime.rejection` on a (shorter) prefix of the proposal.

**Seeded sampled requests are pinned.** Greedy output is the same for any lengths, but a
sampled request's random draws follow its lengths, so lengths chosen from wall-clock costs
(or from other requests' history) would make a seeded request's text change from run to run;
and where the kernels are not row-invariant (fp32) a logprob's last bits follow the width of
the verify pass. A pinned request (sampled with a seed, or asking for logprobs) therefore
gets its own scheduler over the
*reference* costs of this backend, dtype and quant mode (:func:`reference_step_costs`, a
table that ``bench/step_costs.py`` measured and wrote into ``edgebuild/data/step_costs.json``),
which never observes a clock and learns only from that request's own steps: its lengths are a
function of its seed, prompt and the draft's outputs alone, whatever the load or the batch.
Where no reference exists (TensorRT, onnxruntime) a pinned request verifies every draft, as
with ``"confidence_scheduling": false``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger("edgebuild.runtime")

CALIBRATION_PRIOR = 4.0  # pseudo-observations behind the initial calibration factor 1.0
CALIBRATION_DECAY = 0.999  # per observation: old steps fade (drafts drift with the text)
COST_EMA = 0.05  # weight of one measured step in the online cost correction
STALE_DRAFTING = 20  # draft-less steps in a row after which the load is carried to drafting
INITIAL_PROFILE = 0.6  # prior per-position acceptance before any step was observed
PROFILE_EMA = 0.1  # weight of one request's step in the running mean profile
STALE_DRIFT = 0.2  # per skipped step, a request's profile moves this far to the mean
PROBE_AFTER = 64  # draft-less steps in a row after which a lone request drafts again (_probe)
DRAFT_MARGIN = 0.3  # with B requests a draft pass must promise 30% * (1 - 1/B) more tokens/s
# than a plain decode step. Drafting desynchronises the requests of a batch (they finish, and
# their clients' next requests arrive, at different steps, so more steps run part-empty), a
# cost no single step sees; measured with bench/serve_load.py at 4 clients: without a margin
# scheduled DSpark was 8% below target-only, 4% below with 20%. One request alone pays nothing.


def draft_margin(batch: int) -> float:
    """Relative gain a draft pass must promise over a plain decode step (DRAFT_MARGIN)."""
    return DRAFT_MARGIN * (1.0 - 1.0 / max(batch, 1))


@dataclass
class StepCosts:
    """Seconds of a verify (target) pass and of a draft pass, by batch size and width.

    Attributes:
        batch_sizes: ascending batch sizes B of the grid (the first is 1).
        widths: ascending rows per sequence S of a verify pass (1 = plain decode).
        verify: seconds [len(batch_sizes)][len(widths)] of a target pass with B sequences of
            S new rows each.
        ragged: seconds [len(batch_sizes)] per extra row *level*: a pass whose longest
            sequence has S_max rows but whose mean is lower costs the mean-width pass plus
            ``ragged * (S_max - mean)`` (the decode attention runs once per row index).
        draft: seconds [len(batch_sizes)][len(widths)] of a draft pass over B sequences that
            drafts S - 1 rows each (column 0, S = 1, is unused: no draft pass).
    """

    batch_sizes: tuple[int, ...]
    widths: tuple[int, ...]
    verify: list[list[float]]
    ragged: list[float]
    draft: list[list[float]]
    decode_scale: float = 1.0  # online correction of a draft-less step: measured / profiled
    spec_scale: float = 1.0  # ... of a drafting step (draft + verify + the decoder's own work)
    draftless_run: int = 0  # draft-less steps observed since the last drafting step
    next_spec_weight: float | None = None  # the next drafting step's EMA weight (a probe's)
    # _grid's values by (table, batch, width): the tables are not changed after construction
    # (only the scales do), and a step asks for the same few points (~30 interpolations a
    # step, ~2% of an int4 SmolLM2 token)
    _grid_memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if (
            not self.batch_sizes
            or self.batch_sizes[0] != 1
            or list(self.batch_sizes) != sorted(set(self.batch_sizes))
        ):
            raise ValueError(f"batch_sizes must ascend from 1, got {self.batch_sizes}")
        if not self.widths or self.widths[0] != 1 or list(self.widths) != sorted(set(self.widths)):
            raise ValueError(f"widths must ascend from 1, got {self.widths}")
        shape = (len(self.batch_sizes), len(self.widths))
        for name in ("verify", "draft"):
            table = getattr(self, name)
            if len(table) != shape[0] or any(len(r) != shape[1] for r in table):
                raise ValueError(f"{name} must be {shape[0]} x {shape[1]}")
        if len(self.ragged) != shape[0]:
            raise ValueError(f"ragged must have {shape[0]} entries")

    # ------------------------------------------------------------------ interpolation
    @staticmethod
    def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
        """Piecewise-linear through (xs, ys), extrapolated linearly past the last point."""
        if len(xs) == 1:
            return ys[0] * x / xs[0]
        for i in range(1, len(xs)):
            if x <= xs[i] or i == len(xs) - 1:
                x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        raise AssertionError("unreachable")

    def _grid(self, name: str, batch: int, width: float) -> float:
        """Table ``name`` (verify / draft) at (batch, width), interpolated."""
        key = (name, batch, width)
        got = self._grid_memo.get(key)
        if got is None:
            per_b = [self._interp(self.widths, row, width) for row in getattr(self, name)]
            got = self._grid_memo[key] = max(0.0, self._interp(self.batch_sizes, per_b, batch))
        return got

    def verify_s(self, rows: Sequence[int]) -> float:
        """Profiled seconds of one target pass with ``rows[b]`` new rows for sequence b."""
        batch = len(rows)
        if batch == 0:
            return 0.0
        mean = sum(rows) / batch
        base = self._grid("verify", batch, mean)
        extra = self._interp(self.batch_sizes, self.ragged, batch) * (max(rows) - mean)
        return base + max(0.0, extra)

    def draft_s(self, batch: int, drafted: int) -> float:
        """Profiled seconds of one draft pass over ``batch`` sequences drafting ``drafted``
        rows each (0 when nothing is drafted: the pass is skipped)."""
        if batch == 0 or drafted <= 0:
            return 0.0
        return self._grid("draft", batch, drafted + 1)

    def step_s(self, rows: Sequence[int], drafted: int) -> float:
        """Predicted wall seconds of a whole decoder step: a plain decode pass when nothing
        is drafted, else the draft pass plus the verify pass of ``rows``; each kind scaled by
        what such steps measured (:meth:`observe`), which folds in the decoder's own work
        (sampling, bookkeeping) and the machine's current load."""
        if len(rows) == 1:  # one request (most steps on a laptop): its profiled costs memoized
            key = ("one", rows[0], drafted)
            base = self._grid_memo.get(key)
            if base is None:
                base = self._grid_memo[key] = (
                    self.verify_s([1]) if drafted <= 0
                    else self.draft_s(1, drafted) + self.verify_s(rows)
                )  # fmt: skip
            return base * (self.decode_scale if drafted <= 0 else self.spec_scale)
        if drafted <= 0:
            return self.verify_s([1] * len(rows)) * self.decode_scale
        return (self.draft_s(len(rows), drafted) + self.verify_s(rows)) * self.spec_scale

    def observe(self, rows: Sequence[int], drafted: int, measured: float) -> None:
        """Fold one measured step (as in :meth:`step_s`) into its online correction.

        Once drafting steps have become rare (none in the last ``STALE_DRAFTING`` steps), a
        draft-less step's change of ``decode_scale`` also scales ``spec_scale``: the machine's
        load moves both kinds of step alike, and a kind the scheduler no longer takes must not
        be judged on the costs of another load. Without this, draft-less steps on a busy host
        measured 1.5x their profile while the rare drafting steps' correction stayed at 1.0,
        so drafting looked 1.5x cheaper than it was, and scheduled int4 DSpark ran at x0.95 of
        target-only (bench/README.md). While drafting steps are frequent their own
        correction follows the load (carrying it too would count it twice).
        """
        attr = "decode_scale" if drafted <= 0 else "spec_scale"
        old = getattr(self, attr)
        profiled = self.step_s(rows, drafted) / old
        if profiled <= 0 or measured <= 0:
            return
        ratio = measured / profiled
        weight = COST_EMA
        if attr == "spec_scale" and self.next_spec_weight is not None:
            weight, self.next_spec_weight = self.next_spec_weight, None  # a probe's step
        new = (1 - weight) * old + weight * ratio
        setattr(self, attr, new)
        if attr == "spec_scale":
            self.draftless_run = 0
            return
        self.draftless_run += 1
        if self.draftless_run > STALE_DRAFTING:
            self.spec_scale *= new / old


REFERENCE_COSTS_FILE = Path(__file__).resolve().parent.parent / "data" / "step_costs.json"


def reference_key(backend: str, dtype: torch.dtype, quant: str | None) -> str:
    """The key of :data:`REFERENCE_COSTS_FILE` for a backend, compute dtype and quant mode
    (``"torch/bfloat16"``, ``"torch/bfloat16/int4"``)."""
    name = str(dtype).removeprefix("torch.")
    return f"{backend}/{name}" + (f"/{quant}" if quant else "")


def reference_step_costs(
    backend: str, dtype: torch.dtype, quant: str | None, path: Path = REFERENCE_COSTS_FILE
) -> StepCosts | None:
    """Batch-1 step costs of this backend, dtype and quant as measured by ``bench/step_costs.py``
    (in units of one decode pass), or None when the table has no such entry.

    The file holds ``{"entries": {key: {"widths": [1, ...], "verify": [...], "draft": [...]}}}``:
    ``verify[i]`` the seconds of a verify pass of ``widths[i]`` rows, ``draft[i]`` of a draft
    pass drafting ``widths[i] - 1`` rows (``draft[0]`` = 0), both divided by the decode pass.

    Raises:
        ValueError: an entry that is not such a table (named by its key).
    """
    entries = json.loads(path.read_text())["entries"] if path.is_file() else {}
    key = reference_key(backend, dtype, quant)
    entry = entries.get(key)
    if entry is None:
        return None
    try:
        widths = tuple(int(w) for w in entry["widths"])
        return StepCosts(
            (1,), widths, [list(map(float, entry["verify"]))], [0.0],
            [list(map(float, entry["draft"]))],
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: entry {key!r} is not a step-cost table ({exc})") from exc


def monotone(times: list[float]) -> list[float]:
    """Timings of ever wider passes made non-decreasing by the suffix minimum: interference
    from other work only adds time, so a wider pass's time bounds a narrower one's (a 2-row
    verify that took longer than a 3-row one was disturbed, and the 3-row time is kept)."""
    out = list(times)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def profile_step_costs(
    verify_pass: Callable[[list[int]], None],
    draft_pass: Callable[[int, int], None],
    max_batch: int,
    num_speculative_tokens: int,
    repeats: int = 2,
) -> StepCosts:
    """Time the backend's passes on a grid and return the :class:`StepCosts` table.

    Args:
        verify_pass: ``verify_pass(rows)`` runs one target pass with ``rows[b]`` new rows of
            sequence b (and rolls them back).
        draft_pass: ``draft_pass(batch, drafted)`` runs what a drafting step adds for each of
            ``batch`` sequences: the draft's context update (the last verify's committed
            rows) and one draft pass drafting ``drafted`` rows.
        max_batch: the largest batch the server steps (grid: powers of two up to it).
        num_speculative_tokens: n; widths 1, 2, 3, 5, n + 1 (those <= n + 1).
        repeats: timings per grid point (the fastest is kept: the least disturbed).
    """
    n = num_speculative_tokens
    batches = sorted({1, *[b for b in (2, 4, 8, 16, 32, 64) if b < max_batch], max_batch})
    widths = sorted({w for w in (1, 2, 3, 5, n + 1) if w <= n + 1})

    def best(fn) -> float:
        times = []
        for _ in range(repeats + 1):  # the first call warms up
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times[1:]) if len(times) > 1 else times[0]

    t0 = time.perf_counter()
    verify, draft, ragged = [], [], []
    for b in batches:
        verify.append(monotone([best(lambda b=b, w=w: verify_pass([w] * b)) for w in widths]))
        draft.append(
            [0.0] + monotone([best(lambda b=b, w=w: draft_pass(b, w - 1)) for w in widths[1:]])
        )
        if b > 1 and widths[-1] > 1:
            top = widths[-1]
            rows = [top] + [1] * (b - 1)
            mean = sum(rows) / b
            t = best(lambda rows=rows: verify_pass(rows))
            flat = StepCosts._interp(widths, verify[-1], mean)
            ragged.append(max(0.0, (t - flat) / (top - mean)))
        else:
            ragged.append(0.0)
    costs = StepCosts(tuple(batches), tuple(widths), verify, ragged, draft)
    log.info(
        "confidence scheduling: profiled %d x %d step costs in %.1f s (decode at B=1 %.1f ms, "
        "verify of %d rows %.1f ms)",
        len(batches), len(widths), time.perf_counter() - t0, verify[0][0] * 1e3, n + 1,
        verify[0][-1] * 1e3,
    )  # fmt: skip
    return costs


@dataclass
class Choice:
    """Verify lengths chosen for one step: ``lengths[b]`` drafts of request b (0 = none)."""

    lengths: list[int]
    expected_tokens: float  # B + sum of the chosen P
    predicted_s: float  # draft + verify seconds of the step


@dataclass
class SchedulerStats:
    """Counters the server exports (`/metrics`)."""

    steps: int = 0  # steps scheduled
    skipped_drafts: int = 0  # steps that ran no draft pass
    probes: int = 0  # drafting steps tried after a run of draft-less ones (_probe)
    chosen: list[int] = field(default_factory=list)  # [k] = request-steps verifying k drafts
    predicted_accepted: float = 0.0  # sum over request-steps of the chosen P (calibrated)
    realised_accepted: int = 0  # drafts those request-steps accepted


class ConfidenceScheduler:
    """Chooses each step's per-request verify lengths (module docstring).

    Args:
        costs: the step cost model (:func:`profile_step_costs`), corrected online.
        num_speculative_tokens: n, the most drafts one request verifies per step.
        reference: the clock-free batch-1 costs pinned requests are scheduled on
            (:func:`reference_step_costs`; module docstring); None: they verify every draft.
    """

    def __init__(
        self, costs: StepCosts, num_speculative_tokens: int, reference: StepCosts | None = None
    ):
        self.costs = costs
        self.n = num_speculative_tokens
        self.reference = reference
        self.pinned: dict[str, ConfidenceScheduler] = {}  # request id -> its own scheduler
        # calibration f_k = (realised_k + prior) / (predicted_k + prior), decayed sums
        self._real = [0.0] * self.n
        self._pred = [0.0] * self.n
        self.mean_profile = [INITIAL_PROFILE ** (k + 1) for k in range(self.n)]
        self.profiles: dict[str, list[float]] = {}  # request id -> last calibrated P
        self.stats = SchedulerStats(chosen=[0] * (self.n + 1))

    # ------------------------------------------------------------------ probabilities
    def calibrated(self, confidence: torch.Tensor) -> list[float]:
        """P[k] = min(1, f_k * prod_{i<=k} c_i) for a proposal's fp32 [m] confidences."""
        cum = torch.cumprod(confidence.float().clamp(0.0, 1.0), 0).tolist()
        return [min(1.0, self._factor(k) * c) for k, c in enumerate(cum)]

    def _factor(self, k: int) -> float:
        return (self._real[k] + CALIBRATION_PRIOR) / (self._pred[k] + CALIBRATION_PRIOR)

    def predicted_profile(self, request_id: str) -> list[float]:
        """The request's last calibrated profile, else the running mean (length n)."""
        prof = self.profiles.get(request_id)
        if prof is None:
            return list(self.mean_profile)
        return prof + self.mean_profile[len(prof) :]

    # ------------------------------------------------------------------ the choice
    def choose(
        self,
        profiles: list[list[float]],
        budgets: list[int],
        draft_rows: int | None = None,
    ) -> Choice:
        """Algorithm 1: the prefix of positions ranked by P that maximises tokens / second.

        Args:
            profiles: per request, P[k] for k = 0.. (non-increasing; cumulative products).
            budgets: per request, the most drafts it may verify (remaining budget, drafted).
            draft_rows: None before the draft pass (its cost depends on the longest choice);
                else the rows the draft pass drafted (its cost is then fixed).
        """
        batch = len(profiles)
        lengths = [0] * batch
        best = self._evaluate(lengths, float(batch), draft_rows)
        best_rate = best.expected_tokens / best.predicted_s
        gains = [prof[: budgets[b]] for b, prof in enumerate(profiles)]
        if not any(gains):
            return best
        # No drafting choice beats its cheapest version with every position's gain: skip fast
        # (before ranking: most steps of a scheduler that does not draft end here).
        total = batch + sum(sorted((p for g in gains for p in g), reverse=True))  # ranked order
        cheapest = self.costs.step_s([2] + [1] * (batch - 1), draft_rows or 1)
        if draft_rows is None:
            cheapest *= 1.0 + draft_margin(batch)
        if total / cheapest <= best_rate:
            return best
        ranked = sorted(
            ((p, b, k) for b, g in enumerate(gains) for k, p in enumerate(g)),
            key=lambda t: -t[0],
        )
        suffix = [0.0] * (len(ranked) + 1)
        for i in range(len(ranked) - 1, -1, -1):
            suffix[i] = suffix[i + 1] + ranked[i][0]
        gain = float(batch)
        for i, (p, b, k) in enumerate(ranked):
            if k != lengths[b]:  # keep prefixes (ties between equal P of one request)
                continue
            lengths[b] = k + 1
            gain += p
            cand = self._evaluate(lengths, gain, draft_rows)
            rate = cand.expected_tokens / cand.predicted_s
            if rate > best_rate:
                best, best_rate = cand, rate
            elif (gain + suffix[i + 1]) / cand.predicted_s <= best_rate:
                break  # costs only grow: even every remaining position cannot win
        return best

    def _evaluate(self, lengths: list[int], gain: float, draft_rows: int | None) -> Choice:
        drafted = max(lengths, default=0) if draft_rows is None else draft_rows
        seconds = self.costs.step_s([1 + k for k in lengths], drafted)
        if drafted > 0 and draft_rows is None:
            seconds *= 1.0 + draft_margin(len(lengths))  # draft only for a clear win
        return Choice(list(lengths), gain, max(seconds, 1e-9))

    def plan(self, request_ids: list[str], budgets: list[int], batch: int | None = None) -> Choice:
        """Before the draft pass: the lengths predicted from each request's last profile.

        ``max(lengths) == 0`` means: skip the draft pass this step. ``batch``: the requests the
        step runs, pinned ones included (default: ``len(request_ids)``); only a lone request
        probes (:meth:`_probe`).
        """
        self.costs.next_spec_weight = None  # a probe's weight is for its own step only
        profiles = [self.predicted_profile(r) for r in request_ids]
        choice = self.choose(profiles, budgets)
        self.stats.steps += 1
        if max(choice.lengths, default=0) == 0:
            alone = (len(request_ids) if batch is None else batch) == 1
            probe = self._probe(profiles, budgets) if alone else None
            if probe is not None:
                self.stats.probes += 1
                return probe
            self.stats.skipped_drafts += 1
            # A skipped request learns nothing new: let its profile drift back to the mean,
            # so that a request judged on one bad step is tried again when the load allows.
            for r in request_ids:
                prof = self.profiles.get(r)
                if prof is not None:
                    mean = self.mean_profile
                    self.profiles[r] = [p + STALE_DRIFT * (mean[k] - p) for k, p in enumerate(prof)]
        return choice

    def _probe(self, profiles: list[list[float]], budgets: list[int]) -> Choice | None:
        """Drafting tried again by a lone request after :data:`PROBE_AFTER` draft-less steps in
        a row, where only the drafting steps' online correction stands in the way (the choice
        with ``spec_scale`` at ``decode_scale``, the profiled relative cost under the current
        load, drafts; the one with the measured correction does not): the correction is
        forgotten (set to ``decode_scale``) and the drafting steps that follow measure it anew.

        Why: once that correction was above break-even (a burst of load, or a few steps the host
        slowed, lifted it), no drafting step ran to measure it again; draft-less steps carry
        the load to it but cannot lower it, and drafting stopped for good (bf16 DSpark at x1.008
        with tau 1.04 in a bench run where two other runs gave x1.14-x1.23). The probe's own
        step is not measured: it catches the draft's context up on every row since the last
        draft pass (64+ rows, several decodes' worth at once). Where drafting really does not
        pay, the steps after a probe lift the correction back within ~10 steps (COST_EMA), a
        bounded cost every PROBE_AFTER steps. Batches of several requests never probe: a
        loaded server's drafting steps can cost far more than its draft-less ones.
        None: no probe this step."""
        costs = self.costs
        if (
            len(profiles) != 1
            or costs.draftless_run < PROBE_AFTER
            or costs.spec_scale <= costs.decode_scale
        ):
            return None  # (plan() calls it only for a step that runs one request)
        measured = costs.spec_scale
        costs.spec_scale = costs.decode_scale
        choice = self.choose(profiles, budgets)
        if max(choice.lengths, default=0) == 0:
            costs.spec_scale = measured  # the profile itself says skip: nothing to forget
            return None
        costs.draftless_run = 0
        costs.next_spec_weight = 0.0  # the probe's step (the context's catch-up) is not evidence
        return choice

    # ------------------------------------------------------------------ learning
    def record(
        self,
        request_id: str,
        confidence: torch.Tensor,
        verified: int,
        accepted: int,
    ) -> None:
        """Fold one request's verified step into the calibration and profiles.

        Args:
            confidence: fp32 [m] the proposal's confidences (all drafted rows).
            verified: drafts verified (the chosen length); accepted: of those, accepted.
        """
        cum = torch.cumprod(confidence.float().clamp(0.0, 1.0), 0).tolist()
        prof = self.calibrated(confidence)
        self.stats.chosen[min(verified, self.n)] += 1
        self.stats.predicted_accepted += sum(prof[:verified])
        self.stats.realised_accepted += accepted
        for k in range(min(verified, self.n)):
            self._pred[k] = CALIBRATION_DECAY * self._pred[k] + cum[k]
            self._real[k] = CALIBRATION_DECAY * self._real[k] + (1.0 if accepted > k else 0.0)
        if prof:
            self.profiles[request_id] = prof
            for k, p in enumerate(prof[: self.n]):
                self.mean_profile[k] += PROFILE_EMA * (p - self.mean_profile[k])

    def forget(self, request_id: str) -> None:
        """Drop a finished request's profile (and its own scheduler when it was pinned)."""
        self.profiles.pop(request_id, None)
        self.pinned.pop(request_id, None)

    # ------------------------------------------------------------------ pinned requests
    def _own(self, request_id: str) -> ConfidenceScheduler | None:
        if self.reference is None:
            return None
        own = self.pinned.get(request_id)
        if own is None:  # its own copy: nothing it learns or corrects is shared
            ref = self.reference
            costs = StepCosts(ref.batch_sizes, ref.widths, ref.verify, ref.ragged, ref.draft)
            own = self.pinned[request_id] = ConfidenceScheduler(costs, self.n)
        return own

    def plan_pinned(self, request_id: str, budget: int) -> int:
        """Before the draft pass: the drafts a pinned request verifies (0 = none), chosen
        alone on the reference costs from its own past steps (module docstring)."""
        own = self._own(request_id)
        if own is None:
            return budget
        return own.plan([request_id], [budget]).lengths[0]

    def choose_pinned(self, request_id: str, confidence: torch.Tensor) -> int:
        """After the draft pass: how many of a pinned request's drafts (fp32 [m]
        confidences) to verify, on the reference costs with its m drafts' pass paid."""
        own = self._own(request_id)
        m = int(confidence.shape[0])
        if own is None or m == 0:
            return m
        return own.choose([own.calibrated(confidence)], [m], draft_rows=m).lengths[0]

    def record_pinned(self, request_id: str, confidence, verified: int, accepted: int) -> None:
        """Fold a pinned request's step into its own scheduler and into this one's stats
        and calibration (those only steer the requests that are not pinned)."""
        own = self._own(request_id)
        if own is not None:
            own.record(request_id, confidence, verified, accepted)
        self.record(request_id, confidence, verified, accepted)
