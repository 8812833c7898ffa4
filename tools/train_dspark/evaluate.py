"""Measure the example pair with the real runtime: tau, acceptance by position, losslessness.

On the held-out chat prompts (``data/eval_prompts.jsonl``, topics never used in training),
greedy, ``num_speculative_tokens`` 7, through ``edgebuild.runtime.llm.LLM``:

1. BF16 target: DSpark vs target-only -> tau (bonus included), acceptance by draft position,
   and whether every output is identical (lossless);
2. NVFP4 target (NVFP4 lm_head, the draft borrows it): DSpark vs NVFP4 target-only, identical.

Each pair writes ``eval_<pair>.json`` (the pairs can run as two processes, one thread each);
then ``eval.json`` (both) and ``acceptance_by_position.png`` are written into ``--out``.

    python -m tools.train_dspark.evaluate --draft edgebuild/data/smollm2-135m-dspark \
        --out edgebuild/data/smollm2-135m-dspark
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.speculative.config import default_draft_top_k
from tools.train_dspark.prompts import DATA_DIR, read_jsonl


def run_pair(target: Path, draft: Path, prompts: list[str], args) -> dict:
    """DSpark and target-only on the same LLM (same weights); batched in chunks."""
    spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": args.n}
    if args.top_k is not None:  # else the draft's markov_topk (config.json), else 16
        spec["draft_top_k"] = args.top_k
    if args.fixed:  # every step verifies all n drafts: tau is the draft's, not the scheduler's
        spec["confidence_scheduling"] = False
    if args.no_token_map:  # the draft over the whole vocabulary (as the model card's figures)
        spec["token_map"] = None
    options = None if args.dtype is None else RuntimeOptions(dtype=getattr(torch, args.dtype))
    llm = LLM(target, speculative=spec, options=options)
    plain = llm.without_draft()  # the same target weights, no draft
    ids = [llm.encode(p, chat=True) for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    out: dict = {"target": str(target), "prompts": len(prompts)}
    results = {}
    for name, runner in (("dspark", llm), ("target_only", plain)):
        t0, states = time.perf_counter(), []
        for i in range(0, len(ids), args.batch):
            states += runner.generate_ids(ids[i : i + args.batch], params)
            print(f"  {target.name} {name}: {len(states)}/{len(ids)}", flush=True)
        wall = time.perf_counter() - t0
        total = states[0].metrics
        for st in states[1:]:
            total = total.merge(st.metrics)
        results[name] = states
        out[name] = {**total.to_dict(), "wall_s": round(wall, 1)}
    same = [
        a.output_ids == b.output_ids
        for a, b in zip(results["dspark"], results["target_only"], strict=True)
    ]
    out["identical_outputs"] = sum(same)
    out["lossless"] = all(same)
    out["speedup_decode"] = round(
        out["dspark"]["decode_tokens_per_s"] / max(out["target_only"]["decode_tokens_per_s"], 1e-9),
        3,
    )
    out["samples"] = [
        {"prompt": p, "text": st.stopper.final_text()}
        for p, st in list(zip(prompts, results["dspark"], strict=True))[:3]
    ]
    return out


def _portable(path: Path) -> str:
    """``path`` relative to the working directory (the repository root) when it lies under
    it, so a committed ``eval.json`` names no machine's folders; else as given."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    for key, label in (("bf16", "BF16 target"), ("nvfp4", "NVFP4 target")):
        if key not in report:
            continue
        acc = report[key]["dspark"]["acceptance_by_position"]
        tau = report[key]["dspark"]["tau"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{label} (tau {tau:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | proposed)")
    ax.set_ylim(0, 1)
    ax.set_title(f"SmolLM2-135M DSpark draft, {report['prompts']} held-out prompts, greedy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


PAIRS = {"bf16": "BF16 target", "nvfp4": "NVFP4 target"}


def _token_map_name(draft: Path) -> str | None:
    """The token map the runtime uses by default (the draft's own), as the report names it."""
    from edgebuild.speculative.token_map import TOKEN_MAP_FILE

    return TOKEN_MAP_FILE if (draft / TOKEN_MAP_FILE).is_file() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=Path("examples/smollm2-135m"))
    ap.add_argument("--nvfp4-target", type=Path, default=Path("examples/smollm2-135m-nvfp4"))
    ap.add_argument("--draft", type=Path, default=Path("edgebuild/data/smollm2-135m-dspark"))
    ap.add_argument("--prompts", type=Path, default=DATA_DIR / "eval_prompts.jsonl")
    ap.add_argument("--pairs", nargs="+", choices=sorted(PAIRS), default=["bf16", "nvfp4"])
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--n", type=int, default=7)
    ap.add_argument("--top-k", type=int, default=None, help="default: the draft's markov_topk")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default=None, help="default: the runtime's"
    )
    ap.add_argument(
        "--fixed",
        action="store_true",
        help="fixed-length speculation (confidence_scheduling false): measures the draft's "
        "tau; by default the scheduler may verify fewer drafts, or none, where they do not pay",
    )
    ap.add_argument(
        "--no-token-map",
        action="store_true",
        help="draft over the whole vocabulary (default: the draft's token_map.json if shipped)",
    )
    ap.add_argument("--report-only", action="store_true", help="Merge eval_*.json, plot.")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = [r["prompt"] for r in read_jsonl(args.prompts)]
    if args.limit:
        prompts = prompts[: args.limit]
    targets = {"bf16": args.target, "nvfp4": args.nvfp4_target}
    for pair in [] if args.report_only else args.pairs:
        t0 = time.perf_counter()
        result = run_pair(targets[pair], args.draft, prompts, args)
        result.update(
            prompt_file=_portable(args.prompts),
            max_tokens=args.max_tokens,
            num_speculative_tokens=args.n,
            draft_top_k=default_draft_top_k(args.draft) if args.top_k is None else args.top_k,
            greedy=True,
            confidence_scheduling=not args.fixed,
            token_map=None if args.no_token_map else _token_map_name(args.draft),
            dtype=args.dtype or "runtime default",
            eval_wall_s=round(time.perf_counter() - t0, 1),
        )
        (args.out / f"eval_{pair}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: v for k, v in result.items() if k != "samples"}), flush=True)
    report = {}
    for pair in PAIRS:
        path = args.out / f"eval_{pair}.json"
        if path.is_file():
            report[pair] = json.loads(path.read_text())
    report["prompts"] = max((r["prompts"] for r in report.values()), default=0)
    (args.out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out / "acceptance_by_position.png")
    print(f"wrote {args.out / 'eval.json'} and acceptance_by_position.png", flush=True)


if __name__ == "__main__":
    main()
