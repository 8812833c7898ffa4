"""Time all fp32-kernel linears of one SmolLM2-135M token: the AVX2 loop vs the AVX-512 loop.

The shapes of one decode step (30 layers of qkv 960 x 576, o 576 x 576, gate/up 3072 x 576,
down 576 x 1536, then the lm_head 49152 x 576), random bf16-exact weights packed by
``f32_linear.pack`` (stored as bf16, as a bf16 checkpoint run in fp32 is; ``--storage fp32``
for fp32 copies), each layer its own weight, so a token streams ~270 MB (~540 MB fp32) from
memory as a real one does. The two loops (``f32_linear.avx512``) are timed in one process,
``--repeats`` rounds each running every (loop, rows) pair once in a shuffled order, so a drift
of the machine's speed falls on both; medians and first quartiles per pair.

    python bench/f32_linears.py [--rows 1 2 3 5 8 --threads 1 --repeats 15]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from int4_a8_linears import HIDDEN, INTER, LAYERS, SHAPES, VOCAB  # one token's shapes

from edgebuild.ops import f32_linear


def weights(storage: str) -> list[tuple[int, int, torch.Tensor]]:
    """[(out, in, packed weight)] for one token's linears."""
    g = torch.Generator().manual_seed(0)
    return [
        (n, k, f32_linear.pack((torch.randn(n, k, generator=g) * 0.05).bfloat16().float(), storage))
        for n, k in SHAPES * LAYERS + [(VOCAB, HIDDEN)]
    ]


def token(ws, xs) -> float:
    """Seconds for one token's linears (x per input width)."""
    t = time.perf_counter()
    for n, k, w in ws:
        f32_linear.linear(xs[k], w, None, n)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 8])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--storage", choices=["auto", "fp32"], default="auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert f32_linear.available(), "the AVX2 kernels do not run here"
    before = f32_linear.avx512()
    loops = ["avx2", "avx512"] if f32_linear.avx512(True) else ["avx2"]
    ws = weights(args.storage)
    xs = {r: {k: torch.randn(r, k) for k in (HIDDEN, INTER)} for r in args.rows}
    times = {(lp, r): [] for lp in loops for r in args.rows}
    try:
        for lp in loops:  # warm up
            f32_linear.avx512(lp == "avx512")
            token(ws, xs[args.rows[0]])
        for _ in range(args.repeats):
            order = list(times)
            random.shuffle(order)
            for lp, r in order:
                f32_linear.avx512(lp == "avx512")
                times[(lp, r)].append(token(ws, xs[r]))
    finally:
        f32_linear.avx512(before)
    report = {}
    for r in args.rows:
        row = {}
        for lp in loops:
            t = sorted(times[(lp, r)])
            row[lp] = {
                "median_ms": round(1e3 * statistics.median(t), 2),
                "q1_ms": round(1e3 * t[len(t) // 4], 2),
            }
        report[f"rows={r}"] = row
        print(r, row, flush=True)
    print(json.dumps({"threads": args.threads, "storage": args.storage, **report}))


if __name__ == "__main__":
    main()
