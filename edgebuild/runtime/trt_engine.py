"""TensorRT engine sessions: plugin library, deserialization, contexts, shapes, CUDA graphs.

The only module of the runtime that touches ``tensorrt`` (imported lazily, by
:func:`load_tensorrt_runtime`). :class:`TrtEngineRunner` runs one role's engine:

* deserialized after the bundle's plugin library was loaded and checked
  (:func:`load_plugin_library`: the creator ``name`` / ``version`` / ``namespace`` recorded in
  the manifest must be registered by it), its I/O checked against the exporter's declaration
  (:func:`edgebuild.runtime.trt_plan.check_io_contract`) and its KV outputs checked to alias
  their inputs (the pool is updated in place);
* one execution context per optimization profile (TensorRT binds a context to one profile;
  switching profiles on a context costs a synchronisation, so prefill and decode/verify each
  keep theirs);
* :meth:`TrtEngineRunner.execute` sets the input shapes and tensor addresses of one call (the
  backend passes views of buffers allocated once) and enqueues on the backend's stream;
* CUDA graphs (:class:`GraphCache`): a call made with a ``graph_key`` - the backend passes
  ``(profile, batch, rows, ...)`` for decode, verify and draft calls - runs eagerly the first
  time, is captured the second time (after an eager run that leaves the context's state for
  exactly these shapes) and is replayed from then on. A graph is only replayed with the very
  addresses it was captured with. Device memory, streams and graphs are torch's (CUDA torch,
  e.g. the JetPack wheel).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edgebuild.engine.plugin_library import plugin_build_hint
from edgebuild.errors import EngineError, MissingDependencyError
from edgebuild.runtime.trt_plan import (
    KV_INPUT,
    KV_OUTPUT,
    EngineTensor,
    Profile,
    RoleIO,
    check_io_contract,
)

log = logging.getLogger("edgebuild.runtime")

# tensorrt.DataType names -> manifest dtype names
_TRT_DTYPES = {
    "FLOAT": "float32",
    "HALF": "float16",
    "BF16": "bfloat16",
    "INT32": "int32",
    "INT64": "int64",
    "INT8": "int8",
    "UINT8": "uint8",
    "BOOL": "bool",
    "FP8": "float8_e4m3fn",
}
MAX_GRAPHS = 64  # per engine: decode/verify/draft shapes that repeat are few


def load_tensorrt_runtime():
    """Import ``tensorrt`` (the full runtime, not TensorRT-RTX).

    Raises:
        MissingDependencyError: not installed (says where it comes from).
    """
    try:
        import tensorrt
    except ImportError as exc:
        raise MissingDependencyError(
            f"the TensorRT backend needs the tensorrt Python module ({exc}); it comes with "
            "JetPack on Jetson or the NGC TensorRT container. Use --backend torch meanwhile"
        ) from None
    return tensorrt


def load_plugin_library(registry, plugin: dict, library: Path | None, bundle: Path) -> Path:
    """Load the attention plugin library into TensorRT's ``registry`` and check its version.

    Args:
        registry: ``tensorrt.get_plugin_registry()`` (or a stand-in with ``load_library`` and
            ``get_creator(name, version, namespace)``).
        plugin: the manifest's ``plugin`` entry (``name``, ``version``, ``namespace``,
            ``library``).
        library: the library file (:func:`edgebuild.engine.plugin_library.plugin_library_path`), None if
            none was found.
        bundle: the bundle directory (for messages).

    Raises:
        MissingDependencyError: the library is missing, does not load, or does not register
            the plugin name/version/namespace the manifest records; the message names the
            library and how to build it.
    """
    want = f"{plugin['name']} version {plugin['version']} (namespace {plugin['namespace']!r})"
    fix = plugin_build_hint()
    if library is None or not Path(library).is_file():
        raise MissingDependencyError(
            f"{bundle}: the engines use the {want} plugin, but its library "
            f"{plugin['library']} was not found{f' at {library}' if library else ''}; " + fix
        )
    handle = registry.load_library(str(library))
    if handle is None:
        raise MissingDependencyError(
            f"{library}: TensorRT could not load the plugin library; {fix}"
        )
    creator = registry.get_creator(plugin["name"], str(plugin["version"]), plugin["namespace"])
    if creator is None:
        raise MissingDependencyError(
            f"{library} does not provide the {want} plugin that {bundle}/manifest.json records "
            f"(the library is another version); rebuild it: {fix}"
        )
    return Path(library)


def engine_io(trt, engine) -> list[EngineTensor]:
    """The I/O tensors of a deserialized engine (dims -1 where dynamic)."""
    out = []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        dtype = engine.get_tensor_dtype(name)
        out.append(
            EngineTensor(
                name,
                engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT,
                _TRT_DTYPES.get(dtype.name, dtype.name.lower()),
                tuple(int(d) for d in engine.get_tensor_shape(name)),
            )
        )
    return out


def profile_problems(engine, io: RoleIO, profiles: list[Profile]) -> list[str]:
    """Differences between the engine's optimization profiles and the planned ones."""
    if engine.num_optimization_profiles != len(profiles):
        return [
            f"{engine.num_optimization_profiles} optimization profiles in the engine, "
            f"{len(profiles)} planned ({', '.join(p.name for p in profiles)})"
        ]
    problems = []
    for k, prof in enumerate(profiles):
        for desc in io.inputs:
            got = engine.get_tensor_profile_shape(desc.name, k)
            got = tuple(tuple(int(d) for d in s) for s in got)
            want = prof.shapes[desc.name]
            if (got[0], got[2]) != (tuple(want[0]), tuple(want[2])):
                problems.append(
                    f"profile {prof.name} input '{desc.name}': min/max {got[0]}/{got[2]} in the "
                    f"engine, {want[0]}/{want[2]} from the manifest's build settings"
                )
    return problems


def alias_problems(engine, io: RoleIO) -> list[str]:
    """KV outputs that do not alias their inputs (the pool must be updated in place)."""
    out = []
    for desc in io.outputs:
        if desc.name.startswith(KV_OUTPUT):
            want = KV_INPUT + desc.name[len(KV_OUTPUT) :]
            got = engine.get_aliased_input_tensor(desc.name)
            if got != want:
                out.append(
                    f"output '{desc.name}' does not alias input '{want}' (aliased: {got!r}); "
                    "the engine was built without PreviewFeature.ALIASED_PLUGIN_IO_10_03 "
                    "(TensorRT >= 10.3 needed): rebuild it with `edgebuild build`"
                )
    return out


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    addresses: tuple[int, ...]


@dataclass
class GraphCache:
    """CUDA graphs of one engine, keyed by the call's shape key (see the module docstring)."""

    enabled: bool = True
    graphs: dict[tuple, _Graph] = field(default_factory=dict)
    seen: dict[tuple, int] = field(default_factory=dict)
    captures: int = 0
    replays: int = 0

    def lookup(self, key: tuple, addresses: tuple[int, ...]) -> _Graph | None:
        g = self.graphs.get(key)
        return g if g is not None and g.addresses == addresses else None

    def should_capture(self, key: tuple) -> bool:
        """True on the second sighting of ``key`` (shapes that repeat), while room is left."""
        self.seen[key] = self.seen.get(key, 0) + 1
        return self.enabled and self.seen[key] >= 2 and len(self.graphs) < MAX_GRAPHS


class TrtEngineRunner:
    """One role's engine: contexts per profile, per-call shapes and addresses, CUDA graphs.

    Args:
        trt: the ``tensorrt`` module.
        engine_path: the serialized engine (``BUNDLE/<role>/model.engine``).
        io: the role's declared I/O (manifest).
        profiles: the planned optimization profiles (checked against the engine's).
        stream: the torch CUDA stream every call is enqueued on.
        cuda_graphs: capture and replay repeated shapes.

    Raises:
        EngineError: the engine does not deserialize (built by another TensorRT or for another
            GPU), its I/O or profiles differ from the manifest, or its KV outputs do not alias
            the inputs.
    """

    def __init__(
        self,
        trt,
        engine_path: Path,
        io: RoleIO,
        profiles: list[Profile],
        stream: torch.cuda.Stream,
        cuda_graphs: bool = True,
    ):
        self.trt, self.io, self.stream, self.path = trt, io, stream, Path(engine_path)
        self.role = io.role
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(self.path.read_bytes())
        if self.engine is None:
            raise EngineError(
                f"{self.path}: TensorRT could not deserialize the engine (built with another "
                "TensorRT version, for another GPU, or without the plugin library loaded); "
                "rebuild it on this device with `edgebuild build`"
            )
        check_io_contract(engine_io(trt, self.engine), io, str(self.path))
        problems = profile_problems(self.engine, io, profiles) + alias_problems(self.engine, io)
        if problems:
            raise EngineError(f"{self.path}:\n  " + "\n  ".join(problems))
        self.inputs = frozenset(t.name for t in io.inputs)
        self.contexts = []
        for k in range(len(profiles)):
            ctx = self.engine.create_execution_context()
            if ctx is None:
                raise EngineError(
                    f"{self.path}: could not create an execution context (GPU memory?)"
                )
            if k:
                ctx.set_optimization_profile_async(k, stream.cuda_stream)
            self.contexts.append(ctx)
        stream.synchronize()
        self.graphs = GraphCache(enabled=cuda_graphs)

    def execute(
        self, profile: int, bindings: dict[str, torch.Tensor], graph_key: tuple | None = None
    ) -> None:
        """Run one call on ``self.stream``; outputs are written into their bound views.

        Args:
            profile: the optimization profile index (its context runs the call).
            bindings: every I/O tensor name -> the contiguous device view to use (inputs with
                the call's shapes).
            graph_key: shapes key for CUDA graphs (None: always eager).

        Raises:
            EngineError: a shape the profile refuses or a failed enqueue.
        """
        addresses = tuple(t.data_ptr() for t in bindings.values())
        if graph_key is not None:
            g = self.graphs.lookup((profile, *graph_key), addresses)
            if g is not None:
                with torch.cuda.stream(self.stream):
                    g.graph.replay()
                self.graphs.replays += 1
                return
        ctx = self.contexts[profile]
        for name, t in bindings.items():
            if name in self.inputs and not ctx.set_input_shape(name, tuple(t.shape)):
                raise EngineError(
                    f"{self.path}: input '{name}' shape {tuple(t.shape)} is outside profile "
                    f"{profile}"
                )
            ctx.set_tensor_address(name, t.data_ptr())
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise EngineError(f"{self.path}: TensorRT failed to enqueue the {self.role} engine")
        if graph_key is not None and self.graphs.should_capture((profile, *graph_key)):
            self._capture(ctx, (profile, *graph_key), addresses)

    def _capture(self, ctx, key: tuple, addresses: tuple[int, ...]) -> None:
        """Capture the context's enqueue for the shapes just run (the eager run flushed them)."""
        if hasattr(ctx, "is_stream_capturable") and not ctx.is_stream_capturable(
            self.stream.cuda_stream
        ):
            self.graphs.enabled = False
            log.warning(
                "%s: the context cannot be captured in a CUDA graph; running eagerly", self.path
            )
            return
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                ctx.execute_async_v3(self.stream.cuda_stream)
        except RuntimeError as exc:  # a plugin or TensorRT op that cannot be captured
            self.graphs.enabled = False
            log.warning("%s: CUDA graph capture failed (%s); running eagerly", self.path, exc)
            return
        self.graphs.graphs[key] = _Graph(graph, addresses)
        self.graphs.captures += 1
