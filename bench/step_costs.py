"""The reference step costs pinned requests are scheduled on (``edgebuild/data/step_costs.json``).

A seeded sampled request under confidence scheduling chooses its verify lengths from a fixed
table instead of the clock (:mod:`edgebuild.runtime.spec_schedule`, "pinned"), so that its
output is the same on every run. This bench writes that table: for each compute dtype and
``--quant`` mode of the torch backend it loads the example pair (SmolLM2-135M-Instruct + the
shipped DSpark draft, 7 speculative tokens), runs the start-up profile of batch 1
(:func:`~edgebuild.runtime.spec_schedule.profile_step_costs`: verify passes of 1, 2, 3, 5 and 8
rows, draft passes drafting 1, 2, 4 and 7 rows, at a 128-row context) ``--rounds`` times,
interleaved across the configurations, and keeps the median of each grid point divided by
the median 1-row decode. Not run in CI.

    python bench/step_costs.py [--threads 1 --rounds 3 --write]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "edgebuild" / "data" / "step_costs.json"
DRAFT = ROOT / "edgebuild" / "data" / "smollm2-135m-dspark"
CONFIGS = [("float32", None), ("bfloat16", None), ("bfloat16", "int8"), ("bfloat16", "int4")]


def main() -> None:
    from edgebuild.runtime.llm import LLM, RuntimeOptions
    from edgebuild.runtime.spec_schedule import reference_key

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=ROOT / "examples" / "smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="timings per grid point per round")
    ap.add_argument("--write", action="store_true", help=f"write {OUT.relative_to(ROOT)}")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = {"method": "dspark", "model": str(DRAFT), "num_speculative_tokens": 7}
    llms = {}
    for dtype, quant in CONFIGS:
        opts = RuntimeOptions(dtype=getattr(torch, dtype), max_kv_rows=4096, quant=quant)
        llms[reference_key("torch", opts.dtype, quant)] = LLM(args.target, spec, opts)
    runs: dict[str, list] = {k: [] for k in llms}
    for r in range(args.rounds):  # interleaved: a change of load hits every config alike
        for key, llm in llms.items():
            runs[key].append(llm.enable_confidence_scheduling(1, repeats=args.repeats).costs)
        report = table(runs, args.threads)  # after every round: a cut run keeps what it has
        if args.write:
            OUT.write_text(json.dumps(report, indent=1) + "\n")
        print(f"round {r + 1}/{args.rounds} done", json.dumps(report["entries"]), flush=True)
    print(f"wrote {OUT}" if args.write else json.dumps(report, indent=1))


def table(runs: dict[str, list], threads: int) -> dict:
    """The medians of the rounds so far, in decode passes (module docstring)."""
    entries = {}
    for key, costs in runs.items():
        verify = [statistics.median(c.verify[0][i] for c in costs) for i in range(5)]
        draft = [statistics.median(c.draft[0][i] for c in costs) for i in range(5)]
        entries[key] = {
            "widths": list(costs[0].widths),
            "verify": [round(v / verify[0], 4) for v in verify],
            "draft": [round(d / verify[0], 4) for d in draft],
            "decode_ms": round(verify[0] * 1e3, 2),
        }
    return {
        "about": "batch-1 step costs in decode passes (bench/step_costs.py); verify[i]: a "
        "verify pass of widths[i] rows, draft[i]: a draft pass drafting widths[i] - 1 rows",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "model": "SmolLM2-135M-Instruct + the shipped DSpark draft, 7 speculative tokens",
        "threads": threads,
        "rounds": len(next(iter(runs.values()))),
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "entries": entries,
    }


if __name__ == "__main__":
    main()
