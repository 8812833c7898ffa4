"""Teacher-forced tau at uniform anchors vs along the runtime's walk (a better model selector).

The trainer's validation averages the greedy chain length over random anchors of the target's
answers. The runtime does not anchor at random: after each verify the next block starts at the
bonus token, i.e. right after the position the draft just got wrong, and such positions are
harder. This tool computes the teacher-forced chain length ``L(s)`` at *every* answer anchor
``s`` (full vocabulary) and reports

* ``uniform``: ``1 + mean L(s)`` over all answer anchors (what ``train.py`` estimates);
* ``first``: the same over the first ``--max-tokens`` answer positions only;
* ``walk``: the runtime's path, ``s_0`` = the first answer token, ``s' = s + L(s) + 1``, one
  step per block, until ``--max-tokens`` new tokens: tokens per step = the runtime's tau under
  greedy decoding when the runtime's text equals the answer (up to its top-k walk).

    python -m tools.train_dspark.walk_tau --val-features .cache/train_dspark/rebuild/eval_features \
        --eval-answers .cache/train_dspark/rebuild/eval_answers.jsonl --limit 56 \
        --drafts edgebuild/data/smollm2-135m-dspark .cache/train_dspark/rebuild/draft
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from tools.train_dspark.cache_features import load_shards
from tools.train_dspark.model import AnchorBatch, build_draft
from tools.train_dspark.prompts import read_jsonl
from tools.train_dspark.train import accepted_lengths, block_losses, resume_weights


def walk_steps(chain: list[int], max_tokens: int) -> list[int]:
    """Tokens gained per runtime step along the walk.

    ``chain[j]``: accepted drafts of the block anchored at answer position j (0 = the first
    answer token, which the prefill produces). Each step gains ``1 + L`` tokens (bonus
    included), cut so the answer never exceeds ``max_tokens`` tokens; the walk starts after
    the prefill's token and stops at ``max_tokens`` tokens or the end of ``chain``.
    """
    steps, j = [], 0
    while j < min(len(chain), max_tokens - 1):
        gain = min(1 + chain[j], max_tokens - 1 - j)
        steps.append(gain)
        j += gain
    return steps


@torch.no_grad()
def chain_lengths(model, seq: dict) -> list[int]:
    """Teacher-forced greedy chain length at every answer anchor of one cached sequence."""
    n, p = len(seq["ids"]), seq["prompt_len"]
    anchors = torch.arange(p, n - 1)[None]
    batch = AnchorBatch(
        seq["taps"][None],
        seq["ids"][None],
        torch.tensor([n]),
        anchors,
        torch.ones_like(anchors, dtype=torch.bool),
    )
    _, out = block_losses(model, batch, seq["final"][None], 1.0)
    return accepted_lengths(out["hit"], out["valid"]).tolist()  # one block per anchor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=Path("examples/smollm2-135m"))
    ap.add_argument("--val-features", type=Path, required=True)
    ap.add_argument("--eval-answers", type=Path, default=None, help="to keep the first --limit")
    ap.add_argument("--limit", type=int, default=0, help="the first N eval prompts (0: all)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--drafts", type=Path, nargs="+", required=True)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    seqs = load_shards(args.val_features)
    if args.limit:
        if args.eval_answers is None:
            raise SystemExit("--limit needs --eval-answers (the shards are sorted by length)")
        rows = read_jsonl(args.eval_answers)[: args.limit]
        keep = {tuple(r["prompt_ids"] + r["answer_ids"]) for r in rows}
        seqs = [s for s in seqs if tuple(s["ids"].tolist()) in keep]
    tcfg = json.loads((args.target / "config.json").read_text())
    tensors = load_file(str(args.target / "model.safetensors"))
    for d in args.drafts:
        dcfg = json.loads((d / "config.json").read_text())
        model = build_draft(dcfg, tcfg, tensors, init_layers_from=None, seed=0)
        resume_weights(model, dcfg, d)
        model.eval()
        every, first, steps = [], [], []
        for s in seqs:
            chain = chain_lengths(model, s)
            every += chain
            first += chain[: args.max_tokens]
            steps += walk_steps(chain, args.max_tokens)
        rec = {
            "draft": str(d),
            "sequences": len(seqs),
            "uniform": round(1 + sum(every) / len(every), 4),
            "first": round(1 + sum(first) / len(first), 4),
            "walk": round(sum(steps) / len(steps), 4),
        }
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
