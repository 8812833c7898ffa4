"""Quality of the CPU weight-only quant modes against the unquantized model, teacher-forced.

For each held-out chat prompt of ``tools/train_dspark/data/eval_prompts.jsonl`` the
unquantized model (``--dtype``) writes its greedy continuation (``--max-tokens``); every
``--quant`` mode then reads prompt + continuation in one pass. Reported per mode: top-1
agreement with the reference's next token over the continuation positions, the perplexity of
the continuation (the reference's own is the floor), and the prompts whose greedy output is
identical. Not run in CI.

``--ortgenai int4 fp32`` (the default when ``--ortgenai-python``, by default
``/work/venv-genai/bin/python``, exists) adds onnxruntime-genai rows: the models of its own
builder (``cpu_compare.py``'s, cached in ``--ortgenai-dir``/<precision>) read the same
prompt + continuation in one pass of their ``model.onnx`` (onnxruntime in that venv, empty
past KV) through ``bench/ortgenai_worker.py``, and generate greedily there for the identical
column; agreement and perplexity are computed as for the edgebuild rows. The fp32 row is the
check on that pass: it must agree with the reference about as well as the reference does with
itself (``--dtype float32``: nearly 1.0).

    python bench/quant_quality.py [--prompts 8 --max-tokens 64 --quant int8 int4]
        [--ortgenai int4 fp32 --ortgenai-python PY]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
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


def ortgenai_worker():
    """``bench/ortgenai_worker.py`` (the out-of-process onnxruntime-genai client)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import ortgenai_worker

    return ortgenai_worker


def ortgenai_row(args, precision: str, prompts, conts) -> tuple[int, float, int, dict]:
    """(argmax matches, summed NLL, identical prompts, versions) of onnxruntime-genai."""
    ow = ortgenai_worker()
    model = args.ortgenai_dir / precision
    if not (model / "genai_config.json").is_file():
        ow.build(
            args.ortgenai_python, args.target, model, precision, args.ortgenai_dir / "hf_cache"
        )
    w = ow.Worker(args.ortgenai_python, model, threads=1)
    try:
        hits = nll = same = 0
        for ids, cont in zip(prompts, conts, strict=True):
            top, logp = w.teacher_forced(ids, cont)
            hits += sum(a == b for a, b in zip(top, cont, strict=True))
            nll -= sum(logp)
            same += w.generate(ids, len(cont))[0] == cont
        return hits, nll, same, w.versions
    finally:
        w.close()


def main() -> None:
    from edgebuild.runtime.llm import LLM, RuntimeOptions
    from edgebuild.runtime.sampling import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", type=Path, default=ROOT / "examples" / "smollm2-135m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--quant", nargs="+", default=["int8", "int4"])
    ap.add_argument("--ortgenai-python", default=ortgenai_worker().default_python(),
                    help="python of a venv with onnxruntime-genai (its rows run there)")  # fmt: skip
    ap.add_argument("--ortgenai", nargs="*", choices=["int4", "fp32"], default=None,
                    help="onnxruntime-genai precisions (default int4 fp32 when its python exists)")  # fmt: skip
    ap.add_argument("--ortgenai-dir", type=Path, default=ROOT / ".cache" / "ortgenai")
    args = ap.parse_args()
    if args.ortgenai is None:
        args.ortgenai = ["int4", "fp32"] if args.ortgenai_python else []
    if args.ortgenai and not args.ortgenai_python:
        ap.error("--ortgenai needs --ortgenai-python (a venv with onnxruntime-genai)")
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
    versions = {}
    for precision in args.ortgenai:
        hits, nll, same, versions = ortgenai_row(args, precision, prompts, conts)
        name = f"onnxruntime-genai {precision}"
        out[name] = {
            "top1_agreement": round(hits / total, 4),
            "perplexity": round(math.exp(nll / total), 3),
            "identical_prompts": f"{same}/{len(prompts)}",
        }
        print(name, out[name], flush=True)
    report = {"dtype": args.dtype, "tokens": total, "modes": out}
    if versions:
        report["ortgenai_versions"] = versions
    print(json.dumps(report))


if __name__ == "__main__":
    main()
