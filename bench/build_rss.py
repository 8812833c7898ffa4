"""Peak RSS and wall time of ``edgebuild build --onnx-only`` (weights are streamed, not held).

Measures two builds, each in its own child process (peak RSS = the child's ``ru_maxrss``):

1. the example model, SmolLM2-135M-Instruct BF16 (``examples/smollm2-135m``);
2. a synthetic Llama checkpoint of >= 2 GB (BF16, random weights, one safetensors shard per
   layer) written by this script first, layer by layer.

The exporter traces the graph on meta weights and then streams every tensor from the
checkpoint into the external data file, so the peak should stay well below the checkpoint
size (torch's own import costs a few hundred MB).

Usage::

    python bench/build_rss.py [--work /tmp/edgebuild-bench] [--skip-synthetic] [--keep]

Prints one markdown table (paste it into bench/README.md) and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# 22 layers x ~90 MB + 2 x 131 MB (embedding, untied head) = ~2.2 GB in BF16
SYNTHETIC = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    rope_theta=10000.0,
)


def write_synthetic(out: Path) -> int:
    """Write the synthetic checkpoint (one shard per layer); returns its size in bytes."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    c = SYNTHETIC
    d, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = d // c["num_attention_heads"] * c["num_key_value_heads"]
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    weight_map: dict[str, str] = {}

    def shard(name: str, tensors: dict) -> None:
        save_file(tensors, str(out / name))
        weight_map.update(dict.fromkeys(tensors, name))

    shard("embed.safetensors", {"model.embed_tokens.weight": rnd(v, d)})
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        shard(
            f"layer-{layer:03d}.safetensors",
            {
                f"{p}.self_attn.q_proj.weight": rnd(d, d),
                f"{p}.self_attn.k_proj.weight": rnd(kv, d),
                f"{p}.self_attn.v_proj.weight": rnd(kv, d),
                f"{p}.self_attn.o_proj.weight": rnd(d, d),
                f"{p}.mlp.gate_proj.weight": rnd(i, d),
                f"{p}.mlp.up_proj.weight": rnd(i, d),
                f"{p}.mlp.down_proj.weight": rnd(d, i),
                f"{p}.input_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
                f"{p}.post_attention_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
            },
        )
    shard(
        "head.safetensors",
        {"model.norm.weight": torch.ones(d, dtype=torch.bfloat16), "lm_head.weight": rnd(v, d)},
    )
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(c, indent=2))
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def measure(args: list[str]) -> dict:
    """Run ``edgebuild`` in a fresh child; peak RSS is that child's ``ru_maxrss``."""
    probe = textwrap.dedent(
        """
        import json, resource, subprocess, sys, time
        t0 = time.perf_counter()
        rc = subprocess.run(sys.argv[1:]).returncode
        wall = time.perf_counter() - t0
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        print(json.dumps({"rc": rc, "wall_s": wall, "peak_rss": rss}))
        """
    )
    edgebuild = shutil.which("edgebuild") or str(Path(sys.executable).parent / "edgebuild")
    out = subprocess.run(
        [sys.executable, "-c", probe, edgebuild, *args], capture_output=True, text=True
    )
    line = out.stdout.strip().splitlines()[-1]
    result = json.loads(line)
    if result["rc"] != 0:
        raise SystemExit(f"edgebuild {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return result


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/edgebuild-bench"))
    parser.add_argument("--skip-synthetic", action="store_true")
    parser.add_argument("--keep", action="store_true", help="Keep the checkpoint and bundles.")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    smollm2 = ROOT / "examples" / "smollm2-135m"
    if not smollm2.is_dir():
        subprocess.run(["edgebuild", "example", "prepare", "--no-nvfp4"], check=True, cwd=ROOT)
    cases = [("SmolLM2-135M BF16", smollm2)]
    if not args.skip_synthetic:
        synthetic = args.work / "synthetic-llama-2g"
        if not (synthetic / "config.json").is_file():
            t0 = time.perf_counter()
            size = write_synthetic(synthetic)
            print(f"wrote {synthetic} ({size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s")
        cases.append(("synthetic Llama 22 layers BF16", synthetic))
    for label, ckpt in cases:
        out = args.work / f"bundle-{ckpt.name}"
        shutil.rmtree(out, ignore_errors=True)
        result = measure(["build", str(ckpt), "-o", str(out), "--onnx-only", "--no-progress"])
        size = checkpoint_bytes(ckpt)
        data = sum(f.stat().st_size for f in out.rglob("*.data"))
        rows.append(
            {
                "checkpoint": label,
                "checkpoint_gib": round(size / 2**30, 3),
                "onnx_data_gib": round(data / 2**30, 3),
                "peak_rss_gib": round(result["peak_rss"] / 2**30, 3),
                "rss_over_checkpoint": round(result["peak_rss"] / size, 3),
                "wall_s": round(result["wall_s"], 1),
            }
        )
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    if not args.keep and not args.skip_synthetic:
        shutil.rmtree(args.work / "synthetic-llama-2g", ignore_errors=True)
    print(
        "| checkpoint | checkpoint GiB | ONNX data GiB | peak RSS GiB | RSS / checkpoint | wall s |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['checkpoint']} | {r['checkpoint_gib']} | {r['onnx_data_gib']} | "
            f"{r['peak_rss_gib']} | {r['rss_over_checkpoint']} | {r['wall_s']} |"
        )
    print(json.dumps({"cpu_count": os.cpu_count(), "rows": rows}))


if __name__ == "__main__":
    main()
