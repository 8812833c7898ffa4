"""ONNX -> serialized TensorRT engine: optimization profiles, plugin library, timing cache.

TensorRT is imported lazily (:func:`load_tensorrt`). Two builders are known:

* ``tensorrt`` - the real one, on the Jetson (or a docker image with TensorRT). It loads the
  ``EdgebuildAttention`` plugin library, builds for the GPU it runs on and checks that GPU
  against the recipe's device (Thor = sm_110, Orin = sm_87).
* ``tensorrt_rtx`` - TensorRT for RTX (``pip install tensorrt-rtx-cu13``): its parser and
  builder run on a CPU-only machine, so the tests use it as a real parser/builder of the
  *portable* graphs (standard ops only). It loads our plugin library and its ONNX parser
  creates the plugin (the tests check the library, the creator and the attribute mapping with
  it), but it cannot add plugin layers to a network, so it builds no plugin graph
  (:data:`~edgebuild.engine.plugin_library.TENSORRT_RTX_PLUGIN_LIMIT`). Its engines target RTX
  GPUs, not Jetson.

The plugin library's path and build command belong to :mod:`edgebuild.engine.plugin_library`.

Networks are strongly typed (the ONNX graph's dtypes are the engine's dtypes; NVFP4 / FP8
weights come as DequantizeLinear chains). Optimization profiles come from the recipe's
``build`` settings and the graph's named axes (:func:`profiles`): the ``base`` engine gets a
``prefill`` profile (up to ``max_input_len`` rows; a VLM's base also up to ``max_image_tokens``
image-embedding rows) and a ``generate`` profile (decode and verify, up to
``num_speculative_tokens + 1`` rows); the ``draft`` engine one profile; the
``visual`` engine (vision tower of a VLM) one profile over its patch, token, segment and
window axes, from ``max_image_tokens`` / ``max_images`` and the tower's
:class:`VisualGeometry` (:func:`visual_axis_ranges`).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from edgebuild.errors import ConfigError, EngineError, MissingDependencyError
from edgebuild.recipe import DEVICE_SUPPORT, BuildSettings, Device, Precision

log = logging.getLogger("edgebuild.engine")

ENGINE_NAME = "model.engine"


BUILDERS = ("tensorrt", "tensorrt_rtx")

# stored quantization format -> the engine precision it needs (recipe Precision)
_FORMAT_PRECISION = {"NVFP4": Precision.NVFP4, "FP8": Precision.FP8, "FP8_BLOCK": Precision.FP8}


def check_device_formats(device: Device | str, formats: Sequence[str], what: str) -> None:
    """Refuse NVFP4 / FP8 weights for a device without FP8/FP4 tensor cores (Orin).

    Args:
        device: the recipe's device.
        formats: quantization formats of the weights (``NVFP4``, ``FP8``, ``FP8_BLOCK``).
        what: the checkpoint, for the message.

    Raises:
        ConfigError: naming the device, the format, the checkpoint and the fix.
    """
    device = Device(device)
    sm, supported = DEVICE_SUPPORT[device]
    bad = sorted(
        {f for f in formats if _FORMAT_PRECISION.get(f.upper(), None) not in (None, *supported)}
    )
    if bad:
        raise ConfigError(
            f"{what}: {', '.join(bad)} weights cannot run on {device.value} ({sm} has no "
            "FP8/FP4 tensor cores); for Orin use a BF16/FP16 checkpoint or build.precision "
            "bf16 (the weights are then dequantized), or target device 'thor'"
        )


def axis_ranges(
    build: BuildSettings, num_speculative_tokens: int, profile: str
) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of every named graph axis (see :mod:`edgebuild.export.graphs`).

    ``seq`` spans ``1..max_input_len`` in the ``prefill`` profile and ``1..verify`` in
    ``generate`` (verify = ``num_speculative_tokens + 1``); ``logits_rows`` up to verify;
    pages and the dense ``kv_capacity`` from ``max_kv_cache_capacity``; the draft's
    ``context_len`` up to ``max_input_len`` (the first update carries the whole prompt).
    ``image_tokens`` (the multimodal base graph's image table) spans
    ``1..min(max_image_tokens, max_input_len)`` in ``prefill`` (one call's image rows) and is
    1 in ``generate`` (decode and verify rows are text: the 1-row table no id selects).
    """
    verify = num_speculative_tokens + 1
    batch = build.max_batch_size
    pages = -(-build.max_kv_cache_capacity // build.page_size)
    seq_max = verify if profile == "generate" else build.max_input_len
    images = 1 if profile == "generate" else min(build.max_image_tokens, build.max_input_len)
    return {
        "image_tokens": (1, images, images),
        "batch": (1, batch, batch),
        "seq": (1, seq_max, seq_max),
        "logits_rows": (1, verify, verify),
        "max_pages": (1, pages, pages),
        "num_pages": (1, pages * batch, pages * batch),
        "kv_capacity": (1, build.max_kv_cache_capacity, build.max_kv_cache_capacity),
        "context_len": (1, min(verify, build.max_input_len), build.max_input_len),
    }


@dataclass(frozen=True)
class VisualGeometry:
    """What the ``visual`` engine's axis ranges need from the vision tower.

    Attributes:
        merge_unit: patches merged into one token (``spatial_merge_size ** 2``, 4 for 2x2).
        window_tokens: tokens in one full attention window of the windowed blocks.
    """

    merge_unit: int
    window_tokens: int

    @classmethod
    def from_role(cls, entry: dict) -> VisualGeometry:
        """From a manifest's ``roles.visual`` entry (its ``vision`` fields).

        Raises:
            ConfigError: the entry records no (or non-positive) ``vision.merge_unit`` /
                ``vision.window_tokens``.
        """
        vision = entry.get("vision") or {}
        values = [vision.get(k) for k in ("merge_unit", "window_tokens")]
        if not all(isinstance(v, int) and v > 0 for v in values):
            raise ConfigError(
                f"roles.visual.vision records merge_unit {values[0]!r} and window_tokens "
                f"{values[1]!r}; rebuild the bundle with `edgebuild build`"
            )
        return cls(*values)


def visual_axis_ranges(build: BuildSettings, geometry: VisualGeometry) -> dict[str, tuple]:
    """(min, opt, max) of the ``visual`` graph's axes (:meth:`VisualGraph.io`).

    ``T = max_image_tokens``, ``u = merge_unit``, ``w = window_tokens``: ``tokens`` 1..T,
    ``patches`` u..u*T, ``full_segments`` (images) 1..max_images, ``full_len`` (patches of the
    largest image) u..u*T, ``windows`` 1..T (a window holds at least one token),
    ``window_len`` u..u*min(w, T). Optimum: one image of T tokens.
    """
    t, u = build.max_image_tokens, geometry.merge_unit
    window = u * min(geometry.window_tokens, t)
    return {
        "tokens": (1, t, t),
        "patches": (u, u * t, u * t),
        "full_segments": (1, 1, build.max_images),
        "full_len": (u, u * t, u * t),
        "windows": (1, -(-t // geometry.window_tokens), t),
        "window_len": (u, window, window),
    }


def profile_names(role: str) -> tuple[str, ...]:
    """``base``: prefill + generate (decode / verify); other roles: one profile."""
    return ("prefill", "generate") if role == "base" else ("all",)


def profiles(
    role: str,
    inputs: Sequence,
    build: BuildSettings,
    num_speculative_tokens: int,
    visual: VisualGeometry | None = None,
) -> list[dict[str, tuple]]:
    """One ``{input: (min_shape, opt_shape, max_shape)}`` dict per optimization profile.

    ``inputs`` are the graph's :class:`~edgebuild.export.graphs.TensorSpec` s (or dicts with
    ``name`` / ``dims``); static dims stay fixed, named axes take :func:`axis_ranges` (the
    ``visual`` role: :func:`visual_axis_ranges` with ``visual``).

    Raises:
        ConfigError: an input axis without a range; the ``visual`` role without ``visual``.
    """
    if role == "visual" and visual is None:
        raise ConfigError("the visual engine's profile needs the tower's VisualGeometry")
    out = []
    for profile in profile_names(role):
        if role == "visual":
            ranges = visual_axis_ranges(build, visual)
        else:
            ranges = axis_ranges(build, num_speculative_tokens, profile)
        shapes = {}
        for spec in inputs:
            name, dims = (
                (spec["name"], spec["dims"]) if isinstance(spec, dict) else (spec.name, spec.dims)
            )
            triple = []
            for d in dims:
                if isinstance(d, int):
                    triple.append((d, d, d))
                elif d in ranges:
                    triple.append(ranges[d])
                else:
                    raise ConfigError(f"{role} input '{name}' has axis '{d}' with no range")
            shapes[name] = tuple(tuple(t[i] for t in triple) for i in range(3))
        out.append(shapes)
    return out


def record_profiles(manifest: dict) -> dict:
    """Write each role's optimization profiles into ``manifest`` (``roles.<role>.profiles``).

    The record the runtime reads instead of recomputing them
    (:func:`edgebuild.bundle.manifest.engine_profiles`): ``[{"name": ..., "shapes": {input:
    [min_shape, opt_shape, max_shape]}}, ...]`` in engine order, computed by :func:`profiles`
    from the manifest's ``build`` settings, ``speculative.num_speculative_tokens`` (0 without a
    draft) and each role's declared ``inputs`` (the ``visual`` role: its ``vision`` fields).
    Roles without ``inputs`` are left alone. Returns ``manifest`` (changed in place).

    Raises:
        ConfigError: an input axis without a range, a ``visual`` role without geometry.
    """
    build = BuildSettings(
        **{
            k: v
            for k, v in (manifest.get("build") or {}).items()
            if k in BuildSettings.model_fields
        }
    )
    n = int((manifest.get("speculative") or {}).get("num_speculative_tokens", 0))
    for role, entry in (manifest.get("roles") or {}).items():
        if "inputs" not in entry:
            continue
        visual = VisualGeometry.from_role(entry) if role == "visual" else None
        made = profiles(role, entry["inputs"], build, n, visual)
        entry["profiles"] = [
            {"name": name, "shapes": {k: [list(d) for d in v] for k, v in shapes.items()}}
            for name, shapes in zip(profile_names(role), made, strict=True)
        ]
    return manifest


def load_tensorrt(builder: str = "tensorrt") -> ModuleType:
    """Import ``tensorrt`` (or ``tensorrt_rtx``) lazily.

    Raises:
        MissingDependencyError: the package is not installed (the message says what still
            works: the ONNX graphs, which can be built on the device later).
    """
    if builder not in BUILDERS:
        raise ConfigError(
            f"unknown engine builder {builder!r}; choose one of {', '.join(BUILDERS)}"
        )
    try:
        return importlib.import_module(builder)
    except ImportError as exc:
        hint = (
            "install TensorRT (JetPack on Jetson, or the NGC TensorRT container)"
            if builder == "tensorrt"
            else "pip install tensorrt-rtx-cu13"
        )
        raise MissingDependencyError(
            f"{builder} is not importable ({exc}); {hint}. The ONNX graphs are complete: "
            "build the engines later with `edgebuild build` on the device"
        ) from None


def _local_sm() -> tuple[int, int] | None:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_capability()
    except Exception:  # noqa: BLE001 - no usable CUDA torch: the build itself will say more
        return None
    return None


def local_sm() -> str | None:
    """The local GPU as ``sm_XY`` (via torch), or None without a usable CUDA device."""
    sm = _local_sm()
    return f"sm_{sm[0]}{sm[1]}" if sm is not None else None


def check_local_device(device: Device | str, builder: str) -> None:
    """With the real TensorRT, the local GPU must be the recipe's device (engines are native).

    Raises:
        ConfigError: a GPU of another compute capability (names both).
    """
    device = Device(device)
    sm = _local_sm()
    if builder != "tensorrt" or sm is None:
        return
    want, local = DEVICE_SUPPORT[device][0], f"sm_{sm[0]}{sm[1]}"
    if local != want:
        raise ConfigError(
            f"this GPU is {local} but the recipe targets {device.value} ({want}); TensorRT "
            "engines are built for the GPU they are built on: build on the target Jetson"
        )


@dataclass
class EngineReport:
    """What :func:`build_engine` produced."""

    engine_path: Path
    builder: str
    builder_version: str
    profiles: list[dict]
    plugin_library: str | None
    timing_cache: str | None


def _parse(trt, network, logger, onnx_path: Path) -> None:
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise EngineError(
            f"{onnx_path}: TensorRT could not parse the graph:\n  " + "\n  ".join(errors[:10])
        )


def _load_plugin(trt, builder, library: Path | None, needs_plugin: bool, name: str) -> None:
    if not needs_plugin:
        return
    from edgebuild.engine.plugin_library import build_instructions

    if library is None or not Path(library).is_file():
        looked = library or "not found"
        raise MissingDependencyError(
            f"the graph has {name} plugin nodes but the plugin library ({looked}) is "
            f"missing; {build_instructions()}"
        )
    if builder.get_plugin_registry().load_library(str(library)) is None:
        raise MissingDependencyError(
            f"{library}: TensorRT could not load the plugin library (see its log); "
            + build_instructions()
        )


def build_engine(
    onnx_path: Path,
    engine_path: Path,
    role: str,
    inputs: Sequence,
    build: BuildSettings,
    num_speculative_tokens: int,
    *,
    builder: str = "tensorrt",
    needs_plugin: bool = False,
    plugin_library: Path | None = None,
    timing_cache: Path | None = None,
    visual: VisualGeometry | None = None,
    strip_weights: Sequence[str] = (),
) -> EngineReport:
    """Parse ``onnx_path`` and write a serialized engine to ``engine_path``.

    Args:
        onnx_path: ``model.onnx`` (its external data next to it).
        engine_path: where the engine goes (written via a temporary file + rename).
        role: ``base``, ``draft`` or ``visual`` (selects the profiles).
        inputs: the graph's input specs.
        build: the recipe's build settings (shapes the engine must accept, device).
        num_speculative_tokens: drafts per step (verify calls have one more row).
        builder: ``tensorrt`` or ``tensorrt_rtx`` (portable graphs only).
        needs_plugin: the graph has ``EdgebuildAttention`` nodes.
        plugin_library: the plugin ``.so`` (real TensorRT only).
        timing_cache: a file read (when present) and updated after the build (real TensorRT;
            TensorRT-RTX has no timing cache).
        visual: the vision tower's geometry (required for the ``visual`` role).
        strip_weights: initializers to leave out of the plan, refittable
            (:func:`strip_refittable`; the draft's shared head / embedding, refitted at load
            from ``base/shared.onnx.data``). Empty: every weight embedded.

    Raises:
        MissingDependencyError: no TensorRT, or a plugin graph without the library (or one
            TensorRT cannot load).
        ConfigError: a plugin graph given to TensorRT-RTX (it creates the plugin but cannot
            add plugin layers to a network), or the wrong local GPU.
        EngineError: TensorRT's parser or builder failed (its messages included).
    """
    from edgebuild.engine.plugin_library import TENSORRT_RTX_PLUGIN_LIMIT
    from edgebuild.export.plugin import contract

    trt = load_tensorrt(builder)
    if needs_plugin and builder != "tensorrt":
        raise ConfigError(
            f"{onnx_path}: this graph has {contract().name} plugin nodes and "
            f"{TENSORRT_RTX_PLUGIN_LIMIT}; build plugin graphs with TensorRT on the Jetson, or "
            "export portable graphs (--portable) for TensorRT-RTX"
        )
    check_local_device(build.device, builder)
    logger = trt.Logger(trt.Logger.WARNING)
    trt_builder = trt.Builder(logger)
    _load_plugin(trt, trt_builder, plugin_library, needs_plugin, contract().name)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = trt_builder.create_network(flags)
    _parse(trt, network, logger, Path(onnx_path))
    config = trt_builder.create_builder_config()
    shapes = profiles(role, inputs, build, num_speculative_tokens, visual)
    timing_cache = timing_cache if builder == "tensorrt" else None  # no-op in TensorRT-RTX
    _configure(trt, trt_builder, config, shapes, needs_plugin, timing_cache)
    if strip_weights:
        strip_refittable(trt, network, config, strip_weights, Path(onnx_path))
    serialized = trt_builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineError(f"{onnx_path}: TensorRT failed to build the {role} engine (see its log)")
    _atomic_write(Path(engine_path), memoryview(serialized))
    if timing_cache is not None:
        Path(timing_cache).parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(Path(timing_cache), memoryview(config.get_timing_cache().serialize()))
    return EngineReport(
        Path(engine_path),
        builder,
        trt.__version__,
        [{k: [list(s) for s in v] for k, v in p.items()} for p in shapes],
        str(plugin_library) if needs_plugin and plugin_library else None,
        str(timing_cache) if timing_cache else None,
    )


def strip_refittable(trt, network, config, names: Sequence[str], onnx_path: Path) -> None:
    """Build a plan without the weights ``names``, which stay refittable (TensorRT 10's
    weight-stripped engines: ``INetworkDefinition.mark_weights_refittable`` per name,
    ``BuilderFlag.REFIT_INDIVIDUAL`` + ``STRIP_PLAN``). The engine must be refitted before it
    runs (``Refitter`` / ``OnnxParserRefitter.refit_from_file`` on the graph, whose external
    data hold them); on the device that puts them back into the engine's own memory, so this
    saves engine-file bytes, not device bytes (docs/ARCHITECTURE.md, "one head").

    Raises:
        EngineError: a name the parsed network has no weights of (names it).
        ConfigError: no CUDA GPU here: TensorRT-RTX 1.7 builds plain engines on a CPU-only
            host but fails every refittable or stripped build in its JIT compiler (seen:
            ``MyelinCheckException ... CUDA_SUCCESS``), so this is refused before building.
    """
    missing = [n for n in names if not network.mark_weights_refittable(n)]
    if missing:
        raise EngineError(
            f"{onnx_path}: cannot strip {missing}: the parsed graph has no weights of that "
            "name (the shared initializers are listed in the manifest's "
            "roles.<role>.shared_initializers)"
        )
    if _local_sm() is None:
        raise ConfigError(
            f"{onnx_path}: a weight-stripped, refittable engine ({len(names)} weights left "
            "out) needs a CUDA GPU at build time (TensorRT-RTX compiles refittable plans "
            "with CUDA even for a portable graph); build it on the device, or embed every "
            "weight"
        )
    config.set_flag(trt.BuilderFlag.REFIT_INDIVIDUAL)
    config.set_flag(trt.BuilderFlag.STRIP_PLAN)


def _configure(trt, trt_builder, config, shapes: list[dict], needs_plugin: bool, timing_cache):
    """Optimization profiles (one per ``shapes`` entry), aliased plugin I/O, timing cache."""
    for shape in shapes:
        profile = trt_builder.create_optimization_profile()
        for name, (lo, opt, hi) in shape.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    if needs_plugin and hasattr(trt, "PreviewFeature"):
        aliased = getattr(trt.PreviewFeature, "ALIASED_PLUGIN_IO_10_03", None)
        if aliased is not None:  # present_kv_cache really is kv_cache's memory
            config.set_preview_feature(aliased, True)
    if timing_cache is not None:
        path = Path(timing_cache)
        cache = config.create_timing_cache(path.read_bytes() if path.is_file() else b"")
        config.set_timing_cache(cache, ignore_mismatch=False)


def _atomic_write(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
