"""Exported plugin graphs of the test fixtures, and their nodes' attributes as TensorRT sees them.

Owns :func:`fixture_plugin_graphs` (every tiny fixture checkpoint exported once per test
process as a ``plugin`` graph: Llama, Qwen2 with a sliding window, Qwen3 with q/k norm, the
DSpark draft, a Qwen2.5-VL base, plus an fp8-KV graph, whose node the exporter's own attribute
writer fills since the exporter has no fp8 cache option yet) and :func:`parser_fields` (an ONNX
node's attributes typed as TensorRT's ONNX parser types them: int -> INT32, float -> FLOAT32,
string -> CHAR).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import onnx

# TensorRT's ONNX parser (onnx-tensorrt, importerUtils / pluginImporter): attribute type ->
# PluginFieldType. Ints are narrowed to INT32, floats are FLOAT32, strings CHAR.
PARSER_FIELD_TYPES = {
    onnx.AttributeProto.INT: "int",
    onnx.AttributeProto.FLOAT: "float",
    onnx.AttributeProto.STRING: "string",
}


def parser_fields(node: onnx.NodeProto) -> list[tuple[str, str, int | float | str]]:
    """``(name, "int"|"float"|"string", value)`` of every attribute of ``node``, in order.

    Raises:
        ValueError: an attribute type the parser cannot pass to a plugin (names it).
    """
    out = []
    for attr in node.attribute:
        kind = PARSER_FIELD_TYPES.get(attr.type)
        if kind is None:
            raise ValueError(f"node {node.name}: attribute {attr.name} has ONNX type {attr.type}")
        value = onnx.helper.get_attribute_value(attr)
        out.append((attr.name, kind, value.decode() if isinstance(value, bytes) else value))
    return out


def plugin_nodes(path: Path, op_type: str = "EdgebuildAttention") -> list[onnx.NodeProto]:
    """The plugin nodes of ``path`` (weights not loaded)."""
    model = onnx.load(str(path), load_external_data=False)
    return [n for n in model.graph.node if n.op_type == op_type]


def _fp8_graph(out: Path) -> Path:
    """One plugin node with an fp8 e4m3 cache, attributes from the exporter's own writer."""
    from onnx import TensorProto, helper

    from edgebuild.export.plugin import contract

    c = contract()
    hq, hkv, d, page = 4, 2, 16, 8
    attrs = c.node_attribute_values(
        {
            "num_q_heads": hq,
            "num_kv_heads": hkv,
            "head_dim": d,
            "rotary_dim": d,
            "causal": True,
            "write_kv": True,
            "scale": d**-0.5,
            "page_size": page,
        },
        qk_norm=False,
        tree_mask=False,
        fp8_cache=True,
    )
    node = helper.make_node(
        c.op_type,
        ["qkv", "kv_cache", "page_table", "past_lengths", "input_lengths", "positions", "rope"],
        ["attn_out", "present_kv_cache"],
        name="fp8_attention",
        domain=c.domain,
        **attrs,
    )
    int32 = TensorProto.INT32
    inputs = [
        helper.make_tensor_value_info(
            "qkv", TensorProto.FLOAT16, ["batch", "seq", (hq + 2 * hkv) * d]
        ),
        helper.make_tensor_value_info(
            "kv_cache", TensorProto.FLOAT8E4M3FN, ["num_pages", 2, hkv, page, d]
        ),
        helper.make_tensor_value_info("page_table", int32, ["batch", "max_pages"]),
        helper.make_tensor_value_info("past_lengths", int32, ["batch"]),
        helper.make_tensor_value_info("input_lengths", int32, ["batch"]),
        helper.make_tensor_value_info("positions", int32, ["batch", "seq"]),
        helper.make_tensor_value_info("rope", TensorProto.FLOAT, [64, d]),
    ]
    outputs = [
        helper.make_tensor_value_info("attn_out", TensorProto.FLOAT16, ["batch", "seq", hq * d]),
        helper.make_tensor_value_info(
            "present_kv_cache", TensorProto.FLOAT8E4M3FN, ["num_pages", 2, hkv, page, d]
        ),
    ]
    graph = helper.make_graph([node], "fp8_kv", inputs, outputs)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(c.domain, c.onnx_version)],
    )
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out / "model.onnx"))
    return out / "model.onnx"


@functools.cache
def fixture_plugin_graphs() -> dict[str, Path]:
    """``{fixture name: model.onnx}`` of every fixture's plugin graph (exported once)."""
    from dspark_fixtures import make_random_draft
    from export_fixtures import make_tiny_target
    from vlm_fixtures import write_tiny_vlm

    from edgebuild.checkpoint.config import ModelConfig
    from edgebuild.checkpoint.pairing import PairedSources
    from edgebuild.checkpoint.source import COMPONENT, TARGET, WeightSource
    from edgebuild.export import ExportOptions, GraphKind, export_base, export_draft

    root = Path(tempfile.mkdtemp(prefix="edgebuild-plugin-graphs-"))
    options = ExportOptions(kind=GraphKind.PLUGIN, dtype="float32", page_size=16, rope_rows=64)
    targets = {
        "llama": make_tiny_target(root / "ckpt" / "llama", "llama"),
        "qwen2_sliding_window": make_tiny_target(
            root / "ckpt" / "qwen2",
            "qwen2",
            use_sliding_window=True,
            sliding_window=3,
            max_window_layers=1,
        ),
        "qwen3_qk_norm": make_tiny_target(root / "ckpt" / "qwen3", "qwen3"),
        "vlm_base": write_tiny_vlm(root / "ckpt" / "vlm"),
    }
    graphs = {}
    for name, ckpt in targets.items():
        graphs[name] = export_base(WeightSource(ckpt), root / name, options).onnx_path
    qwen3 = targets["qwen3_qk_norm"]
    draft = make_random_draft(root / "ckpt" / "draft", qwen3, num_layers=1, block_size=4)
    pair = PairedSources(WeightSource(draft, COMPONENT), WeightSource(qwen3, TARGET))
    graphs["dspark_draft"] = export_draft(
        pair, ModelConfig.from_file(qwen3), root / "draft", options
    ).onnx_path
    graphs["fp8_kv"] = _fp8_graph(root / "fp8_kv")
    return graphs
