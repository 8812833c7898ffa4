"""Quality of the CPU weight-only quant modes against the unquantized model, teacher-forced.

For each held-out chat prompt of ``tools/train_dspark/data/eval_prompts.jsonl`` the
unquantized model (``--dtype``) writes its greedy continuation (``--max-tokens``); every
``--quant`` mode then reads prompt + continuation in one pass. Reported per mode: top-1
agreement with the reference's next token over the continuation positions, the perplexity of
the continuation (the reference's own is the floor), and the prompts whose greedy output is
identical. Not run in CI.

    python bench/quant_quality.py [--prompts 8 --max-tokens 64 --quant int8 int4]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def teacher_forced(llm, ids: list[int], cont: list[int]) -> tuple[int, float]:
    """(argmax matches, summed NLL) of ``cont`` after ``ids`` under ``llm``'s target."""
    seq = llm.target.new_sequence()
    rows = torch.tensor(ids + cont[:-1])
    logits = llm.target.forward([seq], [rows], [list(range(len(ids) - 1, len(rows)))]).logits[0]
    llm.target.free(seq)
    want = torch.tensor(cont)
    logp = torch.log_softmax(logits.float(), -1)
    return int((logits.argmax(-1) == want).sum()), float(-logp.gather(1, want[:, None]).sum())


def main() -> None:
    from edgebuild.runtime.llm import LLM, RuntimeOptions
    from edgebuild.runtime.sampling import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", type=Path, default=ROOT / "examples" / "smollm2-135m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--quant", nargs="+", default=["int8", "int4"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = ROOT / "tools" / "train_dspark" / "data" / "eval_prompts.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()][: args.prompts]
    opts = {m: RuntimeOptions(dtype=DTYPES[args.dtype], max_kv_rows=4096, quant=m or None)
            for m in ["", *args.quant]}  # fmt: skip
    ref = LLM(args.target, options=opts[""])
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [ref.encode(r["prompt"], chat=True) for r in rows]
    conts = [s.output_ids for s in ref.generate_ids(prompts, params)]
    total = sum(len(c) for c in conts)
    out = {}
    for mode, o in opts.items():
        llm = ref if not mode else LLM(args.target, options=o)
        hits = nll = 0.0
        for ids, cont in zip(prompts, conts, strict=True):
            h, n = teacher_forced(llm, ids, cont)
            hits, nll = hits + h, nll + n
        same = sum(
            s.output_ids == c for s, c in zip(llm.generate_ids(prompts, params), conts, strict=True)
        )
        out[mode or args.dtype] = {
            "top1_agreement": round(hits / total, 4),
            "perplexity": round(math.exp(nll / total), 3),
            "identical_prompts": f"{same}/{len(prompts)}",
        }
        print(mode or args.dtype, out[mode or args.dtype], flush=True)
    print(json.dumps({"dtype": args.dtype, "tokens": total, "modes": out}))


if __name__ == "__main__":
    main()
