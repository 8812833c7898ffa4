"""Time all int4 linears of one SmolLM2-135M token: fp32-input kernel vs int8-input kernel.

The shapes of one decode step (30 layers of qkv 960 x 576, o 576 x 576, gate/up 3072 x 576,
down 576 x 1536, then the lm_head 49152 x 576), random weights quantized by
``quantize_int4``, each layer its own weight (so a token streams ~100 MB of codes and scales
from memory, as a real one does). The two kernels are timed interleaved in one process
(``--repeats`` tokens each, median and min), for each ``--rows``, at ``--threads``.

    python bench/int4_a8_linears.py [--rows 1 8 --threads 1 --repeats 21]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from edgebuild.ops import f32_linear
from edgebuild.ops.linear import quantize_int4

HIDDEN, INTER, LAYERS, VOCAB = 576, 1536, 30, 49152
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


def weights():
    """[(out, in, fp32-kernel pack, a8-kernel pack)] for one token's linears."""
    g = torch.Generator().manual_seed(0)
    out = []
    for n, k in SHAPES * LAYERS + [(VOCAB, HIDDEN)]:
        codes, sz = quantize_int4(torch.randn(n, k, generator=g) * 0.05)
        out.append((n, k, f32_linear.pack_int4(codes, sz), f32_linear.pack_int4_a8(codes, sz)))
    return out


def token(ws, xs, a8: bool) -> float:
    """Seconds for one token's linears (x per input width)."""
    t = time.perf_counter()
    for n, k, old, new in ws:
        if a8:
            f32_linear.linear_int4(xs[k], *new, None, n, int8_inputs=True)
        else:
            f32_linear.linear_int4(xs[k], *old, None, n)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert f32_linear.available(), "the AVX2 kernels do not run here"
    ws = weights()
    report = {}
    for rows in args.rows:
        xs = {k: torch.randn(rows, k) for k in (HIDDEN, INTER)}
        times = {"fp32": [], "int8": []}
        token(ws, xs, False), token(ws, xs, True)  # warm up
        for _ in range(args.repeats):
            for name in times:
                times[name].append(token(ws, xs, name == "int8"))
        row = {
            name: {
                "median_ms": round(1e3 * statistics.median(t), 2),
                "min_ms": round(1e3 * min(t), 2),
            }
            for name, t in times.items()
        }
        row["speedup_median"] = round(row["fp32"]["median_ms"] / row["int8"]["median_ms"], 2)
        report[f"rows={rows}"] = row
        print(rows, row, flush=True)
    print(json.dumps({"threads": args.threads, **report}))


if __name__ == "__main__":
    main()
