"""The linears of one SmolLM2-135M step: edgebuild's AMX kernels against the fallbacks.

30 x (qkv 960x576, gate/up 3072x576, o 576x576, down 576x1536) + the 49152x576 lm_head,
random weights of the real shapes (int4: ~80 MB of codes, bf16: ~270 MB; mostly out of
cache, as in a step), bf16 activations of 1, 2, 4 and 8 rows, at 1 and 2 threads; median ms
per step of 7 interleaved rounds, printed as the markdown rows of bench/README.md:

- int4: edgebuild's AMX kernel against torch's ``_weight_int4pack_mm_for_cpu``;
- bf16: edgebuild's AMX kernel against oneDNN's packed linear (``mkldnn._linear_pointwise``,
  one row run as a 2-row call, as the runtime did before: oneDNN is not row-invariant at 1).

Needs a CPU with AMX-BF16 (the kernels' requirement). Not run in CI.

    python bench/amx_linear.py [--kinds int4 bf16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgebuild.ops import amx_linear  # noqa: E402
from edgebuild.ops.linear import INT4_GROUP_SIZE, quantize_int4  # noqa: E402

SHAPES = [(960, 576), (3072, 576), (576, 576), (576, 1536)] * 30 + [(49152, 576)]
ROWS = (1, 2, 4, 8)


def _int4_calls():
    """(ours, theirs): per shape (k, fn(x)) for the AMX kernel and torch's."""
    ours, theirs = [], []
    for n, k in SHAPES:
        codes, sz = quantize_int4(torch.randn(n, k) * 0.05)
        w, sc = amx_linear.pack(codes, sz)
        ours.append((k, lambda x, w=w, sc=sc: amx_linear.linear(x, w, sc)))
        p, s = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), sz.bfloat16()
        theirs.append(
            (k, lambda x, p=p, s=s: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, 32, s))
        )
    assert INT4_GROUP_SIZE == 32
    return ours, theirs


def _bf16_calls():
    """(ours, theirs): per shape (k, fn(x)) for the AMX bf16 kernel and oneDNN's."""
    ours, theirs = [], []
    for n, k in SHAPES:
        w = (torch.randn(n, k) * 0.05).bfloat16()
        pw = amx_linear.pack_bf16(w)
        ours.append((k, lambda x, pw=pw: amx_linear.linear_bf16(x, pw)))
        ow = torch.ops.mkldnn._reorder_linear_weight(w, 1)

        def onednn(x, ow=ow):
            x2 = x.repeat(2, 1) if x.shape[0] == 1 else x
            return torch.ops.mkldnn._linear_pointwise(x2, ow, None, "none", [], "")

        theirs.append((k, onednn))
    return ours, theirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", choices=("int4", "bf16"), default=["int4", "bf16"])
    args = ap.parse_args()
    if not amx_linear.available():
        raise SystemExit("edgebuild's AMX kernels do not run here (see the log line)")
    fallback = {"int4": "torch's kernel", "bf16": "oneDNN"}
    for kind in args.kinds:
        ours, theirs = _int4_calls() if kind == "int4" else _bf16_calls()
        xs = {k: {m: torch.randn(m, k).bfloat16() for m in ROWS} for k in (576, 1536)}
        res: dict = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for _ in range(7):
                for m in ROWS:
                    for name, calls in (("amx", ours), ("fallback", theirs)):
                        t = time.perf_counter()
                        for k, fn in calls:
                            fn(xs[k][m])
                        res.setdefault((name, threads, m), []).append(time.perf_counter() - t)
        print(f"\n{kind}: ms per step")
        print(f"| threads | rows | {fallback[kind]} | edgebuild AMX kernel | ratio |")
        print("|---|---|---|---|---|")
        for threads in (1, 2):
            for m in ROWS:
                a = sorted(res[("amx", threads, m)])[3] * 1e3
                b = sorted(res[("fallback", threads, m)])[3] * 1e3
                print(f"| {threads} | {m} | {b:.2f} | {a:.2f} | {b / a:.2f} |")
        del ours, theirs


if __name__ == "__main__":
    main()
