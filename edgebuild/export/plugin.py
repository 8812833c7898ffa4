"""The attention plugin boundary of the exporter: the one module that knows the plugin's names.

Owns
* :class:`PluginContract`, read from ``plugins/contract.json`` (the machine-readable contract
  of the ``EdgebuildAttention`` TensorRT plugin, the same contract as the docstring of
  :mod:`edgebuild.ops.attention`): op type, domain, version, namespace, library, attribute
  names and types.
* The ONNX schema of the plugin node (registered with ``onnx.defs`` so that
  ``onnx.checker.check_model(full_check=True)`` checks the node's inputs, attributes and types
  and shape inference gives its outputs).
* ``edgebuild_export::paged_attention``: a *functional* twin of the reference op that returns
  ``(attn_out, present_kv_cache)`` instead of writing the cache in place, and
  :class:`FunctionalAttention`, the ``TorchFunctionMode`` that routes the models' calls of
  ``edgebuild::paged_attention`` to it while exporting. Why: ``torch.export`` turns an op that
  mutates an input into an ``auto_functionalized`` higher-order op that the ONNX exporter
  cannot translate, and it would drop the updated cache (an input mutation) from the graph
  outputs. With the twin, every attention call has the plugin's two outputs explicitly and a
  later call on the same cache (the DSpark block after the context update) reads the earlier
  call's ``present_kv_cache`` - the same data flow the aliased plugin output has on the GPU.
* :func:`plugin_attention`: the translation of the twin into one ``EdgebuildAttention`` node.

The portable translation (standard ONNX ops) lives in :mod:`edgebuild.export.portable`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from edgebuild.errors import ConfigError, MissingDependencyError
from edgebuild.ops.attention import ATTRIBUTES, AttentionSpec, paged_attention

CONTRACT_PATH = Path(__file__).resolve().parents[2] / "plugins" / "contract.json"

# ONNX element types of the attention inputs (onnx.TensorProto values).
_FLOAT_TYPES = ("tensor(float)", "tensor(float16)", "tensor(bfloat16)")
_CACHE_TYPES = (*_FLOAT_TYPES, "tensor(float8e4m3fn)")
_MASK_TYPES = ("tensor(bool)", "tensor(int8)", "tensor(uint8)")


@dataclass(frozen=True)
class PluginContract:
    """The plugin facts the exporter and the engine builder need (from ``contract.json``).

    Attributes:
        name, version, namespace: the TensorRT plugin creator's identity.
        library: file name of the plugin shared library (``libedgebuild_plugins.so``).
        domain, op_type: the ONNX node's domain and op type.
        node_attributes: string attributes every node carries (``plugin_version``,
            ``plugin_namespace``) so that TensorRT's ONNX parser finds the creator.
        attributes: ``[{"name", "type": "int"|"float", "required", "default",
            "reference_kwarg", ...}]`` in contract order.
        inputs, outputs: the contract's input / output specs, in order.
        path: where the contract was read from.
    """

    name: str
    version: str
    namespace: str
    library: str
    domain: str
    op_type: str
    node_attributes: dict[str, str]
    attributes: tuple[dict, ...]
    inputs: tuple[dict, ...]
    outputs: tuple[dict, ...]
    path: str = ""
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def load(cls, path: Path | None = None) -> PluginContract:
        """Read ``plugins/contract.json`` (or ``path``).

        Raises:
            MissingDependencyError: the file is missing (the exporter needs the repository's
                ``plugins/`` directory: the plugin is built from it on the device anyway).
            ConfigError: the file is not valid JSON or lacks a field.
        """
        path = Path(path) if path is not None else CONTRACT_PATH
        if not path.is_file():
            raise MissingDependencyError(
                f"{path}: the attention plugin contract is missing; export needs the edgebuild "
                "repository checkout (plugins/contract.json), e.g. `pip install -e .` from it"
            )
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            plugin, onnx_part = raw["plugin"], raw["onnx"]
            return cls(
                name=plugin["name"],
                version=str(plugin["version"]),
                namespace=plugin["namespace"],
                library=plugin["library"],
                domain=onnx_part["domain"],
                op_type=onnx_part["op_type"],
                node_attributes=dict(onnx_part["node_attributes"]),
                attributes=tuple(raw["attributes"]),
                inputs=tuple(raw["inputs"]),
                outputs=tuple(raw["outputs"]),
                path=str(path),
                raw=raw,
            )
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}: malformed plugin contract ({exc!r})") from None

    @property
    def onnx_version(self) -> int:
        """The opset version of the plugin's ONNX domain (the plugin version as an int)."""
        return int(self.version)

    def to_manifest(self) -> dict:
        """The bundle manifest's ``plugin`` entry."""
        return {
            "name": self.name,
            "version": self.version,
            "namespace": self.namespace,
            "library": self.library,
            "onnx_domain": self.domain,
            "onnx_op_type": self.op_type,
        }

    def node_attribute_values(
        self, kwargs: dict[str, Any], *, qk_norm: bool, tree_mask: bool, fp8_cache: bool
    ) -> dict[str, Any]:
        """Every attribute of one plugin node, in contract order, plus the string attributes.

        ``kwargs`` are the reference op's keyword attributes (defaults filled in from the
        contract when absent). Ints and bools become ``int``, floats ``float``; the derived
        attributes (``qk_norm``, ``has_tree_mask``, ``fp8_kv_cache``, ``kv_scale``) come from
        which inputs exist and the cache dtype.

        Raises:
            ConfigError: a required attribute is missing or the contract names an attribute
                this exporter cannot derive (the contract changed; update this module).
        """
        derived = {
            "qk_norm": int(qk_norm),
            "has_tree_mask": int(tree_mask),
            "fp8_kv_cache": int(fp8_cache),
            "kv_scale": 1.0,
        }
        out: dict[str, Any] = {}
        for spec in self.attributes:
            name, kwarg = spec["name"], spec.get("reference_kwarg")
            if kwarg:
                if kwarg in kwargs:
                    value = kwargs[kwarg]
                elif not spec.get("required", False):
                    value = spec["default"]
                else:
                    raise ConfigError(
                        f"{self.path}: attribute '{name}' is required but the attention call "
                        "did not give it"
                    )
            elif name in derived:
                value = derived[name]
            else:
                raise ConfigError(
                    f"{self.path}: attribute '{name}' is neither a reference-op keyword nor one "
                    "the exporter derives; update edgebuild/export/plugin.py with the contract"
                )
            out[name] = float(value) if spec["type"] == "float" else int(value)
        out.update(self.node_attributes)
        return out


_CONTRACT: PluginContract | None = None


def contract() -> PluginContract:
    """The loaded plugin contract (read once per process)."""
    global _CONTRACT
    if _CONTRACT is None:
        _CONTRACT = PluginContract.load()
    return _CONTRACT


# ----------------------------------------------------------------------------- ONNX schema
def _infer_attention(ctx) -> None:
    """Shape inference of the plugin node: ``[B, S, Hq*D]`` like qkv; the cache as given."""
    qkv = ctx.get_input_type(0)
    heads = onnx.helper.get_attribute_value(ctx.get_attribute("num_q_heads"))
    head_dim = onnx.helper.get_attribute_value(ctx.get_attribute("head_dim"))
    out = onnx.TypeProto()
    out.tensor_type.elem_type = qkv.tensor_type.elem_type
    dims = list(qkv.tensor_type.shape.dim)
    for dim in dims[:2]:
        out.tensor_type.shape.dim.add().CopyFrom(dim)
    if len(dims) == 3:
        out.tensor_type.shape.dim.add().dim_value = heads * head_dim
    ctx.set_output_type(0, out)
    ctx.set_output_type(1, ctx.get_input_type(1))


def _onnx_schema(c: PluginContract) -> onnx.defs.OpSchema:
    """An ``onnx.defs.OpSchema`` for the plugin node built from the contract."""
    schema_cls = onnx.defs.OpSchema
    types = {"qkv": "T", "kv_cache": "TC", "tree_mask": "TM", "q_norm_weight": "T"}
    types["k_norm_weight"] = "T"
    inputs = []
    for spec in c.inputs:
        type_str = types.get(spec["name"], "tensor(" + spec["dtypes"][0] + ")")
        type_str = type_str.replace("tensor(float32)", "tensor(float)")
        option = (
            schema_cls.FormalParameterOption.Optional
            if spec["optional"]
            else schema_cls.FormalParameterOption.Single
        )
        inputs.append(schema_cls.FormalParameter(spec["name"], type_str, param_option=option))
    outputs = [
        schema_cls.FormalParameter(o["name"], "TC" if o.get("aliases_input") else "T")
        for o in c.outputs
    ]
    attr_type = {"int": schema_cls.AttrType.INT, "float": schema_cls.AttrType.FLOAT}
    attributes = [
        schema_cls.Attribute(a["name"], attr_type[a["type"]], required=bool(a["required"]))
        for a in c.attributes
    ]
    attributes += [
        schema_cls.Attribute(name, schema_cls.AttrType.STRING, required=True)
        for name in c.node_attributes
    ]
    schema = schema_cls(
        c.op_type,
        c.domain,
        c.onnx_version,
        f"TensorRT plugin {c.name} v{c.version} ({c.path}); contract: edgebuild.ops.attention",
        inputs=inputs,
        outputs=outputs,
        type_constraints=[
            ("T", list(_FLOAT_TYPES), "activations"),
            ("TC", list(_CACHE_TYPES), "KV cache"),
            ("TM", list(_MASK_TYPES), "tree mask"),
        ],
        attributes=attributes,
    )
    schema.set_type_and_shape_inference_function(_infer_attention)
    return schema


def register_onnx_schema(c: PluginContract | None = None) -> None:
    """Register the plugin node's schema with ``onnx.defs`` (idempotent, process-wide)."""
    c = c or contract()
    try:
        onnx.defs.get_schema(c.op_type, c.onnx_version, c.domain)
        return
    except onnx.defs.SchemaError:
        pass
    onnx.defs.register_schema(_onnx_schema(c))


# ----------------------------------------------------------------------------- functional twin
def _spec_of(arguments: dict[str, Any]) -> AttentionSpec:
    """The AttentionSpec of an op-schema function's arguments (its ``locals()``).

    The functional twin (a ``torch.library`` op: its schema comes from its signature) and the
    ONNX translations (their ONNX attributes bind by parameter name) must spell out the op's
    attributes as parameters; inside, they carry them as one record.
    """
    return AttentionSpec.from_attributes({name: arguments[name] for name in ATTRIBUTES})


@torch.library.custom_op("edgebuild_export::paged_attention", mutates_args=())
def functional_paged_attention(
    qkv: Tensor,
    kv_cache: Tensor,
    page_table: Tensor,
    past_lengths: Tensor,
    input_lengths: Tensor,
    positions: Tensor,
    rope_cos_sin: Tensor,
    q_norm_weight: Tensor | None,
    k_norm_weight: Tensor | None,
    tree_mask: Tensor | None,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    causal: bool,
    write_kv: bool,
    sliding_window: int = 0,
    scale: float,
    rms_norm_eps: float = 1e-6,
    page_size: int,
) -> tuple[Tensor, Tensor]:
    """``edgebuild::paged_attention`` without the in-place write.

    Same arguments and contract as :func:`edgebuild.ops.attention.paged_attention`; returns
    ``(attn_out [B, S, Hq*D], present_kv_cache)`` where ``present_kv_cache`` is a copy of
    ``kv_cache`` with this call's writes. ``page_size <= 0`` means ``kv_cache.shape[3]`` (the
    portable export's dynamic dense capacity).
    """
    spec = _spec_of(locals())
    if page_size <= 0:
        spec = spec.replace(page_size=kv_cache.shape[3])
    present = kv_cache.clone()
    out = paged_attention(
        qkv,
        present,
        page_table,
        past_lengths,
        input_lengths,
        positions,
        rope_cos_sin,
        q_norm_weight,
        k_norm_weight,
        tree_mask,
        **spec.attributes(),
    )
    return out, present


@functional_paged_attention.register_fake
def _functional_fake(qkv, kv_cache, *args, num_q_heads, head_dim, **kwargs):
    return qkv.new_empty(qkv.shape[0], qkv.shape[1], num_q_heads * head_dim), torch.empty_like(
        kv_cache
    )


class FunctionalAttention(TorchFunctionMode):
    """Route ``edgebuild::paged_attention`` calls to the functional twin (export only).

    ``present(kv)`` is the latest cache value of an input cache ``kv`` (the input itself when
    no call wrote it). ``dynamic_page_size`` makes the page size symbolic (``-1``): the
    portable graphs' dense caches have a dynamic capacity in the page-size position.
    """

    def __init__(self, dynamic_page_size: bool = False):
        super().__init__()
        self._latest: dict[int, tuple[Tensor, Tensor]] = {}
        self.dynamic_page_size = dynamic_page_size

    def present(self, kv_cache: Tensor) -> Tensor:
        """The current value of cache ``kv_cache`` after the calls seen so far."""
        return self._latest.get(id(kv_cache), (kv_cache, kv_cache))[1]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        op = torch.ops.edgebuild.paged_attention
        if func is not op and func is not op.default:
            return func(*args, **kwargs)
        args = list(args)
        original = args[1]
        args[1] = self.present(original)
        if self.dynamic_page_size:
            kwargs["page_size"] = -1
        # the mode is popped while its __torch_function__ runs: this call is not intercepted
        out, present = torch.ops.edgebuild_export.paged_attention(*args, **kwargs)
        self._latest[id(original)] = (original, present)
        return out


# ----------------------------------------------------------------------------- translation
def _opset():
    import onnxscript

    register_onnx_schema()
    c = contract()
    return onnxscript.values.Opset(c.domain, c.onnx_version)


def plugin_attention(
    qkv,
    kv_cache,
    page_table,
    past_lengths,
    input_lengths,
    positions,
    rope_cos_sin,
    q_norm_weight=None,
    k_norm_weight=None,
    tree_mask=None,
    num_q_heads: int = 0,
    num_kv_heads: int = 0,
    head_dim: int = 0,
    rotary_dim: int = 0,
    causal: bool = True,
    write_kv: bool = True,
    sliding_window: int = 0,
    scale: float = 1.0,
    rms_norm_eps: float = 1e-6,
    page_size: int = 0,
) -> tuple[Any, Any]:
    """Translate the functional twin into one ``EdgebuildAttention`` plugin node.

    Inputs are the contract's, optional ones left out when absent. The plugin takes q/k norm
    gammas together (``qk_norm``); the only caller with a k-norm and no q-norm is the DSpark
    context update, whose q rows are zero and whose output is unused, so the k gamma is given
    for q as well there (``rms_norm(0) == 0`` whatever the gamma).

    Raises:
        ConfigError: a dynamic page size (plugin graphs need a fixed ``page_size``) or a tree
            mask (tree verification is not exported yet).
    """
    if not isinstance(page_size, int) or page_size <= 0:
        raise ConfigError(
            f"plugin export needs a fixed KV page size, got {page_size!r}; the KV cache input "
            "must have a static page_size dimension (set build.page_size)"
        )
    if tree_mask is not None:
        raise ConfigError("tree verification (tree_mask) is not exported yet; use chain verify")
    if (q_norm_weight is None) != (k_norm_weight is None):
        q_norm_weight = q_norm_weight if q_norm_weight is not None else k_norm_weight
        k_norm_weight = k_norm_weight if k_norm_weight is not None else q_norm_weight
    c = contract()
    qk_norm = q_norm_weight is not None
    fp8 = kv_cache.dtype is not None and "FLOAT8" in str(kv_cache.dtype)
    attrs = c.node_attribute_values(
        _spec_of(locals()).attributes(),
        qk_norm=qk_norm,
        tree_mask=False,
        fp8_cache=fp8,
    )
    inputs = [qkv, kv_cache, page_table, past_lengths, input_lengths, positions, rope_cos_sin]
    if qk_norm:
        inputs += [q_norm_weight, k_norm_weight]
    node = getattr(_opset(), c.op_type)
    attn_out, present = node(*inputs, **attrs)
    return attn_out, present
