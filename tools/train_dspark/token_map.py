"""A draft token map from the target's own answers (FR-Spec's frequency-ranked vocabulary).

Counts the token ids of the target-regenerated answers a draft is trained on (``datagen``'s
``answers.npz``: uint16 ids + offsets; or ``regenerate``'s JSON lines with ``answer_ids``),
keeps the ``--size`` most frequent (ties: the lower id) plus the target's end-of-sequence
ids, and writes them as a JSON list (:func:`edgebuild.speculative.token_map.write_token_map`).
A draft directory's ``token_map.json`` is used by default (``--speculative-config``'s
``token_map`` overrides it; ``null`` turns it off); see :mod:`edgebuild.speculative.token_map`.
Prints the share of the counted tokens the map covers.

    python -m tools.train_dspark.token_map --target examples/smollm2-135m \
        --answers tools/train_dspark/data/distill/answers.npz \
                  tools/train_dspark/data/gpu_distill/answers.npz \
        --size 8192 --out edgebuild/data/smollm2-135m-dspark/token_map.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from edgebuild.speculative.token_map import rank_tokens, write_token_map


def count_tokens(paths: list[Path], vocab_size: int) -> torch.Tensor:
    """int64 ``[V]``: occurrences of each id in the answers of ``paths`` (.npz or .jsonl)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for path in paths:
        if path.suffix == ".npz":
            ids = np.load(path)["ids"].astype(np.int64)
        else:
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            ids = np.array([i for r in rows for i in r["answer_ids"]], dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise SystemExit(f"{path}: token ids outside [0, {vocab_size}): another tokenizer?")
        counts += np.bincount(ids, minlength=vocab_size)
    return torch.from_numpy(counts)


def eos_ids(target: Path) -> list[int]:
    """The target's end-of-sequence ids: config.json's, generation_config.json's and the
    tokenizer's (the runtime stops on each)."""
    from edgebuild.runtime.llm import load_tokenizer

    out: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = target / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            out.update([value] if isinstance(value, int) else value or [])
    eos = getattr(load_tokenizer(target), "eos_token_id", None)
    if isinstance(eos, int):
        out.add(eos)
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--answers", type=Path, nargs="+", required=True)
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    vocab = json.loads((args.target / "config.json").read_text())["vocab_size"]
    counts = count_tokens(args.answers, vocab)
    ids = rank_tokens(counts, args.size, eos_ids(args.target))
    write_token_map(args.out, ids)
    covered = int(counts[ids].sum()) / max(int(counts.sum()), 1)
    print(f"{args.out}: {len(ids)} of {vocab} tokens, {covered:.2%} of {int(counts.sum())} "
          f"counted answer tokens")  # fmt: skip


if __name__ == "__main__":
    main()
