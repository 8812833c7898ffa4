"""Plot tau against training tokens from training runs' logs (the model card's study PNG).

Left: the teacher-forced validation tau of each run against the block rows it has trained on;
right: the last validation tau (and the runtime's tau where given) against the run's data size
(answer tokens in its training set).

    python -m tools.train_dspark.plot_study --runs data-0.1M=.cache/.../run1 ... \
        --runtime-tau data-0.1M=1.9 --out edgebuild/data/smollm2-135m-dspark/tau_vs_tokens.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_run(run: Path) -> dict:
    """Validation points ``[(rows_seen, tau)]`` and the data size of one run folder."""
    recs = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines() if x]
    vals = [(r["tokens"], r["val"]["tau"]) for r in recs if "val" in r]
    summary = (
        json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    )
    return {"val": vals, "answer_tokens": summary.get("answer_tokens")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", required=True, help="LABEL=RUN_DIR")
    ap.add_argument("--runtime-tau", nargs="*", default=[], help="LABEL=TAU (BF16 target)")
    ap.add_argument(
        "--extra-point", nargs="*", default=[], help="LABEL=TOKENS:VALTAU:RTTAU (RTTAU optional)"
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runtime = {k: float(v) for k, v in (x.split("=", 1) for x in args.runtime_tau)}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=120)
    pts = []
    for spec in args.runs:
        label, path = spec.split("=", 1)
        r = read_run(Path(path))
        if r["val"]:
            xs, ys = zip(*r["val"], strict=True)
            a1.plot([x / 1e6 for x in xs], ys, marker="o", label=label)
            pts.append((label, r["answer_tokens"], ys[-1], runtime.get(label)))
    for spec in args.extra_point:
        label, vals = spec.split("=", 1)
        tok, vt, rt = vals.split(":")  # RTTAU may be empty: no runtime measurement
        pts.append((label, int(tok), float(vt), float(rt) if rt else None))
    a1.set_xlabel("block rows trained on (millions)")
    a1.set_ylabel("validation tau (teacher-forced)")
    a1.grid(alpha=0.3)
    a1.legend(fontsize=7)
    for label, tok, vt, rt in pts:
        if tok is None:
            continue
        a2.scatter([tok / 1e6], [vt], marker="o", color="C0")
        a2.annotate(label, (tok / 1e6, vt), fontsize=7, xytext=(3, 3), textcoords="offset points")
        if rt is not None:
            a2.scatter([tok / 1e6], [rt], marker="s", color="C3")
    a2.scatter([], [], marker="o", color="C0", label="validation tau (teacher-forced)")
    a2.scatter([], [], marker="s", color="C3", label="runtime tau, BF16 target")
    a2.axhline(2.5, color="gray", ls="--", lw=0.8)
    a2.set_xlabel("answer tokens in the training set (millions)")
    a2.set_ylabel("tau")
    a2.grid(alpha=0.3)
    a2.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M DSpark draft: tau against training tokens")
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
