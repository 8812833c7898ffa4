#!/usr/bin/env python3
"""GPU check of the TensorRT runtime backend (called by scripts/gpu_check.sh).

Needs a CUDA GPU visible to torch, the ``tensorrt`` module, the plugin library built for this
GPU, and the SmolLM2 example pair (``edgebuild example prepare``; the DSpark draft shipped in
``edgebuild/data``). Builds BF16 engines for the local GPU (and NVFP4 ones on SM >= 100), then
prints one line per check: ``PASS|FAIL|SKIP|TIME name: detail``.

Checks
1. ``select``: ``--backend auto`` picks tensorrt for the fresh bundle.
2. ``greedy-target``: greedy output of the base engine equals the torch backend (fp32, CPU).
   BF16 engines may leave the fp32 path on a near tie: a divergence counts as PASS only when
   the torch logits of the two tokens differ by less than ``--tie-gap`` at that position.
3. ``greedy-dspark``: DSpark on the engines is lossless (equals engine target-only, tie rule).
4. ``acceptance``: DSpark mean accepted length and acceptance by position, engines vs torch
   (equal when the outputs are equal; else within ``--tau-tol``).
5. ``cuda-graphs``: the same DSpark run with CUDA graphs off gives the same tokens; counts of
   captures and replays.
6. ``speed``: decode tokens/s on the engines, target-only and DSpark (batch 1), and the torch
   backend's for reference.
7. ``nvfp4``: 2-3 on NVFP4 engines (SM >= 100 only: FP4 tensor cores).

Sized for about 8 minutes on one H200 (``--budget-s``): later checks are SKIPped when the
budget is spent. Exit status 1 when any check FAILed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of a paperclip.",
]
FAILED: list[str] = []
START = time.perf_counter()


def line(kind: str, name: str, detail: str = "") -> None:
    print(f"{kind} {name}: {detail}", flush=True)
    if kind == "FAIL":
        FAILED.append(name)


def out_of_time(args, name: str) -> bool:
    if time.perf_counter() - START > args.budget_s:
        line("SKIP", name, f"time budget of {args.budget_s} s spent")
        return True
    return False


def preconditions(args) -> str | None:
    """Why nothing can run here (None: everything needed is present)."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    try:
        import tensorrt  # noqa: F401
    except ImportError as exc:
        return f"tensorrt is not importable ({exc})"
    if args.plugin_library is None or not args.plugin_library.is_file():
        from edgebuild.engine.plugin_library import PLUGIN_BUILD_HINT

        return f"plugin library {args.plugin_library} not built ({PLUGIN_BUILD_HINT})"
    if not (args.target / "config.json").is_file():
        return f"{args.target} missing: run `edgebuild example prepare`"
    return None


def build(args, target: Path, precision: str, out: Path) -> Path:
    """A bundle with engines for this GPU (the test GPU need not be the recipe's Jetson)."""
    import edgebuild.engine.builder as builder
    from edgebuild.bundle.build import BuildOptions, build_bundle, recipe_from_flags

    # engines are built for the local GPU and the manifest records its SM (engines.sm)
    builder.check_local_device = lambda *a, **k: None
    draft = args.draft if (args.draft / "config.json").is_file() else None
    recipe = recipe_from_flags(
        target, draft, device="thor", precision=precision,
        num_speculative_tokens=args.n if draft else None,
        max_batch_size=2, max_input_len=256, max_kv_cache_capacity=1024, page_size=32,
    )  # fmt: skip
    t0 = time.perf_counter()
    build_bundle(
        recipe, out, BuildOptions(plugin_library=args.plugin_library, progress=False, force=True)
    )
    line("TIME", f"build-{precision}", f"{time.perf_counter() - t0:.1f} s (export + engines)")
    return out


def generate(llm, decoder, max_tokens: int):
    """Greedy generation of PROMPTS with ``decoder``; (output ids, merged metrics, wall s)."""
    from edgebuild.runtime.decoding import RequestState, run_to_completion
    from edgebuild.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    states = [
        RequestState.create(f"r{i}", llm.encode(p, chat=True), params)
        for i, p in enumerate(PROMPTS)
    ]
    t0 = time.perf_counter()
    run_to_completion(decoder, states)
    wall = time.perf_counter() - t0
    metrics = states[0].metrics
    for st in states[1:]:
        metrics = metrics.merge(st.metrics)
    return [st.output_ids for st in states], metrics, wall


def torch_logits(ref_llm, ids: list[int]):
    """fp32 logits of the next token after ``ids`` on the torch backend."""
    import torch

    seq = ref_llm.target.new_sequence()
    try:
        out = ref_llm.target.forward([seq], [torch.tensor(ids)], [[len(ids) - 1]])
        return out.logits[0][-1]
    finally:
        ref_llm.target.free(seq)


def compare(name: str, ref_llm, prompt_ids, want, got, tie_gap: float) -> bool:
    """PASS when equal, or when the first divergence is a near tie on the torch logits."""
    notes = []
    for p, w, g in zip(prompt_ids, want, got, strict=True):
        if w == g:
            continue
        i = next((k for k, (a, b) in enumerate(zip(w, g, strict=False)) if a != b), None)
        if i is None:
            line("FAIL", name, f"lengths differ: {len(w)} vs {len(g)}")
            return False
        logits = torch_logits(ref_llm, p + w[:i])
        gap = float(logits[w[i]] - logits[g[i]])
        if gap >= tie_gap:
            line("FAIL", name, f"token {i}: torch {w[i]} vs engines {g[i]}, logit gap {gap:.3f}")
            return False
        notes.append(f"near tie at token {i} (gap {gap:.3f})")
    line("PASS", name, "identical" if not notes else "; ".join(notes))
    return True


def check_bundle(args, bundle: Path, tag: str, timing: bool) -> None:
    """Checks 1-6 on one bundle (module docstring)."""
    from edgebuild.runtime.decoding import TargetOnlyDecoder
    from edgebuild.runtime.llm import LLM
    from edgebuild.runtime.select import select_backend

    choice = select_backend("auto", bundle)
    line("PASS" if choice.name == "tensorrt" else "FAIL", f"select-{tag}", choice.reason)
    ref = LLM(bundle, backend="torch")
    if ref.speculative is not None and ref.speculative.token_map is not None:
        # the engines' draft drafts over the whole vocabulary: so does the reference (check 4)
        import dataclasses

        spec = dataclasses.replace(ref.speculative, token_map=None)
        ref = LLM(bundle, backend="torch", speculative=spec)
    eng = LLM(bundle, backend="tensorrt")
    prompt_ids = [ref.encode(p, chat=True) for p in PROMPTS]
    want, _, ref_wall = generate(ref, TargetOnlyDecoder(ref.target), args.max_tokens)
    got, eng_metrics, _ = generate(eng, TargetOnlyDecoder(eng.target), args.max_tokens)
    compare(f"greedy-target-{tag}", ref, prompt_ids, want, got, args.tie_gap)
    import torch

    peak = torch.cuda.max_memory_allocated() / 2**20
    line("TIME", f"memory-{tag}", f"{peak:.0f} MiB torch peak (buffers, KV pools, graphs)")
    if eng.draft is None:
        line("SKIP", f"greedy-dspark-{tag}", f"no draft at {args.draft}")
        return
    engine_bytes(bundle, tag)
    if out_of_time(args, f"greedy-dspark-{tag}"):
        return
    got_d, eng_d, _ = generate(eng, eng.decoder, args.max_tokens)
    compare(f"greedy-dspark-{tag}", ref, prompt_ids, got, got_d, args.tie_gap)
    want_d, ref_d, _ = generate(ref, ref.decoder, args.max_tokens)
    tau_e, tau_r = eng_d.tau, ref_d.tau
    ok = (got_d == want_d and tau_e == tau_r) or abs(tau_e - tau_r) <= args.tau_tol * tau_r + 0.05
    line(
        "PASS" if ok else "FAIL",
        f"acceptance-{tag}",
        f"tau engines {tau_e:.3f} vs torch {tau_r:.3f}; by position engines "
        f"{[round(x, 3) for x in eng_d.acceptance_by_position]} torch "
        f"{[round(x, 3) for x in ref_d.acceptance_by_position]}",
    )
    runners = [eng.target.runner, eng.draft.runner]
    caps = sum(r.graphs.captures for r in runners)
    reps = sum(r.graphs.replays for r in runners)
    for r in runners:
        r.graphs.enabled, r.graphs.graphs = False, {}
    no_graph, _, _ = generate(eng, eng.decoder, args.max_tokens)
    for r in runners:
        r.graphs.enabled = True
    line(
        "PASS" if no_graph == got_d else "FAIL",
        f"cuda-graphs-{tag}",
        f"{caps} captures, {reps} replays; output with graphs off "
        + ("identical" if no_graph == got_d else "differs"),
    )
    if timing and not out_of_time(args, f"speed-{tag}"):
        speed(args, eng, ref_wall, want)


def engine_bytes(bundle: Path, tag: str) -> None:
    """Issue 27: how many bytes of the target's head / embedding each engine holds.

    The ONNX graphs store them once (base/shared.onnx.data); a TensorRT engine embeds its
    weights, so today the draft engine carries a second copy. Reported, not failed: the
    ``draft-engine-head-copy`` line says how much holding it once (a weight-stripped,
    refittable draft engine refitted from the shared file) would save on the device.
    """
    import json

    m = json.loads((bundle / "manifest.json").read_text())
    shared = (m.get("dspark") or {}).get("shared_bytes", 0)
    sizes = {
        r: (bundle / e["engine"]).stat().st_size for r, e in m["roles"].items() if e.get("engine")
    }
    own = m["files"].get(m["roles"]["draft"]["onnx_data"], {}).get("size", 0)
    extra = sizes.get("draft", 0) - own
    line(
        "TIME",
        f"draft-engine-head-copy-{tag}",
        f"engines {', '.join(f'{r} {b / 1e6:.1f} MB' for r, b in sorted(sizes.items()))}; draft's own "
        f"weights {own / 1e6:.1f} MB, shared head/embedding {shared / 1e6:.1f} MB; the draft "
        f"engine holds {extra / 1e6:.1f} MB beyond its own weights",
    )


def speed(args, eng, ref_wall: float, ref_out) -> None:
    """Decode tokens/s, batch 1, target-only vs DSpark on the engines."""
    from edgebuild.runtime.decoding import RequestState, TargetOnlyDecoder, run_to_completion
    from edgebuild.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.speed_tokens, temperature=0.0, ignore_eos=True)
    rates = {}
    for name, dec in (("target-only", TargetOnlyDecoder(eng.target)), ("dspark", eng.decoder)):
        for _ in range(2):  # the first run captures the CUDA graphs
            st = RequestState.create("s", eng.encode(PROMPTS[0], chat=True), params)
            t0 = time.perf_counter()
            run_to_completion(dec, [st])
            wall = time.perf_counter() - t0
        rates[name] = st.metrics.tokens_per_s
        extra = f", tau {st.metrics.tau:.2f}" if name == "dspark" else ""
        line(
            "TIME",
            f"decode-{name}",
            f"{rates[name]:.1f} tok/s decode ({st.metrics.generated / wall:.1f} with prefill; "
            f"batch 1{extra})",
        )
    torch_rate = sum(len(o) for o in ref_out) / ref_wall
    line("TIME", "decode-torch-cpu", f"{torch_rate:.1f} tok/s (3 prompts batched, reference)")
    line("TIME", "dspark-speedup", f"x{rates['dspark'] / rates['target-only']:.2f}")


def main() -> int:
    from edgebuild.engine.plugin_library import plugin_library_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", type=Path, default=ROOT / "examples" / "smollm2-135m")
    ap.add_argument("--nvfp4-target", type=Path, default=ROOT / "examples" / "smollm2-135m-nvfp4")
    ap.add_argument(
        "--draft", type=Path, default=ROOT / "edgebuild" / "data" / "smollm2-135m-dspark"
    )
    ap.add_argument("--plugin-library", type=Path, default=plugin_library_path())
    ap.add_argument("--n", type=int, default=7, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--speed-tokens", type=int, default=128)
    ap.add_argument("--tie-gap", type=float, default=0.25)
    ap.add_argument("--tau-tol", type=float, default=0.10)
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--work-dir", type=Path, default=None)
    args = ap.parse_args()

    if args.plugin_library is not None:  # what the TensorRT backend loads (edgebuild.doctor)
        os.environ["EDGEBUILD_PLUGIN_LIB"] = str(args.plugin_library)
    reason = preconditions(args)
    if reason:
        line("SKIP", "tensorrt-backend", reason)
        return 0
    import torch

    major, minor = torch.cuda.get_device_capability()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="eb_gpu_check_"))
    runs = [("bf16", args.target, True)]
    if major >= 10 and (args.nvfp4_target / "config.json").is_file():
        runs.append(("nvfp4", args.nvfp4_target, False))
    else:
        line("SKIP", "nvfp4", f"sm_{major}{minor} < sm_100 or no {args.nvfp4_target}")
    for tag, target, timing in runs:
        if out_of_time(args, f"build-{tag}"):
            continue
        try:
            bundle = build(args, target, tag, work / f"bundle-{tag}")
            check_bundle(args, bundle, tag, timing)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next precision
            traceback.print_exc()
            line("FAIL", f"engines-{tag}", f"{type(exc).__name__}: {exc}")
    line("TIME", "total", f"{time.perf_counter() - START:.1f} s")
    print(f"gpu_check_engines: {len(FAILED)} FAILED" if FAILED else "gpu_check_engines: ALL PASS")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
