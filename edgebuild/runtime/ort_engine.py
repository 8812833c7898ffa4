"""onnxruntime sessions standing in for TensorRT engines: :class:`OrtRunner` has the interface
:mod:`edgebuild.runtime.trt` drives engines through (``execute(profile, bindings, graph_key)``
on the buffers :class:`~edgebuild.runtime.trt.buffers.RoleBuffers` plans), over a bundle's
own graphs (``roles.<role>.onnx`` of the manifest: ``base/model.onnx``, ``base/draft.onnx``,
``visual/model.onnx``; never rewritten on disk), on the CPU.

* Inputs are the bound views (zero-copy numpy views of the CPU buffers); every output is
  copied into its bound view, but for the KV outputs: ``present_kv_cache_i`` is bound to the
  pool ``kv_cache_i`` itself, as TensorRT aliases it, and the plugin node writes its K/V rows
  straight into that pool (:func:`~edgebuild.runtime.ort_attention.bound_pools`; the whole
  pool never goes back through onnxruntime). A node that did not (no such binding) has its
  full ``present_kv_cache`` output copied into the pool instead.
* The ``EdgebuildAttention`` plugin node runs the plugin's host code
  (:mod:`edgebuild.runtime.ort_attention`).
* FP4 ``DequantizeLinear`` chains (NVFP4 weights), which onnxruntime cannot execute, are
  folded into their float32 weights in the loaded copy of the graph
  (:mod:`edgebuild.runtime.ort_dequant`).
* ``profile`` and ``graph_key`` are recorded (``keys``), not used: onnxruntime has no
  optimization profiles or CUDA graphs; the shapes are checked against the profile anyway, as
  TensorRT's ``set_input_shape`` would.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from edgebuild.errors import EngineError, MissingDependencyError
from edgebuild.runtime.trt_plan import EngineTensor, Profile, RoleIO, check_io_contract

log = logging.getLogger("edgebuild.runtime")

_ORT_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16",
               "tensor(bfloat16)": "bfloat16", "tensor(int32)": "int32",
               "tensor(int64)": "int64", "tensor(bool)": "bool"}  # fmt: skip


def load_onnxruntime():
    """Import ``onnxruntime``.

    Raises:
        MissingDependencyError: not installed (``pip install 'edgebuild[export]'``).
    """
    try:
        import onnxruntime
    except ImportError as exc:
        raise MissingDependencyError(
            f"the onnxruntime backend needs onnxruntime ({exc}); pip install 'edgebuild[export]'"
        ) from None
    return onnxruntime


def session_io(session) -> list[EngineTensor]:
    """A session's I/O as an engine reports it (dims -1 where symbolic)."""

    def conv(arg, is_input):
        dims = tuple(d if isinstance(d, int) else -1 for d in arg.shape)
        return EngineTensor(arg.name, is_input, _ORT_DTYPES.get(arg.type, arg.type), dims)

    return [conv(a, True) for a in session.get_inputs()] + [
        conv(a, False) for a in session.get_outputs()
    ]


class OrtRunner:
    """One role's ``model.onnx`` in an onnxruntime CPU session, run like an engine.

    Args:
        onnx_path: the role's graph (``roles.<role>.onnx``; its external weights beside it).
        io: the role's declared I/O (manifest), checked against the session's.
        profiles: the role's optimization profiles (call shapes are checked against them).
        threads: onnxruntime intra-op threads (0: onnxruntime's default).

    Raises:
        EngineError: the graph does not load, or its I/O differs from the manifest.
        MissingDependencyError: onnxruntime / onnxruntime-extensions / g++ missing.
    """

    def __init__(self, onnx_path: Path, io: RoleIO, profiles: list[Profile], threads: int = 0):
        import onnx

        from edgebuild.runtime.ort_attention import register_attention_op, session_model
        from edgebuild.runtime.ort_dequant import fold_fp4_dequantize

        ort = load_onnxruntime()
        self.path, self.io, self.role, self.profiles = Path(onnx_path), io, io.role, profiles
        options = ort.SessionOptions()
        options.register_custom_ops_library(register_attention_op())
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        try:
            model = onnx.load(str(self.path))
            self.folded = fold_fp4_dequantize(model)  # in memory (ort_dequant)
            self.session = ort.InferenceSession(
                session_model(model), options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # onnx / onnxruntime raise their own types
            raise EngineError(
                f"{self.path}: onnxruntime could not load the graph ({exc}); rebuild the bundle "
                "with `edgebuild build --onnx-only --dtype float32`"
            ) from None
        check_io_contract(session_io(self.session), io, str(self.path))
        self.inputs = [t.name for t in io.inputs]
        self.outputs = [t.name for t in io.outputs]
        self.keys: list[tuple[int, tuple | None]] = []
        # present_kv_cache_i -> kv_cache_i: TensorRT aliases them (the pool, updated in place)
        self.aliases = {o: "kv_cache_" + o.removeprefix("present_kv_cache_")
                        for o in self.outputs if o.startswith("present_kv_cache_")}  # fmt: skip
        self.in_place = 0  # KV outputs written in place (not copied back) so far

    @torch.no_grad()
    def execute(
        self, profile: int, bindings: dict[str, torch.Tensor], graph_key: tuple | None = None
    ) -> None:
        """Run one call; outputs are copied into their bound views (KV outputs: the pools).

        Args:
            profile: the optimization profile the call's shapes must lie in.
            bindings: every I/O tensor name -> its contiguous CPU view (inputs at the call's
                shapes).
            graph_key: recorded only (no CUDA graphs here).

        Raises:
            EngineError: an input shape outside the profile, or onnxruntime failed.
        """
        self.keys.append((profile, graph_key))
        prof = self.profiles[profile]
        shapes = {n: tuple(bindings[n].shape) for n in self.inputs}
        if not prof.admits(shapes):
            raise EngineError(f"{self.path}: input shapes {shapes} are outside profile {prof.name}")
        from edgebuild.runtime.ort_attention import bound_pools, take_errors

        take_errors()
        feed = {n: bindings[n].numpy() for n in self.inputs}
        pools = {i: feed[i] for i in self.aliases.values()}
        try:
            with bound_pools(pools) as written:
                outs = self.session.run(self.outputs, feed)
        except Exception as exc:
            raise EngineError(
                f"{self.path}: onnxruntime failed on the {self.role} graph: {exc}"
            ) from None
        refused = take_errors()
        if refused:
            raise EngineError(
                f"{self.path}: the {self.role} graph's attention node refused the call: "
                f"{refused[0]}"
            )
        for name, value in zip(self.outputs, outs, strict=True):
            if self.aliases.get(name) in written:
                self.in_place += 1
                continue  # the plugin node wrote this pool in place (ort_attention)
            dst = bindings[name]
            src = torch.from_numpy(value)
            if tuple(src.shape) != tuple(dst.shape):
                raise EngineError(
                    f"{self.path}: output '{name}' has shape {tuple(src.shape)}, the bound "
                    f"buffer {tuple(dst.shape)}"
                )
            dst.copy_(src)


def _check_visual_graph(manifest: dict, config, bundle: Path) -> bool:
    """True when the target is a VLM: its ``visual`` graph (``roles.visual.onnx``, no engine
    needed here) and the base graph's image inputs, as the TensorRT backend checks engines.

    Raises:
        ConfigError: a VLM target whose bundle has no visual graph or whose base graph has no
            image inputs.
    """
    from edgebuild.errors import ConfigError
    from edgebuild.runtime.trt.runtime import _check_vision

    if config.vision_config is None:
        return False
    roles = manifest.get("roles") or {}
    visual = roles.get("visual") or {}
    if not visual.get("onnx"):
        raise ConfigError(
            f"{bundle}: the target is a vision-language model but the bundle has no visual "
            "graph (manifest roles.visual.onnx); rebuild it with `edgebuild build --onnx-only "
            "--dtype float32`, or use --backend torch"
        )
    as_engines = {**roles, "visual": {**visual, "engine": visual["onnx"]}}
    return _check_vision({**manifest, "roles": as_engines}, config, bundle)


def open_ort_runtime(resolved, spec, threads: int = 0, source=None):
    """A bundle's ONNX graphs in onnxruntime sessions, driven by :mod:`edgebuild.runtime.trt`
    (the ``onnxruntime`` backend): :func:`~edgebuild.runtime.trt.runtime.assemble_runtime`
    over one :class:`OrtRunner` per role, on the CPU.

    Raises:
        ConfigError: not a bundle, a graph that is not float32, a speculative config the
            graphs cannot run (as on TensorRT).
        MissingDependencyError / EngineError: see :class:`OrtRunner`.
    """
    from edgebuild.checkpoint.config import ModelConfig
    from edgebuild.checkpoint.source import WeightSource
    from edgebuild.errors import ConfigError
    from edgebuild.runtime.trt.runtime import _check_spec, assemble_runtime
    from edgebuild.runtime.trt_plan import EngineLimits, role_io, role_profiles

    if resolved.bundle is None:
        raise ConfigError(
            f"{resolved.target}: the onnxruntime backend runs bundles (edgebuild build)"
        )
    bundle, manifest = Path(resolved.bundle), resolved.manifest
    source = source if source is not None else WeightSource(resolved.target)
    config = ModelConfig.from_dict(source.config, str(source.config_path))
    with_visual = _check_visual_graph(manifest, config, bundle)
    with_draft = _check_spec(manifest, spec, EngineLimits.from_manifest(manifest), bundle)
    roles = ["base", *(["draft"] if with_draft else []), *(["visual"] if with_visual else [])]
    graphs = {r: bundle / (manifest["roles"][r].get("onnx") or f"{r}/model.onnx") for r in roles}
    for role in roles:
        io = role_io(manifest, role)
        wide = sorted({t.dtype for t in io.inputs if t.dtype.startswith(("bfloat", "float1"))})
        if wide:
            raise ConfigError(
                f"{graphs[role]} is a {wide[0]} graph; onnxruntime's CPU provider "
                "has no kernels for it (MatMul); rebuild the bundle with "
                "`edgebuild build --onnx-only --dtype float32` to run it on this backend"
            )
    runners = {
        role: OrtRunner(
            graphs[role], role_io(manifest, role), role_profiles(manifest, role),
            threads,
        )
        for role in roles
    }  # fmt: skip
    return assemble_runtime(manifest, source, runners, "cpu")
