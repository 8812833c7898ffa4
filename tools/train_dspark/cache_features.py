"""Cache the target's tapped hidden states for the regenerated answers (streamed to disk).

For every ``prompt_ids + answer_ids`` sequence the target runs once (transformers; ``--dtype``
fp32 like the CPU runtime's old default, or bf16) and we keep, per token:

* ``taps``: the outputs of the draft's ``target_layer_ids`` layers (HF ``hidden_states[l+1]``,
  before the final norm; never the last layer, spec/draft-checkpoint-formats.md section 1.5),
  concatenated in list order: ``[T, n_t * d]``, fp16;
* ``final``: the target's post-final-norm hidden ``[T, d]`` (HF ``hidden_states[-1]``), fp16;
  the tied ``lm_head`` turns it into the target's logits for the L1 term of the loss;
* ``topk``: the target's ``--topk`` most likely next tokens ``[T, k]`` int32 (the candidate
  set of the trainer's vocabulary-subset loss).

Shards are folders ``shard-XXXX/`` of ``.npy`` files (memory-mapped by the trainer, so the
cache can be larger than RAM), written to a temporary name and renamed when complete: an
interrupted run resumes at the first missing shard. Shards keep the answers' order (sorted by
length only inside a shard), so a prefix of the shards is a prefix of the data.

    python -m tools.train_dspark.cache_features --answers .cache/train_dspark/answers.jsonl \
        --out .cache/train_dspark/features --taps 1 14 27
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from tools.train_dspark.datagen import parse_part
from tools.train_dspark.prompts import read_jsonl
from tools.train_dspark.regenerate import load_target

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FP16_MAX = 65504.0


@torch.inference_mode()
def hidden_features(model, seqs: list[list[int]], taps: list[int], device: str = "cpu"):
    """(taps [T, n_t*d], final [T, d]) per sequence, model dtype (right padding is exact)."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    out = model.model(
        input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True
    )
    hs = out.hidden_states  # embeddings, layer 0 .. layer n-2 outputs, final norm(layer n-1)
    n = model.config.num_hidden_layers
    if len(hs) != n + 1:
        raise RuntimeError(f"expected {n + 1} hidden states, got {len(hs)}")
    tap = torch.cat([hs[t + 1] for t in taps], dim=-1)
    final = out.last_hidden_state
    return [(tap[i, : len(s)], final[i, : len(s)]) for i, s in enumerate(seqs)]


@torch.inference_mode()
def target_topk(model, final: torch.Tensor, k: int, chunk: int = 1024) -> torch.Tensor:
    """The target's ``k`` most likely next tokens per row of ``final`` [T, d]: int32 [T, k]."""
    head = model.get_output_embeddings().weight
    out = [
        torch.topk(final[i : i + chunk].to(head.dtype) @ head.T, k, dim=-1).indices
        for i in range(0, final.shape[0], chunk)
    ]
    return torch.cat(out).int()


def _mmap(path: Path) -> torch.Tensor:
    return torch.from_numpy(np.load(path, mmap_mode="c"))


def load_shards(folder: Path, max_answer_tokens: int = 0) -> list[dict]:
    """Cached sequences: dicts with ids [T] int64, prompt_len, taps fp16, final fp16 (and
    topk int32 for ``shard-*`` folders), memory-mapped; at most ``max_answer_tokens`` answer
    tokens (a prefix of the data; 0 = all)."""
    seqs: list[dict] = []
    n_ans = 0
    for shard in sorted(folder.glob("shard-[0-9]*")):
        if not shard.is_dir() or shard.name.endswith(".tmp"):  # .tmp: being written
            continue
        m = json.loads((shard / "index.json").read_text())
        arr = {k: _mmap(shard / f"{k}.npy") for k in ("ids", "taps", "final", "topk")}
        off = m["offsets"]
        for i in range(len(off) - 1):
            if max_answer_tokens and n_ans >= max_answer_tokens:
                return seqs
            a, b = off[i], off[i + 1]
            seqs.append(
                {
                    "ids": arr["ids"][a:b].long(),
                    "prompt_len": int(m["prompt_lens"][i]),
                    "taps": arr["taps"][a:b],
                    "final": arr["final"][a:b],
                    "topk": arr["topk"][a:b],
                }
            )
            n_ans += b - a - int(m["prompt_lens"][i])
    for path in sorted(folder.glob("features-*.safetensors")):  # the older format
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


def write_shard(path: Path, seqs, prompt_lens, feats, topk) -> None:
    """One shard folder, written under a temporary name, then renamed (atomic)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    lens = [len(s) for s in seqs]
    offsets = [0, *np.cumsum(lens).tolist()]
    np.save(tmp / "ids.npy", np.array([t for s in seqs for t in s], dtype=np.int32))
    np.save(tmp / "taps.npy", torch.cat([f[0] for f in feats]).half().cpu().numpy())
    np.save(tmp / "final.npy", torch.cat([f[1] for f in feats]).half().cpu().numpy())
    np.save(tmp / "topk.npy", topk.cpu().numpy())
    (tmp / "index.json").write_text(json.dumps({"offsets": offsets, "prompt_lens": prompt_lens}))
    tmp.rename(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=Path("examples/smollm2-135m"))
    ap.add_argument("--answers", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--taps", type=int, nargs="+", default=[1, 14, 27])
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--shard", type=int, default=256)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-answer-tokens", type=int, default=0, help="a prefix of the data")
    ap.add_argument(
        "--part", type=parse_part, default=(0, 1), help="I/N: every N-th shard (one per core)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    _, model = load_target(args.target, getattr(torch, args.dtype))
    model.to(args.device)
    n = model.config.num_hidden_layers
    if any(t < 0 or t >= n - 1 for t in args.taps) or sorted(set(args.taps)) != args.taps:
        raise SystemExit(f"--taps must be increasing ids in 0..{n - 2} (never the last layer)")
    rows = read_jsonl(args.answers)
    if args.max_answer_tokens:
        keep, tot = [], 0
        for r in rows:
            if tot >= args.max_answer_tokens:
                break
            keep.append(r)
            tot += len(r["answer_ids"])
        rows = keep
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"taps": args.taps, "target": str(args.target), "dtype": args.dtype, "topk": args.topk}
    tmp = args.out / f"meta.json.{os.getpid()}.tmp"  # --part runs write it too: atomic
    tmp.write_text(json.dumps(meta))
    tmp.replace(args.out / "meta.json")
    t0, peak, n_tok = time.perf_counter(), 0.0, 0
    for s0 in range(0, len(rows), args.shard):
        path = args.out / f"shard-{s0 // args.shard:04d}"
        if path.is_dir() or (s0 // args.shard) % args.part[1] != args.part[0]:
            continue
        chunk = sorted(
            rows[s0 : s0 + args.shard], key=lambda r: len(r["prompt_ids"]) + len(r["answer_ids"])
        )
        seqs = [r["prompt_ids"] + r["answer_ids"] for r in chunk]
        feats = []
        for i in range(0, len(seqs), args.batch):
            feats += hidden_features(model, seqs[i : i + args.batch], args.taps, args.device)
        for f in feats:
            peak = max(peak, float(f[0].abs().max()), float(f[1].abs().max()))
        if peak >= FP16_MAX:
            raise SystemExit(f"hidden states reach {peak:.0f}: too large for fp16")
        topk = target_topk(model, torch.cat([f[1] for f in feats]), args.topk)
        write_shard(path, seqs, [len(r["prompt_ids"]) for r in chunk], feats, topk)
        n_tok += sum(len(q) for q in seqs)
        dt = time.perf_counter() - t0
        print(
            f"{s0 + len(chunk)}/{len(rows)} sequences, {n_tok} tokens, peak |h| {peak:.0f}, "
            f"{dt:.0f} s ({n_tok / dt:.0f} tok/s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
