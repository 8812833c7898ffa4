#!/usr/bin/env python3
"""GPU check of issue 27's "head once in the engines" (called by ``scripts/gpu_check.sh --refit``).

A TensorRT engine embeds its weights, so a bundle's draft engine holds its own copy of the
target's embedding / ``lm_head`` although the ONNX graphs store them once
(``base/shared.onnx.data``). This check builds the draft engine without them (weight-stripped,
those initializers refittable: :func:`edgebuild.engine.builder.strip_refittable`), refits it
from the bundle's own graph (``OnnxParserRefitter.refit_from_file`` on ``base/draft.onnx``,
whose external data include the shared file) and runs it against the engine with every weight
embedded. Portable graphs (no plugin library needed); ``tensorrt`` or ``tensorrt_rtx``.

Lines: ``PASS|FAIL|SKIP|TIME name: detail``.
1. ``export``: the pair (default: the SmolLM2 example and its shipped draft) as a portable fp32
   bundle, ``--onnx-only``.
2. ``build-embedded`` / ``build-stripped``: the two draft engines, sizes (TIME).
3. ``refit``: the stripped engine refitted from base/draft.onnx; no weight missing.
4. ``outputs``: both engines on the same inputs (batch 1, 8 context rows + the block):
   candidate ids equal, scores within ``--atol``.
5. ``bytes``: engine-file bytes saved against ``dspark.shared_bytes`` (reported). On the device
   the refit puts the weights back into the engine's own memory: the saving is on disk, not
   in device memory (docs/ARCHITECTURE.md).

``--plan`` (no GPU; what ``gpu_check.sh --dry-run`` runs): prints the steps and checks that the
installed builder exposes what they use (``BuilderFlag.REFIT_INDIVIDUAL`` / ``STRIP_PLAN``,
``INetworkDefinition.mark_weights_refittable``, ``Refitter``, ``OnnxParserRefitter``).
Exit status 1 when anything FAILed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
NEEDED = (
    "BuilderFlag.REFIT_INDIVIDUAL",
    "BuilderFlag.STRIP_PLAN",
    "Refitter",
    "OnnxParserRefitter",
)
FAILED = []


def line(kind: str, name: str, detail: str) -> None:
    if kind == "FAIL":
        FAILED.append(name)
    print(f"{kind} {name}: {detail}", flush=True)


def builder_module(name: str | None):
    """``tensorrt`` (preferred) or ``tensorrt_rtx``, or the one named; None if neither."""
    for candidate in [name] if name else ["tensorrt", "tensorrt_rtx"]:
        try:
            return importlib.import_module(candidate)
        except ImportError:
            continue
    return None


def plan(trt) -> None:
    """The steps, and whether the builder has what they use."""
    print("PLAN export -> build-embedded -> build-stripped -> refit -> outputs -> bytes")
    if trt is None:
        line("SKIP", "refit-api", "neither tensorrt nor tensorrt_rtx is importable")
        return
    missing = []
    for path in NEEDED:
        obj = trt
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            missing.append(path)
    if not hasattr(trt.INetworkDefinition, "mark_weights_refittable"):
        missing.append("INetworkDefinition.mark_weights_refittable")
    if missing:
        line("FAIL", "refit-api", f"{trt.__name__} {trt.__version__} lacks {', '.join(missing)}")
    else:
        line("PASS", "refit-api", f"{trt.__name__} {trt.__version__} has {', '.join(NEEDED)}")


def export(args, work: Path) -> tuple[Path, dict]:
    from edgebuild.bundle.build import BuildOptions, build_bundle, recipe_from_flags

    recipe = recipe_from_flags(
        args.target, args.draft, max_batch_size=1, max_input_len=64, max_kv_cache_capacity=256
    )
    opts = BuildOptions(portable=True, onnx_only=True, dtype="float32", progress=False)
    result = build_bundle(recipe, work / "bundle", opts)
    return work / "bundle", result.manifest


def inputs_for(role: dict, manifest: dict):
    """Batch-1 inputs: 8 context rows at positions 0..7, the block after them, empty cache."""
    import torch

    from edgebuild.runtime.trt_plan import DTYPES

    n = manifest["dspark"]["block_size"]
    cap = manifest["build"]["max_kv_cache_capacity"]
    g = torch.Generator().manual_seed(0)
    out = {}
    for spec in role["inputs"]:
        name, dtype = spec["name"], DTYPES[spec["dtype"]]
        sizes = {"batch": 1, "context_len": 8, "kv_capacity": cap}
        shape = [d if isinstance(d, int) else sizes[d] for d in spec["dims"]]
        if name == "context_features":
            value = torch.randn(shape, generator=g).to(dtype)
        elif name == "context_positions":
            value = torch.arange(8, dtype=dtype)[None]
        elif name == "context_lengths":
            value = torch.tensor([8], dtype=dtype)
        elif name == "anchor_ids":
            value = torch.tensor([5], dtype=dtype)
        elif name == "block_positions":
            value = (8 + torch.arange(n, dtype=dtype))[None]
        else:  # past_lengths 0, empty KV caches
            value = torch.zeros(shape, dtype=dtype)
        out[name] = value.cuda()
    return out


def torch_dtype(trt, dtype):
    """The torch dtype of a TensorRT ``DataType``."""
    import torch

    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32,
             trt.int64: torch.int64, trt.bfloat16: torch.bfloat16, trt.bool: torch.bool}  # fmt: skip
    return table[dtype]


def run_engine(trt, engine, feeds: dict) -> dict:
    """One execution on ``feeds`` (CUDA tensors); every output, on the host."""
    import torch

    ctx = engine.create_execution_context()
    for name, value in feeds.items():
        ctx.set_input_shape(name, tuple(value.shape))
        ctx.set_tensor_address(name, value.data_ptr())
    outs = {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        if engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT:
            dtype = torch_dtype(trt, engine.get_tensor_dtype(name))
            outs[name] = torch.empty(tuple(ctx.get_tensor_shape(name)), dtype=dtype, device="cuda")
            ctx.set_tensor_address(name, outs[name].data_ptr())
    stream = torch.cuda.Stream()
    if not ctx.execute_async_v3(stream.cuda_stream):
        raise RuntimeError("execute_async_v3 returned False")
    stream.synchronize()
    return {k: v.cpu() for k, v in outs.items()}


def build_both(args, trt, bundle: Path, manifest: dict, work: Path) -> dict[str, Path]:
    from edgebuild.engine.builder import build_engine
    from edgebuild.recipe import BuildSettings

    role = manifest["roles"]["draft"]
    build = BuildSettings(
        **{k: v for k, v in manifest["build"].items() if k in BuildSettings.model_fields}
    )
    n = manifest["speculative"]["num_speculative_tokens"]
    paths = {}
    for kind, strip in (("embedded", ()), ("stripped", role["shared_initializers"])):
        t0 = time.perf_counter()
        path = work / f"draft-{kind}.engine"
        build_engine(bundle / role["onnx"], path, "draft", role["inputs"], build, n,
                     builder=trt.__name__, strip_weights=strip)  # fmt: skip
        line("TIME", f"build-{kind}", f"{path.stat().st_size / 1e6:.1f} MB engine, "
             f"{time.perf_counter() - t0:.0f} s (stripped: {list(strip)})")  # fmt: skip
        paths[kind] = path
    return paths


def refit(trt, engine, onnx_path: Path) -> bool:
    logger = trt.Logger(trt.Logger.WARNING)
    refitter = trt.Refitter(engine, logger)
    if not trt.OnnxParserRefitter(refitter, logger).refit_from_file(str(onnx_path)):
        line("FAIL", "refit", f"refit_from_file({onnx_path}) failed")
        return False
    missing = list(refitter.get_missing_weights())
    if missing or not refitter.refit_cuda_engine():
        line("FAIL", "refit", f"missing weights {missing} or refit_cuda_engine failed")
        return False
    line("PASS", "refit", f"refitted from {onnx_path.name} (+ its external data)")
    return True


def check(args, trt) -> None:
    import torch

    if not torch.cuda.is_available():
        line("SKIP", "refit", "no CUDA GPU visible to torch")
        return
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        work = Path(tmp)
        bundle, manifest = export(args, work)
        line("PASS", "export", f"portable fp32 bundle of {args.target.name}")
        paths = build_both(args, trt, bundle, manifest, work)
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        engines = {k: runtime.deserialize_cuda_engine(p.read_bytes()) for k, p in paths.items()}
        role = manifest["roles"]["draft"]
        if not refit(trt, engines["stripped"], bundle / role["onnx"]):
            return
        feeds = inputs_for(role, manifest)
        want, got = (run_engine(trt, engines[k], feeds) for k in ("embedded", "stripped"))
        same = torch.equal(want["draft_candidate_ids"], got["draft_candidate_ids"])
        diff = (want["draft_scores"] - got["draft_scores"]).abs().max().item()
        ok = same and diff <= args.atol
        line("PASS" if ok else "FAIL", "outputs", f"candidates equal: {same}, "
             f"max |score diff| {diff:.2e} (atol {args.atol})")  # fmt: skip
        saved = paths["embedded"].stat().st_size - paths["stripped"].stat().st_size
        shared = (manifest.get("dspark") or {}).get("shared_bytes", 0)
        line("TIME", "bytes", f"engine file {saved / 1e6:.1f} MB smaller; shared head/embedding "
             f"{shared / 1e6:.1f} MB (fp32 graph: x2 of a bf16 checkpoint's)")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--plan", action="store_true", help="no GPU: the steps and the builder API")
    ap.add_argument("--builder", choices=["tensorrt", "tensorrt_rtx"], default=None)
    ap.add_argument("--target", type=Path, default=ROOT / "examples" / "smollm2-135m")
    ap.add_argument(
        "--draft", type=Path, default=ROOT / "edgebuild" / "data" / "smollm2-135m-dspark"
    )
    ap.add_argument("--atol", type=float, default=1e-3)
    ap.add_argument("--work-dir", type=Path, default=None)
    args = ap.parse_args()
    trt = builder_module(args.builder)
    plan(trt)
    if not args.plan and trt is not None:
        try:
            check(args, trt)
        except Exception as exc:  # noqa: BLE001 - a device check reports, then exits 1
            line("FAIL", "refit-check", f"{type(exc).__name__}: {exc}")
    print(json.dumps({"failed": FAILED}))
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
