"""Structured-output cost: the xgrammar mask per step (batch 1 and 8) and the tau of
constrained DSpark against unconstrained, on SmolLM2-135M with the shipped draft.

Mask cost: per request and step, ``RequestGrammar.walk`` (fill the bitmask of each row to
verify, accept the drafts, roll back) plus ``apply`` (mask the rows' logits), for a decode
step (1 row) and a DSpark step (7 drafts: 8 rows), summed over the batch (the matchers run one
after another on the CPU). tau: mean accepted length (bonus included) over 10 greedy requests.

    python bench/grammar_mask.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from edgebuild.runtime.llm import LLM
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.runtime.structured import GrammarSpec

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
NAMES = ("Ann", "Bob", "Chen", "Dana", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jo")


def mask_cost(llm: LLM, batch: int, drafts: list[int], repeats: int = 50) -> float:
    """Milliseconds of walk + apply for `batch` requests, one step with `drafts`."""
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    grammars = [llm.structured.matcher(spec) for _ in range(batch)]
    prefix = llm.tokenizer.encode('{"name": "', add_special_tokens=False)
    for g in grammars:
        g.advance(prefix)  # inside the string: every draft below is accepted
    logits = torch.randn(len(drafts) + 1, llm.config.vocab_size)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for g in grammars:
            k = g.walk(drafts)
            g.apply(logits[: k + 1])
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def tau(llm: LLM, constrained: bool) -> tuple[float, int]:
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA)) if constrained else None
    taus, tokens = [], 0
    for name in NAMES:
        ids = llm.encode_messages(
            [{"role": "user", "content": f"Describe a person called {name} as JSON."}]
        )
        st = llm.generate_ids([ids], SamplingParams(max_tokens=48, grammar=spec))[0]
        taus.append(st.metrics.tau)
        tokens += len(st.output_ids)
    return statistics.mean(taus), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = {
        "method": "dspark",
        "model": str(ROOT / "edgebuild/data/smollm2-135m-dspark"),
        "num_speculative_tokens": 7,
    }
    llm = LLM(ROOT / "examples/smollm2-135m", speculative=spec)
    inside = llm.tokenizer.encode("abcdefghijklmnopqrstuvwxyz", add_special_tokens=False)[:7]
    print("| batch | rows per request | mask ms per step (all requests) |")
    print("|---|---|---|")
    for batch in (1, 8):
        for drafts in ([], inside):
            print(f"| {batch} | {len(drafts) + 1} | {mask_cost(llm, batch, drafts):.3f} |")
    print()
    print("| output | tau | tokens |")
    print("|---|---|---|")
    for constrained in (False, True):
        t, n = tau(llm, constrained)
        print(f"| {'json_schema' if constrained else 'free text'} | {t:.3f} | {n} |")


if __name__ == "__main__":
    main()
