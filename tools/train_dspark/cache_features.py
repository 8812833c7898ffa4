"""Cache the target's tapped hidden states for the regenerated answers (fp16, git-ignored).

For every ``prompt_ids + answer_ids`` sequence the target runs once (transformers, fp32 compute
like the CPU runtime's default) and we keep, per token:

* ``taps``: the outputs of the draft's ``target_layer_ids`` layers (HF ``hidden_states[l+1]``,
  before the final norm; never the last layer, spec/draft-checkpoint-formats.md section 1.5),
  concatenated in list order: ``[T, n_t * d]``;
* ``final``: the target's post-final-norm hidden ``[T, d]`` (HF ``hidden_states[-1]``); the
  tied ``lm_head`` turns it into the target's logits for the L1 term of the loss.

Shards ``features-XXXX.safetensors`` hold many sequences back to back (``offsets``).

    python -m tools.train_dspark.cache_features --answers .cache/train_dspark/answers.jsonl \
        --out .cache/train_dspark/features --taps 1 14 27
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tools.train_dspark.prompts import read_jsonl
from tools.train_dspark.regenerate import load_target

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FP16_MAX = 65504.0


@torch.inference_mode()
def hidden_features(model, seqs: list[list[int]], taps: list[int]):
    """(taps [T, n_t*d] fp32, final [T, d] fp32) per sequence (right padding is exact)."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    out = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hs = out.hidden_states  # embeddings, layer 0 .. layer n-2 outputs, final norm(layer n-1)
    n = model.config.num_hidden_layers
    if len(hs) != n + 1:
        raise RuntimeError(f"expected {n + 1} hidden states, got {len(hs)}")
    tap = torch.cat([hs[t + 1] for t in taps], dim=-1)
    final = out.last_hidden_state
    return [(tap[i, : len(s)], final[i, : len(s)]) for i, s in enumerate(seqs)]


def load_shards(folder: Path) -> list[dict]:
    """All cached sequences: dicts with ids [T] int64, prompt_len, taps fp16, final fp16."""
    seqs = []
    for path in sorted(folder.glob("features-*.safetensors")):
        t = load_file(str(path))
        off = t["offsets"].tolist()
        for i in range(len(off) - 1):
            a, b = off[i], off[i + 1]
            seqs.append(
                {
                    "ids": t["ids"][a:b].long(),
                    "prompt_len": int(t["prompt_lens"][i]),
                    "taps": t["taps"][a:b],
                    "final": t["final"][a:b],
                }
            )
    return seqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=Path("examples/smollm2-135m"))
    ap.add_argument("--answers", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--taps", type=int, nargs="+", default=[1, 14, 27])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--shard", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    _, model = load_target(args.target, torch.float32)
    n = model.config.num_hidden_layers
    if any(t < 0 or t >= n - 1 for t in args.taps) or sorted(set(args.taps)) != args.taps:
        raise SystemExit(f"--taps must be increasing ids in 0..{n - 2} (never the last layer)")
    rows = read_jsonl(args.answers)
    rows.sort(key=lambda r: len(r["prompt_ids"]) + len(r["answer_ids"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "meta.json").write_text(json.dumps({"taps": args.taps, "target": str(args.target)}))
    t0, peak = time.perf_counter(), 0.0
    for s0 in range(0, len(rows), args.shard):
        path = args.out / f"features-{s0 // args.shard:04d}.safetensors"
        if path.exists():
            continue
        chunk = rows[s0 : s0 + args.shard]
        seqs = [r["prompt_ids"] + r["answer_ids"] for r in chunk]
        feats = []
        for i in range(0, len(seqs), args.batch):
            feats += hidden_features(model, seqs[i : i + args.batch], args.taps)
        taps = torch.cat([f[0] for f in feats])
        final = torch.cat([f[1] for f in feats])
        peak = max(peak, float(taps.abs().max()), float(final.abs().max()))
        if peak >= FP16_MAX:
            raise SystemExit(f"hidden states reach {peak:.0f}: too large for fp16")
        lens = [len(s) for s in seqs]
        offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
        save_file(
            {
                "ids": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
                "offsets": offsets,
                "prompt_lens": torch.tensor([len(r["prompt_ids"]) for r in chunk]),
                "taps": taps.half().contiguous(),
                "final": final.half().contiguous(),
            },
            str(path),
        )
        print(
            f"{s0 + len(chunk)}/{len(rows)} sequences, peak |h| {peak:.0f}, "
            f"{time.perf_counter() - t0:.0f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
