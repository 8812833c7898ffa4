"""The int4 linears of one SmolLM2-135M step: edgebuild's AMX kernel against torch's.

30 x (qkv 960x576, gate/up 3072x576, o 576x576, down 576x1536) + the 49152x576 lm_head,
random weights of the real shapes (~80 MB of codes: mostly out of cache, as in a step),
bf16 activations of 1, 2, 4 and 8 rows, at 1 and 2 threads; median ms per step of 7
interleaved rounds, printed as the markdown rows of bench/README.md. Needs a CPU with
AMX-BF16 (the kernel's requirement). Not run in CI.

    python bench/int4_kernel.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgebuild.ops import amx_linear  # noqa: E402
from edgebuild.ops.linear import INT4_GROUP_SIZE, quantize_int4  # noqa: E402

SHAPES = [(960, 576), (3072, 576), (576, 576), (576, 1536)] * 30 + [(49152, 576)]
ROWS = (1, 2, 4, 8)


def main() -> None:
    if not amx_linear.available():
        raise SystemExit("edgebuild's AMX int4 kernel does not run here (see the log line)")
    ours, theirs = [], []
    for n, k in SHAPES:
        codes, sz = quantize_int4(torch.randn(n, k) * 0.05)
        ours.append((k, amx_linear.pack(codes, sz)))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        theirs.append((k, (packed, sz.to(torch.bfloat16))))
    xs = {k: {m: torch.randn(m, k).bfloat16() for m in ROWS} for k in (576, 1536)}
    res: dict = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for _ in range(7):
            for m in ROWS:
                t = time.perf_counter()
                for k, (w, sc) in ours:
                    amx_linear.linear(xs[k][m], w, sc)
                res.setdefault(("amx", threads, m), []).append(time.perf_counter() - t)
                t = time.perf_counter()
                for k, (w, sz) in theirs:
                    torch.ops.aten._weight_int4pack_mm_for_cpu(xs[k][m], w, INT4_GROUP_SIZE, sz)
                res.setdefault(("torch", threads, m), []).append(time.perf_counter() - t)
    print("| threads | rows | torch's kernel | edgebuild AMX kernel | torch / AMX |")
    print("|---|---|---|---|---|")
    for threads in (1, 2):
        for m in ROWS:
            a = sorted(res[("amx", threads, m)])[3] * 1e3
            b = sorted(res[("torch", threads, m)])[3] * 1e3
            print(f"| {threads} | {m} | {b:.2f} | {a:.2f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
