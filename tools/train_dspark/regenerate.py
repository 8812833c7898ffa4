"""Target-regenerated answers: the target answers each prompt greedily with its chat template.

As in the DSpark paper, the draft learns the target's own outputs, not a human dataset's.
transformers' batched ``generate`` (left padding, greedy) is used for speed; the prompt goes
through the same chat template as ``edgebuild run --chat``. Writes one JSON line per prompt:
``{"id", "prompt", "prompt_ids", "answer_ids"}`` (``answer_ids`` ends with the EOS token when
the answer finished before ``--max-new-tokens``).

    python -m tools.train_dspark.regenerate --target examples/smollm2-135m \
        --prompts tools/train_dspark/data/train_prompts.jsonl --out .cache/train_dspark/answers.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from tools.train_dspark.prompts import read_jsonl

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """Prompt ids through the chat template, exactly as ``LLM.encode(prompt, chat=True)``."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def load_target(target: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype, local_files_only=True)
    model.eval()
    return tok, model


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], max_new: int, pad_id: int, eos_id: int):
    """Greedy answers of a batch (left padding); each answer is cut after its first EOS."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids.to(model.device),
        attention_mask=mask.to(model.device),
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    answers = []
    for row in out[:, width:].cpu().tolist():
        answers.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
    return answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=Path("examples/smollm2-135m"))
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok, model = load_target(args.target, getattr(torch, args.dtype))
    model.to(args.device)
    eos = int(model.generation_config.eos_token_id or tok.eos_token_id)
    rows = read_jsonl(args.prompts)
    if args.limit:
        rows = rows[: args.limit]
    done = set()
    if args.out.exists():  # resumable
        done = {json.loads(line)["id"] for line in args.out.read_text().splitlines() if line}
    todo = [r for r in rows if r["id"] not in done]
    # similar prompt lengths together: less padding
    todo.sort(key=lambda r: len(chat_ids(tok, r["prompt"])))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    t0, n_tok = time.perf_counter(), 0
    with args.out.open("a", encoding="utf-8") as f:
        for i in range(0, len(todo), args.batch):
            chunk = todo[i : i + args.batch]
            prompt_ids = [chat_ids(tok, r["prompt"]) for r in chunk]
            answers = generate_batch(model, prompt_ids, args.max_new_tokens, eos, eos)
            for r, p, a in zip(chunk, prompt_ids, answers, strict=True):
                rec = {"id": r["id"], "prompt": r["prompt"], "prompt_ids": p, "answer_ids": a}
                f.write(json.dumps(rec) + "\n")
                n_tok += len(a)
            f.flush()
            dt = time.perf_counter() - t0
            print(
                f"{i + len(chunk)}/{len(todo)} prompts, {n_tok} tokens, {dt:.0f} s "
                f"({n_tok / dt:.1f} tok/s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
