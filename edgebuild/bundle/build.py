"""``edgebuild build``: recipe (or checkpoint + flags) -> validated -> ONNX -> engines -> bundle.

Stages, each finished before the next starts:

1. **Validate** (:func:`plan_build`): open the checkpoints, parse and check the target, pair
   the draft with it (hidden size, vocab, taps, mask id, heads, fc width, block size), check
   the recipe's precision against the stored formats and the device (NVFP4 / FP8 weights on
   Orin are refused); for a vision-language target (config with ``vision_config``) check its
   ``visual.*`` tensors and ``build.max_image_tokens``. Nothing is exported before all of
   this passes.
2. **Export** (:mod:`edgebuild.export`): ``base`` (with the draft's taps), ``draft`` and, for a
   VLM target, ``visual`` (the vision tower, always standard ops) graphs into a temporary
   directory next to the output, weights streamed tensor by tensor.
3. **Engines** (:mod:`edgebuild.engine`): unless ``onnx_only``, one per role (the ``visual``
   profile from ``max_image_tokens`` / ``max_images``); without TensorRT the build stops
   after ONNX and says so (the manifest records why no engine was built).
4. **Bundle**: configs and tokenizer files copied, ``manifest.json`` written last, then the
   temporary directory is renamed to the output. An interrupted build leaves only a
   ``.NAME.partial-PID`` directory without a manifest, which nothing accepts as a bundle; a
   build killed hard cannot remove it, so the next build of that output does.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edgebuild.bundle.manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    dumps,
    file_record,
    source_record,
    stale_staging,
)
from edgebuild.checkpoint.config import ModelConfig
from edgebuild.checkpoint.draft import pair_draft
from edgebuild.checkpoint.hub import ModelSource
from edgebuild.checkpoint.pairing import PairedSources
from edgebuild.checkpoint.quant import QuantAlgo
from edgebuild.checkpoint.source import COMPONENT, WeightSource
from edgebuild.errors import BundleError, ConfigError, MissingDependencyError
from edgebuild.models.dspark import read_dspark_field
from edgebuild.models.vision import VISION_PREFIX, VisionConfig
from edgebuild.recipe import (
    MAX_SPECULATIVE_TOKENS,
    BuildSettings,
    ModelRef,
    Precision,
    Recipe,
    SpeculativeSettings,
)
from edgebuild.speculative.registry import get_method

log = logging.getLogger("edgebuild.bundle")
PROGRESS_LOG_S = 30.0  # a long stage logs its progress (and ETA) this often

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
_PRECISION_DTYPE = {Precision.BF16: "bfloat16", Precision.FP16: "float16"}
_PRECISION_FORMATS = {
    Precision.NVFP4: {QuantAlgo.NVFP4},
    Precision.FP8: {QuantAlgo.FP8, QuantAlgo.FP8_BLOCK},
}


@dataclass(frozen=True)
class BuildOptions:
    """How to build (the *what* is the recipe).

    Attributes:
        onnx_only: stop after the ONNX graphs.
        portable: standard-op graphs (no plugin; onnxruntime / TensorRT-RTX) instead of
            plugin graphs.
        builder: ``tensorrt`` (Jetson) or ``tensorrt_rtx`` (portable graphs, CPU checks).
        plugin_library: the plugin ``.so`` (default: ``$EDGEBUILD_PLUGIN_LIB`` or the
            repository's plugin build directory).
        timing_cache: TensorRT timing cache file, read and updated (kept outside the bundle).
        dtype: activation dtype override (``float32`` for CPU parity checks); default from
            ``build.precision`` (bf16 / fp16), or the checkpoint's dtype for nvfp4 / fp8.
        force: replace an existing output directory.
        progress: show progress bars.
        on_stage: called with each stage's name as it starts (``export base``, ``engine
            base``, ...): the server's ``/health`` reports it.
    """

    onnx_only: bool = False
    portable: bool = False
    builder: str = "tensorrt"
    plugin_library: Path | None = None
    timing_cache: Path | None = None
    dtype: str | None = None
    force: bool = False
    progress: bool = True
    on_stage: Callable[[str], None] | None = field(default=None, compare=False)


@dataclass
class BuildPlan:
    """Everything validated in stage 1 (sources opened, configs parsed).

    ``vision`` is the target's vision tower config when it is a VLM (the bundle then gets a
    ``visual`` role), else None.
    """

    recipe: Recipe
    target: WeightSource
    target_config: ModelConfig
    pair: PairedSources | None
    draft_config: object | None
    weights: str  # WeightMode value
    dtype: str | None
    formats: tuple[str, ...]
    vision: VisionConfig | None = None
    hub: dict[str, dict] | None = None  # role -> the manifest's sources.<role>.hub entry
    shared_bytes: int = 0  # checkpoint bytes of the target tensors the draft borrows (stored once)


def _formats(source: WeightSource) -> set[QuantAlgo]:
    q = source.quant
    found = {q.algo, *q.per_layer.values()}
    return {f for f in found if f not in (QuantAlgo.NONE, QuantAlgo.MIXED_PRECISION)}


def recipe_from_flags(
    ckpt: Path,
    draft: Path | None,
    *,
    device: str = "thor",
    precision: str | None = None,
    num_speculative_tokens: int | None = None,
    draft_top_k: int | None = None,
    confidence_threshold: float = 0.0,
    name: str | None = None,
    **build: int,
) -> Recipe:
    """A :class:`Recipe` for ``edgebuild build CKPT [--draft D]`` and its flags.

    ``precision`` defaults to the checkpoint's (nvfp4 / fp8 when quantized, else bf16 or fp16
    from its dtype); ``num_speculative_tokens`` to the draft's ``block_size`` (at most 16; read
    where :class:`~edgebuild.models.dspark.DSparkConfig` reads it: top level, ``dspark_config``
    or ``dflash_config``);
    ``draft_top_k`` to the draft's ``markov_topk`` (else 16, see
    :func:`edgebuild.speculative.config.default_draft_top_k`).
    ``build`` holds the other ``build:`` keys (``max_batch_size``, ``max_input_len``, ...).
    ``name`` is the bundle's name (default: the checkpoint folder's name; a Hub id's name for
    a snapshot).

    Raises:
        ConfigError: a bad flag value (as :meth:`Recipe.validate` names it), an unreadable
            checkpoint config.
    """
    ckpt = Path(ckpt).resolve()
    source = WeightSource(ckpt)
    if precision is None:
        formats = _formats(source)
        if QuantAlgo.NVFP4 in formats:
            precision = "nvfp4"
        elif formats & {QuantAlgo.FP8, QuantAlgo.FP8_BLOCK}:
            precision = "fp8"
        else:
            dtype = source.config.get("torch_dtype") or source.config.get("dtype")
            precision = "fp16" if dtype == "float16" else "bf16"
    spec = None
    if draft is not None:
        from edgebuild.speculative.config import default_draft_top_k, read_draft_config

        if num_speculative_tokens is not None and draft_top_k is not None:
            dcfg = None
        else:  # the defaults come from the draft's config.json, read once
            dcfg = read_draft_config(Path(draft))
        if num_speculative_tokens is None:
            path = Path(draft) / "config.json"
            block, _ = read_dspark_field(dcfg, "block_size", int, str(path))  # as DSparkConfig
            num_speculative_tokens = min(block, MAX_SPECULATIVE_TOKENS)
        if draft_top_k is None:
            draft_top_k = default_draft_top_k(Path(draft), dcfg)
        spec = SpeculativeSettings(
            num_speculative_tokens=num_speculative_tokens,
            draft_top_k=draft_top_k,
            confidence_threshold=confidence_threshold,
        )
    try:
        recipe = Recipe(
            name=name or ckpt.name,
            target=ModelRef(path=str(ckpt)),
            draft=ModelRef(path=str(Path(draft).resolve())) if draft is not None else None,
            speculative=spec,
            build=BuildSettings(device=device, precision=precision, **build),
            source=Path("<command line>"),
        )
    except ValueError as exc:  # pydantic validation
        raise ConfigError(f"build flags: {exc}") from None
    return recipe.validate()


# modules of the `export` extra (pyproject.toml) that building imports
_EXPORT_MODULES = ("onnx", "onnxscript", "onnx_ir")


def require_export_extra() -> None:
    """Check that the ``export`` extra is installed before anything imports it.

    Raises:
        MissingDependencyError: naming the missing module and ``pip install 'edgebuild[export]'``.
    """
    import importlib

    for name in _EXPORT_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise MissingDependencyError(
                f"building a bundle exports ONNX graphs, which needs the '{name}' module "
                f"({exc}); install the export extra: pip install 'edgebuild[export]'"
            ) from None


def plan_build(recipe: Recipe, options: BuildOptions) -> BuildPlan:
    """Stage 1: open and validate everything before any export work.

    Raises:
        CheckpointError / PairingError / QuantFormatError: bad or mismatched checkpoints
            (a VLM target's ``visual.*`` tensors included).
        MissingDependencyError: the ``export`` extra is not installed.
        ConfigError: precision vs stored formats, NVFP4 / FP8 on Orin, block size, an rnn
            Markov head (no engine form), a builder that cannot take the graphs, a VLM
            target's ``build.max_image_tokens`` above ``build.max_input_len``.
    """
    from edgebuild.engine import BUILDERS, check_device_formats

    require_export_extra()
    from edgebuild.export.exporter import meta_draft, meta_target
    from edgebuild.export.graphs import DraftGraph, GraphKind

    if options.builder not in BUILDERS:
        raise ConfigError(f"unknown engine builder {options.builder!r}; use one of {BUILDERS}")
    if options.builder == "tensorrt_rtx" and not options.portable and not options.onnx_only:
        from edgebuild.engine.plugin_library import TENSORRT_RTX_PLUGIN_LIMIT

        raise ConfigError(
            f"builder tensorrt_rtx with plugin graphs: {TENSORRT_RTX_PLUGIN_LIMIT}; "
            "use --portable with it (or build plugin graphs with TensorRT on the Jetson)"
        )
    b = recipe.build
    target = WeightSource(recipe.resolve(recipe.target), COMPONENT)
    tcfg = ModelConfig.from_dict(target.config, source=str(target.config_path))
    meta_target(target, torch.float32)  # checks every tensor against the config
    vision = _plan_visual(recipe, target, tcfg)
    formats = _formats(target)
    weights, dtype = "native", options.dtype or _PRECISION_DTYPE.get(b.precision)
    if b.precision in _PRECISION_FORMATS:
        if not formats & _PRECISION_FORMATS[b.precision]:
            raise ConfigError(
                f"{recipe.source}: build.precision is {b.precision.value!r} but the target "
                f"{target.path} is not stored in that format ({target.quant.algo.value}); "
                f"quantize it first (`edgebuild quantize {target.path} --quant "
                f"{b.precision.value}`) or set build.precision to bf16"
            )
        check_device_formats(b.device, [f.value for f in formats], str(target.path))
    elif formats:
        weights = "dense"  # bf16 / fp16 engine from a quantized checkpoint: dequantize
        log.info(
            "%s: %s weights are dequantized for a %s engine", target.path, formats, b.precision
        )
    pair = draft_cfg = None
    if recipe.draft is not None:
        # the one validation (pairing, config, tensors); the target's source is reused. Only
        # the pair and the config are kept: the resolved head's values are not held all build
        draft = pair_draft(target, recipe.resolve(recipe.draft), tcfg)
        pair, draft_cfg = draft.pair, draft.config
        del draft
        model = meta_draft(draft_cfg, torch.float32)
        n = recipe.speculative.num_speculative_tokens
        if n > draft_cfg.block_size:
            raise ConfigError(
                f"{recipe.source}: speculative.num_speculative_tokens {n} exceeds the draft's "
                f"block_size {draft_cfg.block_size} ({draft_cfg.source}); use 1..{draft_cfg.block_size}"
            )
        DraftGraph(
            model, GraphKind.PORTABLE, b.page_size, 1, max(1, recipe.speculative.draft_top_k)
        )
    shared = _shared_bytes(pair) if pair is not None else 0
    for source in (target, *((pair.draft, pair.target) if pair else ())):
        source.close()  # validation read quantized tensors through mmap: release the pages
    return BuildPlan(
        recipe,
        target,
        tcfg,
        pair,
        draft_cfg,
        weights,
        dtype,
        tuple(sorted(f.value for f in formats)),
        vision,
        shared_bytes=shared,
    )


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _shared_bytes(pair: PairedSources) -> int:
    """Stored bytes of the target tensors the draft borrows (head, embedding; an NVFP4 head
    with its scales), counted once when head and embedding are one tied tensor: what the
    draft graph does not copy (:class:`~edgebuild.export.weights.SharedWeights`)."""
    from edgebuild.checkpoint.quant import is_quant_aux_tensor

    names = {
        f.name
        for f in (pair.lm_head(), pair.embed_tokens())
        if f.checkpoint_source == pair.target.checkpoint_source
    }
    total = 0
    for name in names:
        prefix = name.rpartition(".")[0]
        for other in pair.target.names():  # the weight and its quantization side tensors
            if other == name or (other.startswith(prefix + ".") and is_quant_aux_tensor(other)):
                total += pair.target.info(other).nbytes
    if total:
        log.info("the draft reads %.1f MB of the target's head / embedding from the base's "
                 "shared.onnx.data instead of copying them", total / 1e6)  # fmt: skip
    return total


def _plan_visual(recipe: Recipe, target: WeightSource, tcfg: ModelConfig) -> VisionConfig | None:
    """A VLM target's vision config, its ``visual.*`` tensors and image limits checked."""
    from edgebuild.export.visual import meta_visual

    if tcfg.vision_config is None:
        return None
    vision = meta_visual(target, torch.float32).config
    b = recipe.build
    if b.max_image_tokens > b.max_input_len:
        raise ConfigError(
            f"{recipe.source}: field 'build.max_image_tokens' is {b.max_image_tokens}, more than "
            f"build.max_input_len ({b.max_input_len}), but image tokens are prompt tokens of "
            f"the VLM target {target.path}; fix: lower build.max_image_tokens to at most "
            f"{b.max_input_len} or raise build.max_input_len"
        )
    return vision


# ----------------------------------------------------------------------------- progress
class _Progress:
    """Progress of the build's stages: rich bars (``enabled``), and in the log a start line
    and an end line with the duration for every stage, plus a progress line with an ETA
    every :data:`PROGRESS_LOG_S` seconds where the stage counts bytes (export)."""

    def __init__(self, enabled: bool, on_stage: Callable[[str], None] | None = None):
        self._bar, self._task, self._on_stage = None, None, on_stage
        self._name, self._t0, self._total, self._done, self._logged = None, 0.0, None, 0, 0.0
        if enabled:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(
                TextColumn("{task.description:<28}"), BarColumn(), DownloadColumn(),
                TimeElapsedColumn(),
            )  # fmt: skip

    def __enter__(self):
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.stop()
        return False

    def stage(self, description: str, total_bytes: int | None = None) -> None:
        """Start a stage (``total_bytes`` None: an indeterminate bar)."""
        self._name, self._t0 = description, time.monotonic()
        self._total, self._done, self._logged = total_bytes, 0, self._t0
        log.info("build: %s ...", description)
        if self._on_stage is not None:
            self._on_stage(description)
        if self._bar is not None:
            self._task = self._bar.add_task(description, total=total_bytes)

    def advance(self, _name: str, nbytes: int) -> None:
        self._done += nbytes
        now = time.monotonic()
        if self._total and now - self._logged >= PROGRESS_LOG_S:
            self._logged, rate = now, self._done / max(now - self._t0, 1e-9)
            eta = (self._total - self._done) / rate if rate > 0 else float("nan")
            log.info(
                "build: %s %.0f%% (%.2f of %.2f GB), ETA %.0f s",
                self._name, 100 * self._done / self._total, self._done / 1e9, self._total / 1e9,
                eta,
            )  # fmt: skip
        if self._bar is not None and self._task is not None:
            self._bar.advance(self._task, nbytes)

    def done(self) -> None:
        log.info("build: %s done in %.1f s", self._name, time.monotonic() - self._t0)
        if self._bar is not None and self._task is not None:
            task = self._bar.tasks[-1]
            total = task.total if task.total is not None else 1
            self._bar.update(
                self._task, total=max(total, task.completed), completed=max(total, task.completed)
            )


# ----------------------------------------------------------------------------- build
def clean_stale_staging(out: Path) -> list[Path]:
    """Remove ``.NAME.partial-PID`` / ``.NAME.old-PID`` folders of killed builds of ``out``.

    A build stages into ``.NAME.partial-PID`` next to the output and removes it when it fails;
    a build killed hard (SIGKILL, power loss) cannot, so the next build of the same output
    removes the folders whose process no longer runs (:func:`stale_staging`). Folders of a
    running build are kept.

    Returns:
        The removed folders (each also logged at WARNING).
    """
    removed = []
    for path, pid in stale_staging(out):
        shutil.rmtree(path, ignore_errors=True)
        log.warning("removed %s, left by an interrupted build (process %s is gone)", path, pid)
        removed.append(path)
    return removed


@contextmanager
def _staging(out: Path, force: bool) -> Iterator[Path]:
    """A temporary directory next to ``out``; renamed to ``out`` on success, removed else.

    Staging folders that killed builds of ``out`` left behind are removed first
    (:func:`clean_stale_staging`).
    """
    out = Path(out).resolve()
    if out.exists() and not force:
        raise BundleError(f"{out} exists; pass --force to replace it")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_staging(out)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as exc:
        raise BundleError(
            f"cannot write the output {out}: its folder {out.parent} does not take a new "
            f"folder ({exc.strerror or exc}); pass a writable -o / --output path"
        ) from None
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def draft_role(recipe: Recipe) -> str:
    """The bundle role of the recipe's draft engine (its method's record in the registry)."""
    return get_method(recipe.speculative.method, str(recipe.source)).bundle_role


def _role_entry(exported, role: str) -> dict:
    """The manifest's ``roles.<role>``: files, graph kind, dtype, I/O and weight provenance.

    A draft graph that reads the target's shared tensors lives in the base's folder
    (``base/draft.onnx``, :class:`~edgebuild.export.weights.SharedWeights`); its config and
    engine stay in ``<role>/``.
    """
    folder = exported.onnx_path.parent.name  # the role's folder, or base/ for a shared draft
    return {
        "onnx": f"{folder}/{exported.onnx_path.name}",
        "onnx_data": f"{folder}/{exported.data_path.name}",
        "config": f"{role}/config.json",
        "engine": None,
        "graph_kind": exported.kind.value,
        "dtype": exported.dtype,
        **exported.io_json(),
        "quantized": dict(sorted(exported.weights.quantized.items())),
        "weight_sources": dict(sorted(exported.weights.borrowed.items())),
        # the target tensors a draft borrows, stored once (export.weights.SharedWeights)
        "onnx_shared_data": f"{folder}/{exported.shared_path.name}"
        if exported.shared_path
        else None,
        "shared_initializers": sorted(exported.weights.shared),
    }


def _export(plan: BuildPlan, options: BuildOptions, tmp: Path, progress: _Progress) -> dict:
    from edgebuild.export import (
        ExportOptions,
        GraphKind,
        SharedWeights,
        WeightMode,
        export_base,
        export_draft,
    )

    recipe, b = plan.recipe, plan.recipe.build
    top_k = recipe.speculative.draft_top_k if recipe.speculative else 16
    block = plan.draft_config.block_size if plan.draft_config is not None else 0
    opts = ExportOptions(
        kind=GraphKind.PORTABLE if options.portable else GraphKind.PLUGIN,
        weights=WeightMode(plan.weights),
        dtype=plan.dtype,
        page_size=b.page_size,
        rope_rows=b.max_kv_cache_capacity + block + 1,  # positions a request can reach
        top_k=max(1, top_k),
    )
    taps = tuple(plan.draft_config.target_layer_ids) if plan.draft_config is not None else ()
    roles = {}
    shared = SharedWeights.for_pair(plan.pair) if plan.pair is not None else None
    progress.stage("export base", plan.target.total_bytes())
    base = export_base(plan.target, tmp / "base", opts, taps, progress.advance, shared)
    progress.done()
    shutil.copyfile(plan.target.config_path, tmp / "base" / "config.json")
    roles["base"] = _role_entry(base, "base")
    roles["base"]["tap_layers"] = list(taps)
    if plan.pair is not None:
        role = draft_role(recipe)
        progress.stage(f"export {role}", plan.pair.draft.total_bytes())
        draft = export_draft(
            plan.pair, plan.target_config, tmp / role, opts, progress.advance,
            config=plan.draft_config, shared=shared,  # validated in stage 1
        )  # fmt: skip
        progress.done()
        shutil.copyfile(plan.pair.draft.config_path, tmp / role / "config.json")
        roles[role] = _role_entry(draft, role)
        roles[role]["top_k"] = int(draft.metadata["edgebuild.top_k"])
    if plan.vision is not None:
        roles["visual"] = _export_visual(plan, opts, tmp, progress)
    return {"roles": roles, "export": opts.to_json()}


def _export_visual(plan: BuildPlan, opts, tmp: Path, progress: _Progress) -> dict:
    """The ``visual`` role of a VLM target (graph, weights, config.json, preprocessor config)."""
    from edgebuild.export import export_visual

    nbytes = sum(
        plan.target.info(n).nbytes for n in plan.target.names() if n.startswith(VISION_PREFIX)
    )
    progress.stage("export visual", nbytes)
    visual = export_visual(plan.target, tmp / "visual", opts, progress.advance)
    progress.done()
    entry = _role_entry(visual, "visual")
    pre = tmp / "visual" / "preprocessor_config.json"
    entry["preprocessor_config"] = f"visual/{pre.name}" if pre.is_file() else None
    entry["vision"] = json.loads(visual.metadata["edgebuild.vision"])
    return entry


def _engines(plan: BuildPlan, options: BuildOptions, tmp: Path, roles: dict, progress) -> dict:
    """Stage 3; returns the manifest's ``engines`` entry (status says why none were built)."""
    from edgebuild.engine import ENGINE_NAME, VisualGeometry, build_engine, load_tensorrt

    if options.onnx_only:
        return {"status": "not built: --onnx-only"}
    try:
        trt = load_tensorrt(options.builder)
    except MissingDependencyError as exc:
        log.warning("stopping after ONNX: %s", exc)
        return {
            "status": f"not built: {options.builder} is not installed; the bundle has the ONNX "
            "graphs only (build the engines on the device)"
        }
    from edgebuild.engine.plugin_library import plugin_library_path

    library = options.plugin_library or plugin_library_path()
    n = plan.recipe.speculative.num_speculative_tokens if plan.recipe.speculative else 0
    for role, entry in roles.items():
        progress.stage(f"engine {role}", None)
        build_engine(
            tmp / entry["onnx"],
            tmp / role / ENGINE_NAME,
            role,
            entry["inputs"],
            plan.recipe.build,
            n,
            builder=options.builder,
            needs_plugin=entry["graph_kind"] == "plugin",
            plugin_library=library,
            timing_cache=options.timing_cache,
            visual=VisualGeometry.from_role(entry) if role == "visual" else None,
        )
        progress.done()
        entry["engine"] = f"{role}/{ENGINE_NAME}"
    return {
        "status": "built",
        "builder": options.builder,
        "builder_version": trt.__version__,
        "sm": _engine_sm(options.builder),
    }


def _engine_sm(builder: str) -> str | None:
    """The SM the engines run on: TensorRT builds for the local GPU (None: RTX, or no CUDA
    torch to ask; the runtime then takes the SM of ``build.device``)."""
    from edgebuild.engine import local_sm

    return local_sm() if builder == "tensorrt" else None


def _copy_tokenizer(target_dir: Path, tmp: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (target_dir / name).is_file():
            shutil.copyfile(target_dir / name, tmp / name)
            copied.append(name)
    return copied


def _manifest(plan: BuildPlan, options: BuildOptions, tmp: Path, exported: dict, engines: dict):
    from edgebuild import __version__
    from edgebuild.export import dspark_fields
    from edgebuild.export.plugin import contract

    recipe, hub = plan.recipe, plan.hub or {}
    sources = {"target": source_record(plan.target.path, hub.get("target"))}
    dspark = None
    if plan.pair is not None:
        sources["draft"] = source_record(plan.pair.draft.path, hub.get("draft"))
        dspark = dspark_fields(plan.draft_config)
        dspark["lm_head_source"] = plan.pair.lm_head().checkpoint_source
        dspark["embed_tokens_source"] = plan.pair.embed_tokens().checkpoint_source
        dspark["top_k"] = exported["roles"][draft_role(recipe)]["top_k"]
        dspark["shared_bytes"] = plan.shared_bytes  # checkpoint bytes not copied into the draft
        dtype = exported["roles"][draft_role(recipe)]["dtype"]  # the draft cache's dtype
        dspark["kv_cache"] = plan.draft_config.kv_budget(
            _DTYPE_BYTES.get(dtype, 2), recipe.build.page_size
        )  # a windowed draft's ring is whole pages of the engines' page size
    for role, entry in sources.items():
        entry["quant"] = sorted(
            f.value for f in _formats(plan.target if role == "target" else plan.pair.draft)
        )
    files = {
        p.relative_to(tmp).as_posix(): file_record(p)
        for p in sorted(tmp.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "producer": {"name": "edgebuild", "version": __version__},
        "name": recipe.name,
        "graph_kind": "portable" if options.portable else "plugin",
        "build": {**recipe.build.model_dump(mode="json"), "weights": plan.weights},
        "export": exported["export"],
        "speculative": recipe.speculative.model_dump(mode="json") if recipe.speculative else None,
        "plugin": None if options.portable else contract().to_manifest(),
        "sources": sources,
        "roles": exported["roles"],
        "dspark": dspark,
        "engines": engines,
        "tokenizer": exported["tokenizer"],
        "files": files,
    }


@dataclass
class BuildResult:
    path: Path
    manifest: dict


def build_bundle(
    recipe: Recipe,
    out: Path,
    options: BuildOptions | None = None,
    sources: dict[str, ModelSource] | None = None,
) -> BuildResult:
    """Build a bundle at ``out`` from ``recipe`` (module docstring for the stages).

    Args:
        recipe: what to build; its references may be Hub ids (resolved here, once).
        out: the bundle directory (written atomically).
        options: how to build.
        sources: the recipe's references already resolved (:meth:`Recipe.resolved`), whose
            Hub ids and commits the manifest records; None: resolved here.

    Raises:
        CheckpointError / PairingError / ConfigError: stage 1 (nothing written); a Hub id
            that cannot be resolved.
        BundleError: ``out`` exists without ``force``.
        EngineError / MissingDependencyError: engine stage (a plugin graph without library).
    """
    from edgebuild.engine.builder import record_profiles

    options = options or BuildOptions()
    if sources is None:
        recipe, sources = recipe.resolved()
    plan = plan_build(recipe, options)
    plan.hub = {role: src.to_manifest() for role, src in sources.items() if src.is_hub}
    with (
        _Progress(options.progress, options.on_stage) as progress,
        _staging(out, options.force) as tmp,
    ):
        exported = _export(plan, options, tmp, progress)
        exported["tokenizer"] = _copy_tokenizer(plan.target.path, tmp)
        engines = _engines(plan, options, tmp, exported["roles"], progress)
        progress.stage("manifest (hashing files)", None)
        manifest = _manifest(plan, options, tmp, exported, engines)
        record_profiles(manifest)  # what the runtime reads instead of recomputing them
        (tmp / MANIFEST_NAME).write_text(dumps(manifest), encoding="utf-8")
        progress.done()
    return BuildResult(Path(out).resolve(), manifest)
