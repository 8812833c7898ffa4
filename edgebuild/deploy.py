"""``edgellm-serve MODEL`` decides for itself: engines where TensorRT can build them, else torch.

:func:`plan_serve` turns the server's settings into a
:class:`~edgebuild.serve.config.ServePlan`:

- **a bundle folder**: served as it is, on the backend
  :func:`~edgebuild.runtime.select.select_backend` picks (its engines where they fit this GPU
  and TensorRT, else the torch runtime over its sources);
- **a checkpoint** (a folder or a Hub id, resolved into the Hub cache), with ``--backend
  auto``: where TensorRT can build engines for this GPU (the ``tensorrt`` module, a visible
  CUDA GPU that is a Jetson target) the bundle is taken from the engine cache or built into
  it (:mod:`edgebuild.bundle.cache`; the server already listens and says ``building``), then
  its engines are served; where it cannot, the torch runtime serves the resolved checkpoint
  and one log line says why there are no engines. ``--backend tensorrt`` there is an error
  that lists the reasons; ``--backend torch`` never builds.

The engines are built for the server's limits (``--max-batch-size``, ``--max-input-len``,
``--max-kv-cache-capacity``) and, with a draft, for the draft's whole ``block_size``, so any
``num_speculative_tokens`` from 1 to it runs without a rebuild; ``draft_top_k`` is part of the
engine's shapes (the draft's ``markov_topk`` unless given).

This module composes the layers (serve, bundle, runtime), as the CLI does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from edgebuild.bundle.build import BuildOptions, recipe_from_flags
from edgebuild.bundle.cache import EngineCache, build_cached
from edgebuild.bundle.manifest import is_bundle
from edgebuild.checkpoint.hub import ModelSource, resolve_model_ref
from edgebuild.errors import ConfigError
from edgebuild.recipe import MAX_SPECULATIVE_TOKENS, Device
from edgebuild.runtime.select import BackendChoice, HostProbe, probe_host, select_backend
from edgebuild.serve.config import ServeConfig, ServePlan
from edgebuild.speculative.config import SpeculativeConfig

log = logging.getLogger("edgebuild.serve")

#: SM of the GPU -> the Jetson the engines are built for (recipe.DEVICE_SUPPORT)
SM_DEVICE = {"sm_110": Device.THOR, "sm_87": Device.ORIN}
PAGE_SIZE = 32


@dataclass(frozen=True)
class EngineHost:
    """Whether TensorRT can build engines here: the device to build for, or the reasons not."""

    device: Device | None
    reasons: tuple[str, ...]


def engine_host(probe: HostProbe) -> EngineHost:
    """Can this machine build TensorRT engines (module docstring)? Every reason, not the first."""
    reasons = []
    if probe.tensorrt_version is None:
        reasons.append("the tensorrt Python module is not installed (JetPack / NGC TensorRT)")
    elif probe.tensorrt_version.startswith("unusable"):
        reasons.append(f"the tensorrt module is {probe.tensorrt_version}")
    device = SM_DEVICE.get(probe.gpu_sm or "")
    if not probe.gpu:
        reasons.append("no CUDA GPU is visible (torch.cuda.is_available() is False)")
    elif device is None:
        gpu = probe.gpu_sm or "of unknown SM"
        reasons.append(
            f"this GPU ({gpu}) is not a device edgebuild builds engines for (Jetson Thor "
            "sm_110, Jetson Orin sm_87)"
        )
    return EngineHost(device if not reasons else None, tuple(reasons))


def serve_build_recipe(config: ServeConfig, target: ModelSource, spec, device: Device):
    """The recipe the server builds: its limits, the draft's whole block (module docstring).

    The per-sequence KV capacity is the pool (``--max-kv-cache-capacity``) shared out over
    ``--max-batch-size`` sequences, at least one longest prompt plus a verify block, rounded
    up to whole pages.

    Raises:
        ConfigError: as :func:`~edgebuild.bundle.build.recipe_from_flags`.
    """
    from edgebuild.checkpoint.dspark_config import read_dspark_field
    from edgebuild.speculative.config import read_draft_config

    n = 0
    draft = None
    if spec is not None:
        draft = spec.model
        block, _ = read_dspark_field(
            read_draft_config(draft), "block_size", int, str(Path(draft) / "config.json")
        )
        n = min(block, MAX_SPECULATIVE_TOKENS)
    per_seq = max(
        -(-config.max_kv_cache_capacity // config.max_batch_size), config.input_len + n + 1
    )
    if config.max_model_len is not None:  # vLLM's flag: the per-sequence capacity itself
        per_seq = config.max_model_len + n
    per_seq = -(-per_seq // PAGE_SIZE) * PAGE_SIZE
    spec_kw = {"num_speculative_tokens": n, "draft_top_k": spec.draft_top_k} if spec else {}
    return recipe_from_flags(
        target.path,
        draft,
        device=device.value,
        name=target.display_name.replace("/", "--"),
        max_batch_size=config.max_batch_size,
        max_input_len=config.input_len,
        max_kv_cache_capacity=per_seq,
        page_size=PAGE_SIZE,
        **spec_kw,
    )


def prepare_serve(config: ServeConfig, probe: HostProbe | None = None):
    """The quick part of the start, before the server listens: resolve the references
    (downloading them if needed, with the Hub's progress bars), parse the speculative config
    and decide the backend (module docstring), so that a bad id or flag fails at once.

    Returns:
        ``finish(startup) -> ServePlan``: the slow part, run while the server listens
        (engines from the cache or built into it, reported to ``startup``).

    Raises:
        CheckpointError: a reference that cannot be resolved (names the fix).
        ConfigError: a bad speculative config (or one with a key only the torch runtime
            honours where engines are to be built); ``--backend tensorrt`` where engines
            cannot be built or run.
    """
    local = Path(config.model)
    if local.is_dir() and is_bundle(local):
        backend = select_backend(config.backend, local, probe)
        log.info("backend: %s (%s)", backend.name, backend.reason)
        plan = ServePlan(local, backend, config.speculative_config)
        return lambda startup: plan
    target = resolve_model_ref(config.model, config.revision)
    spec = None
    if config.speculative_config is not None:
        spec = SpeculativeConfig.parse(config.speculative_config)
        _check_block(spec)
    if config.backend == "onnxruntime":
        raise ConfigError(
            f"--backend onnxruntime serves a bundle's ONNX graphs; {config.model} is a "
            "checkpoint: build a bundle (`edgebuild build --onnx-only --dtype float32`)"
        )
    if config.backend == "torch":
        plan = _torch_plan(target, spec, "requested with --backend torch")
        return lambda startup: plan
    host = engine_host(probe if probe is not None else probe_host())
    if host.device is None:
        why = "; ".join(host.reasons)
        if config.backend == "tensorrt":
            raise ConfigError(
                f"--backend tensorrt cannot build engines for {config.model} here: {why}. Use "
                "--backend torch (CPU), or build on the device (`edgebuild build` there)"
            )
        plan = _torch_plan(target, spec, f"no engines: {why}")
        return lambda startup: plan
    if spec is not None:  # before minutes of engine building
        spec.check_engine_backend("the engines built on this TensorRT host")
    recipe = serve_build_recipe(config, target, spec, host.device)
    return lambda startup: _engine_plan(config, recipe, target, spec, startup)


def _check_block(spec) -> None:
    """``num_speculative_tokens`` within the draft's ``block_size``, before the server listens.

    Raises:
        ConfigError: it exceeds the block (names the range).
    """
    from edgebuild.checkpoint.dspark_config import read_dspark_field
    from edgebuild.speculative.config import read_draft_config

    path = str(Path(spec.model) / "config.json")
    try:
        block, _ = read_dspark_field(read_draft_config(spec.model), "block_size", int, path)
    except Exception:  # noqa: BLE001 - the loader reports an unreadable draft config later
        return
    spec.check_block(block, path)


def _torch_plan(target: ModelSource, spec, reason: str) -> ServePlan:
    log.info("backend: torch (%s); serving the torch runtime from %s", reason, target.path)
    return ServePlan(target.path, BackendChoice("torch", reason), spec)


def _engine_plan(config: ServeConfig, recipe, target: ModelSource, spec, startup) -> ServePlan:
    """Engines from the cache, or built into it (the ``building`` stage), for TensorRT."""
    cache = EngineCache(config.cache_dir)
    sources = {"target": target, **({"draft": spec.source} if spec is not None else {})}
    name = f"engines for {target.display_name} ({recipe.build.device.value}) in {cache.root}"
    options = BuildOptions(
        builder="tensorrt",
        progress=False,
        on_stage=lambda s: startup.stage("building", f"building {name}: {s}"),
    )

    def on_event(kind: str, info: dict) -> None:
        if kind == "waiting":
            startup.stage("building", f"waiting for {info['holder']}, which builds {name}")

    startup.stage("building", f"building or reusing {name}", cache.last_build_s())
    result = build_cached(recipe, options, cache, sources, on_event)
    how = "cache hit" if result.hit else f"built in {result.build_s:.0f} s"
    backend = BackendChoice("tensorrt", f"engines from the engine cache ({how}, key {result.key})")
    log.info("backend: tensorrt (%s)", backend.reason)
    return ServePlan(result.path, backend, spec, verify_bundle=False)


def serve_loader(config: ServeConfig, probe: HostProbe | None = None):
    """:func:`prepare_serve` now, and the server's ``load(startup)``
    (:class:`~edgebuild.serve.startup.Startup`): the slow part, then the model loaded into a
    :class:`~edgebuild.serve.config.ServeState`.

    Raises:
        as :func:`prepare_serve`.
    """
    from edgebuild.serve.config import load_state

    finish = prepare_serve(config, probe)

    def load(startup):
        plan = finish(startup)
        startup.stage("loading", f"loading {config.model_name} on the {plan.backend.name} backend")
        return load_state(config, plan)

    return load
