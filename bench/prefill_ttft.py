"""Time to first token with chunked / batched prefill and prefix caching (in process, no HTTP).

Two measurements on the real SmolLM2-135M (bf16 where the CPU has it):

1. **Multi-turn chat**: a ~1k-token system prompt and a question (turn 1), then the same
   history + the answer + a new question (turn 2): TTFT of each turn, prefix caching on and off.
2. **16 new prompts at once**: every request's time to its first token when the decoder steps
   the 16 together, batched prefill on vs off (``--no-enable-chunked-prefill``: one by one).

Usage: ``python bench/prefill_ttft.py [--threads N] [--draft]`` (``--draft``: DSpark with the
shipped draft). Prints one line per measurement.

Measured (2-core AVX512-BF16 host shared with other jobs, 1 thread, bf16, 2026-12-01):
target-only: turn 2 after a 1140-token turn 1, 0.227 s vs 1.605 s (0.14x) with prefix caching,
1.65 s without; 16 prompts, TTFT p50 0.86 s batched vs 1.63 s one by one (0.53x). DSpark:
0.224 s vs 1.642 s (0.14x); 0.79 s vs 1.59 s (0.50x).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.runtime.prefill import PrefillConfig
from edgebuild.runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
DRAFT = ROOT / "edgebuild" / "data" / "smollm2-135m-dspark"
TOPICS = ["cats", "the moon", "Paris", "the sea", "iron", "Python", "music", "tea",
          "bees", "snow", "trains", "stars", "bread", "chess", "rivers", "clocks"]  # fmt: skip


def first_tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[float]:
    """Seconds from the start until each request's first token (requests stepped together)."""
    t0 = time.perf_counter()
    states = [llm.new_request(p, params) for p in prompts]
    ttft: list[float | None] = [None] * len(states)
    try:
        while any(t is None for t in ttft):
            llm.decoder.step([s for s in states if not s.finished])
            now = time.perf_counter() - t0
            for i, s in enumerate(states):
                if ttft[i] is None and s.output_ids:
                    ttft[i] = now
    finally:
        for s in states:
            llm.finish(s)
    return ttft


def multi_turn(llm: LLM, caching: bool) -> tuple[float, float, int]:
    """(turn 1 TTFT, turn 2 TTFT, turn 1 prompt tokens); each run on a fresh LLM (no pages
    cached before turn 1)."""
    llm.set_prefill(PrefillConfig(enable_prefix_caching=caching))
    system = " ".join(f"Rule {i}: be brief and mention {t} if it helps." for i, t in
                      enumerate(TOPICS * 5))  # fmt: skip
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Hi, who are you?"}]
    turn1 = llm.encode_messages(msgs)
    params = SamplingParams(max_tokens=32, temperature=0.0)
    t1 = first_tokens(llm, [turn1], params)[0]
    answer = llm.generate_ids([turn1], params)[0].stopper.final_text()
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And why?"}]
    turn2 = llm.encode_messages(msgs)
    t2 = first_tokens(llm, [turn2], params)[0]
    return t1, t2, len(turn1)


def sixteen(llm: LLM, chunked: bool) -> list[float]:
    llm.set_prefill(PrefillConfig(enable_chunked_prefill=chunked, enable_prefix_caching=False))
    prompts = [
        llm.encode_messages([{"role": "user", "content": f"Tell me one short fact about {t}."}])
        for t in TOPICS
    ]
    return first_tokens(llm, prompts, SamplingParams(max_tokens=8, temperature=0.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft", action="store_true", help="DSpark with the shipped draft")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = None
    if args.draft:
        spec = {"method": "dspark", "model": str(DRAFT), "num_speculative_tokens": 7}

    def load():
        return LLM(ROOT / "examples" / "smollm2-135m", speculative=spec, options=RuntimeOptions())

    llm = load()
    sixteen(llm, True)  # warm-up
    for caching in (False, True):
        t1, t2, n = multi_turn(load(), caching)
        print(f"multi-turn, prefix caching {'on ' if caching else 'off'}: turn 1 ({n} tokens) "
              f"TTFT {t1:.3f} s, turn 2 TTFT {t2:.3f} s ({t2 / t1:.2f}x turn 1)")  # fmt: skip
    for chunked in (False, True):
        t = sixteen(llm, chunked)
        print(f"16 prompts at once, batched prefill {'on ' if chunked else 'off'}: TTFT p50 "
              f"{statistics.median(t):.3f} s, max {max(t):.3f} s")  # fmt: skip


if __name__ == "__main__":
    main()
