"""The ``base`` graph: plugin nodes that follow the contract, portable graphs that match torch.

Tiny random checkpoints (Qwen3 with q/k norm, Qwen2 with biases and a sliding window, a tied
Llama). Portable graphs run in onnxruntime against the model's own ``forward`` over the same
cache (the dense per-sequence layout is the paged contract with one page per sequence).
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import onnx
import pytest
import torch
from export_fixtures import base_feeds, make_tiny_target, run_ort

from edgebuild.checkpoint.source import WeightSource
from edgebuild.export import ExportOptions, GraphKind, export_base
from edgebuild.export import weights as weights_module
from edgebuild.models.common import PagedBatch
from edgebuild.models.llama import LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = json.loads((ROOT / "plugins" / "contract.json").read_text())
ONNX_ATTR = {"int": onnx.AttributeProto.INT, "float": onnx.AttributeProto.FLOAT}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("ckpt") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def plugin_export(qwen3, tmp_path_factory):
    out = tmp_path_factory.mktemp("plugin")
    options = ExportOptions(kind=GraphKind.PLUGIN, dtype="float32", page_size=16)
    return export_base(WeightSource(qwen3), out, options, tap_layers=(0, 1))


def _plugin_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == CONTRACT["onnx"]["op_type"]]


def test_plugin_graph_passes_the_full_onnx_check_with_shape_inference(plugin_export):
    onnx.checker.check_model(str(plugin_export.onnx_path), full_check=True)
    model = onnx.load(str(plugin_export.onnx_path), load_external_data=False)
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {v.name: v for v in inferred.graph.value_info}
    node = _plugin_nodes(model)[0]
    attn_out = shapes[node.output[0]].type.tensor_type
    assert [d.dim_value or d.dim_param for d in attn_out.shape.dim][2] == 4 * 16  # Hq * D


def test_plugin_nodes_carry_exactly_the_contract_attributes_and_inputs(plugin_export):
    model = onnx.load(str(plugin_export.onnx_path), load_external_data=False)
    nodes = _plugin_nodes(model)
    assert len(nodes) == 3  # one per layer
    opsets = {o.domain: o.version for o in model.opset_import}
    assert opsets[CONTRACT["onnx"]["domain"]] == int(CONTRACT["plugin"]["version"])
    expected_names = {a["name"] for a in CONTRACT["attributes"]} | set(
        CONTRACT["onnx"]["node_attributes"]
    )
    graph_inputs = [i.name for i in model.graph.input]
    for layer, node in enumerate(nodes):
        assert node.domain == CONTRACT["onnx"]["domain"]
        attrs = {a.name: a for a in node.attribute}
        assert set(attrs) == expected_names
        for spec in CONTRACT["attributes"]:
            assert attrs[spec["name"]].type == ONNX_ATTR[spec["type"]], spec["name"]
        for key, value in CONTRACT["onnx"]["node_attributes"].items():
            assert attrs[key].s.decode() == value
        values = {k: onnx.helper.get_attribute_value(a) for k, a in attrs.items()}
        assert values["num_q_heads"] == 4 and values["num_kv_heads"] == 2
        assert values["head_dim"] == 16 and values["rotary_dim"] == 16
        assert values["causal"] == 1 and values["write_kv"] == 1 and values["qk_norm"] == 1
        assert values["page_size"] == 16 and values["has_tree_mask"] == 0
        assert values["scale"] == pytest.approx(0.25)
        # inputs in contract order, optional q/k norm gammas present (qk_norm = 1)
        required = [i["name"] for i in CONTRACT["inputs"] if not i["optional"]]
        assert len(node.input) == len(required) + 2
        assert node.input[1] == f"kv_cache_{layer}"
        assert list(node.input[2:6]) == graph_inputs[5:6] + graph_inputs[2:4] + ["positions"]
        assert node.input[7].endswith("q_norm.weight") and node.input[8].endswith("k_norm.weight")
        assert node.output[1] == f"present_kv_cache_{layer}"


def test_graph_inputs_and_outputs_are_the_declared_io_with_named_dynamic_axes(plugin_export):
    model = onnx.load(str(plugin_export.onnx_path), load_external_data=False)

    def dims(v):
        return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]

    declared_in = [(s.name, list(s.dims)) for s in plugin_export.inputs]
    declared_out = [(s.name, list(s.dims)) for s in plugin_export.outputs]
    assert [(i.name, dims(i)) for i in model.graph.input] == declared_in
    assert [(o.name, dims(o)) for o in model.graph.output] == declared_out
    assert dims(model.graph.input[0]) == ["batch", "seq"]
    assert dims(model.graph.input[6]) == ["num_pages", 2, 2, 16, 16]
    props = {p.key: p.value for p in model.metadata_props}
    assert props["edgebuild.role"] == "base" and props["edgebuild.graph_kind"] == "plugin"
    assert json.loads(props["edgebuild.tap_layers"]) == [0, 1]
    # weights live in the external data file; only small folded constants stay inline
    for t in model.graph.initializer:
        if t.name.endswith(".weight") or t.name == "rope_cos_sin":
            assert t.data_location == onnx.TensorProto.EXTERNAL, t.name
        else:
            assert t.data_location == onnx.TensorProto.DEFAULT and len(t.raw_data) < 1024


def _torch_reference(ckpt: Path, feeds: dict, taps: tuple[int, ...]):
    """The model's own forward over the dense layout (one page of T slots per sequence)."""
    model = LlamaForCausalLM.from_source(WeightSource(ckpt), torch.float32)
    caches = [feeds[f"kv_cache_{i}"].clone() for i in range(model.config.num_hidden_layers)]
    batch = PagedBatch(
        torch.arange(len(caches[0]), dtype=torch.int32).unsqueeze(1),
        feeds["past_lengths"],
        feeds["input_lengths"],
        feeds["positions"],
    )
    logits, tapped = model(
        caches,
        batch,
        input_ids=feeds["input_ids"],
        logits_rows=feeds["logits_rows"].long(),
        tap_layers=taps,
    )
    return model.config, logits, tapped, caches


CASES = {
    "qwen3-qknorm": ("qwen3", False, {}),
    "qwen2-bias-sliding-window": (
        "qwen2",
        False,
        {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1},
    ),
    "llama-tied-gqa": ("llama", True, {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_portable_base_graph_matches_the_torch_model_in_onnxruntime(case, tmp_path):
    arch, tied, overrides = CASES[case]
    ckpt = make_tiny_target(tmp_path / "ckpt", arch, tied=tied, **overrides)
    options = ExportOptions(kind=GraphKind.PORTABLE, dtype="float32")
    exported = export_base(WeightSource(ckpt), tmp_path / "out", options, tap_layers=(0, 1))
    assert not any(n.domain for n in onnx.load(str(exported.onnx_path)).graph.node)
    cfg_json = json.loads((ckpt / "config.json").read_text())
    from edgebuild.checkpoint.config import ModelConfig

    feeds = base_feeds(ModelConfig.from_dict(cfg_json))
    cfg, logits, taps, caches = _torch_reference(ckpt, feeds, (0, 1))
    got = run_ort(exported.onnx_path, feeds)
    torch.testing.assert_close(torch.from_numpy(got["logits"]), logits, atol=1e-3, rtol=0)
    lengths = feeds["input_lengths"].tolist()
    for b, n in enumerate(lengths):  # padding rows are unspecified
        torch.testing.assert_close(
            torch.from_numpy(got["target_hidden_states"][b, :n]), taps[b, :n], atol=1e-4, rtol=0
        )
    for i, cache in enumerate(caches):
        torch.testing.assert_close(
            torch.from_numpy(got[f"present_kv_cache_{i}"]), cache, atol=1e-4, rtol=0
        )
    if tied:  # one embedding initializer serves the Gather and the head
        names = {t.name for t in onnx.load(str(exported.onnx_path)).graph.initializer}
        assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


def test_weights_are_streamed_one_tensor_at_a_time(qwen3, tmp_path, monkeypatch):
    """materialize drops each tensor before loading the next (bounded memory)."""
    live: list[weakref.ref] = []
    real_entries = weights_module.base_entries

    def tracking_entries(source, tied):
        entries = real_entries(source, tied)
        for name, entry in list(entries.items()):

            def load(inner=entry.load):
                assert all(ref() is None for ref in live), "a previous weight is still alive"
                value = inner()
                live.append(weakref.ref(value))
                return value

            entries[name] = weights_module.WeightEntry(
                name, load, entry.checkpoint_source, entry.file, entry.tensor
            )
        return entries

    import edgebuild.export.exporter as exporter

    monkeypatch.setattr(exporter, "base_entries", tracking_entries)
    options = ExportOptions(kind=GraphKind.PLUGIN, dtype="float32")
    export_base(WeightSource(qwen3), tmp_path, options)
    assert len(live) > 20
