"""Quantized weights in exported graphs: NVFP4 (ModelOpt) and FP8 as DequantizeLinear chains.

Each chain is evaluated with onnx's reference evaluator and must equal the checkpoint's own
dequantization (:meth:`QuantizedWeight.dequantize`) exactly; the dense mode (weights
dequantized at export) runs in onnxruntime and matches the torch model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from export_fixtures import base_feeds, make_tiny_target, run_ort
from onnx.reference import ReferenceEvaluator
from safetensors.torch import load_file, save_file

from edgebuild.checkpoint.source import WeightSource
from edgebuild.export import ExportOptions, GraphKind, WeightMode, export_base
from edgebuild.models.common import PagedBatch
from edgebuild.models.llama import LlamaForCausalLM

pytest.importorskip("modelopt", reason="the NVFP4 fixture needs nvidia-modelopt")


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory) -> Path:
    from modelopt_fixtures import make_tiny_nvfp4_qwen3

    return make_tiny_nvfp4_qwen3(tmp_path_factory.mktemp("nvfp4"), quantize_lm_head=True)


def _chain_values(onnx_path: Path) -> dict[str, np.ndarray]:
    """Evaluate every DequantizeLinear chain of a graph: {weight name: dense fp32 value}."""
    model = onnx.load(str(onnx_path))  # with external data
    inits = {t.name: t for t in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    out = {}
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or not node.output[0].endswith(".dequantized"):
            continue
        chain, pending = [], [node]
        while pending:  # collect the DQ nodes feeding this one (the NVFP4 scale DQ)
            n = pending.pop()
            chain.insert(0, n)
            pending += [producers[i] for i in n.input if i in producers]
        needed = {i for n in chain for i in n.input if i in inits}
        graph = onnx.helper.make_graph(
            chain,
            "chain",
            [],
            [onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None)],
            [inits[i] for i in sorted(needed)],
        )
        sub = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 23)])
        out[node.input[0]] = ReferenceEvaluator(sub).run(None, {})[0]
    return out


def test_nvfp4_weights_become_two_dequantize_linear_nodes_equal_to_the_checkpoint(nvfp4, tmp_path):
    options = ExportOptions(kind=GraphKind.PLUGIN, dtype="float32")
    exported = export_base(WeightSource(nvfp4), tmp_path, options)
    model = onnx.load(str(exported.onnx_path), load_external_data=False)
    assert {o.domain: o.version for o in model.opset_import}[""] == 23
    inits = {t.name: t for t in model.graph.initializer}
    q = "model.layers.0.self_attn.q_proj"
    assert inits[f"{q}.weight"].data_type == onnx.TensorProto.FLOAT4E2M1
    assert list(inits[f"{q}.weight"].dims) == [64, 64]
    assert inits[f"{q}.weight_scale"].data_type == onnx.TensorProto.FLOAT8E4M3FN
    assert list(inits[f"{q}.weight_scale"].dims) == [64, 4]
    assert inits[f"{q}.weight_scale_2"].data_type == onnx.TensorProto.FLOAT
    nodes = {n.output[0]: n for n in model.graph.node}
    weight_dq = nodes[f"{q}.weight.dequantized"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in weight_dq.attribute}
    assert attrs == {"axis": -1, "block_size": 16}
    scale_dq = nodes[weight_dq.input[1]]
    assert scale_dq.op_type == "DequantizeLinear"
    assert list(scale_dq.input) == [f"{q}.weight_scale", f"{q}.weight_scale_2"]
    quantized = json.loads({p.key: p.value for p in model.metadata_props}["edgebuild.quantized"])
    assert quantized["lm_head.weight"] == "NVFP4" and len(quantized) == 2 * 7 + 1
    source = WeightSource(nvfp4)
    values = _chain_values(exported.onnx_path)
    assert len(values) == 15
    for name, value in values.items():
        expected = source.linear(name.rpartition(".")[0]).dequantize(torch.float32)
        np.testing.assert_array_equal(value, expected.numpy(), err_msg=name)


def test_nvfp4_dense_export_matches_the_dequantized_torch_model(nvfp4, tmp_path):
    options = ExportOptions(kind=GraphKind.PORTABLE, weights=WeightMode.DENSE, dtype="float32")
    exported = export_base(WeightSource(nvfp4), tmp_path, options)
    assert not any(
        n.op_type == "DequantizeLinear" for n in onnx.load(str(exported.onnx_path)).graph.node
    )
    model = LlamaForCausalLM.from_source(WeightSource(nvfp4), torch.float32)
    feeds = base_feeds(model.config)
    caches = [feeds[f"kv_cache_{i}"].clone() for i in range(model.config.num_hidden_layers)]
    batch = PagedBatch(
        torch.arange(2, dtype=torch.int32).unsqueeze(1),
        feeds["past_lengths"],
        feeds["input_lengths"],
        feeds["positions"],
    )
    logits, _ = model(
        caches, batch, input_ids=feeds["input_ids"], logits_rows=feeds["logits_rows"].long()
    )
    got = run_ort(exported.onnx_path, feeds)
    torch.testing.assert_close(torch.from_numpy(got["logits"]), logits, atol=1e-3, rtol=0)


def _fp8_checkpoint(src: Path, out: Path, block: tuple[int, int] | None) -> Path:
    """Quantize the linears of a tiny checkpoint to FP8 (per-tensor ModelOpt, or HF blocks)."""
    out.mkdir(parents=True)
    tensors = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    result = {}
    for name, w in tensors.items():
        if ".layers." not in name or not name.endswith("proj.weight"):
            result[name] = w
            continue
        prefix = name.rpartition(".")[0]
        if block is None:
            scale = w.abs().max().float() / 448.0
            result[name] = (w.float() / scale).to(torch.float8_e4m3fn)
            result[f"{prefix}.weight_scale"] = scale.reshape(())
        else:
            bo, bi = block
            rows, cols = -(-w.shape[0] // bo), -(-w.shape[1] // bi)
            scale = torch.empty(rows, cols)
            q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
            for r in range(rows):
                for c in range(cols):
                    tile = w[r * bo : (r + 1) * bo, c * bi : (c + 1) * bi].float()
                    scale[r, c] = tile.abs().max() / 448.0
                    q[r * bo : (r + 1) * bo, c * bi : (c + 1) * bi] = (tile / scale[r, c]).to(
                        torch.float8_e4m3fn
                    )
            result[name], result[f"{prefix}.weight_scale_inv"] = q, scale
    save_file(result, str(out / "model.safetensors"))
    if block is None:
        quant = {"quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}
        (out / "hf_quant_config.json").write_text(json.dumps(quant))
    else:
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": list(block),
        }
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("block", [None, (32, 48)], ids=["per-tensor", "block-32x48"])
def test_fp8_weights_become_dequantize_linear_equal_to_the_checkpoint(block, tmp_path):
    src = make_tiny_target(tmp_path / "src", "qwen3", num_hidden_layers=1)
    ckpt = _fp8_checkpoint(src, tmp_path / "fp8", block)
    options = ExportOptions(kind=GraphKind.PLUGIN, dtype="bfloat16")
    exported = export_base(WeightSource(ckpt), tmp_path / "out", options)
    onnx.checker.check_model(str(exported.onnx_path), full_check=True)
    model = onnx.load(str(exported.onnx_path), load_external_data=False)
    casts = [n for n in model.graph.node if n.op_type == "Cast" and n.output[0].endswith(".dense")]
    assert len(casts) == 7  # fp32 dequantized weights cast to the bf16 graph
    source = WeightSource(ckpt)
    values = _chain_values(exported.onnx_path)
    assert len(values) == 7
    for name, value in values.items():
        expected = source.linear(name.rpartition(".")[0]).dequantize(torch.float32)
        np.testing.assert_array_equal(value, expected.numpy(), err_msg=name)


def test_a_shared_nvfp4_head_stays_nvfp4_in_the_draft_graph_with_the_bases_bytes(nvfp4, tmp_path):
    """Issue 27: the draft borrows the target's NVFP4 ``lm_head``; with shared weights its
    graph names the base's FP4 codes and scales (same offsets of ``shared.onnx.data``), and
    the dequantized head equals the checkpoint's dequantization."""
    from dspark_fixtures import make_random_draft

    from edgebuild.checkpoint.config import ModelConfig
    from edgebuild.checkpoint.pairing import PairedSources
    from edgebuild.checkpoint.source import COMPONENT, TARGET
    from edgebuild.export import SharedWeights, export_draft

    draft = make_random_draft(tmp_path / "draft", nvfp4, num_layers=1, block_size=4)
    pair = PairedSources(WeightSource(draft, COMPONENT), WeightSource(nvfp4, TARGET))
    options = ExportOptions(kind=GraphKind.PLUGIN, dtype="float32", page_size=8)
    shared = SharedWeights.for_pair(pair)
    base = export_base(pair.target, tmp_path / "b", options, (0,), shared=shared)
    exported = export_draft(
        pair, ModelConfig.from_file(nvfp4), tmp_path / "d", options, shared=shared
    )

    def externals(path):
        model = onnx.load(str(path), load_external_data=False)
        return {
            i.name: (i.data_type, {e.key: e.value for e in i.external_data})
            for i in model.graph.initializer
        }

    b, d = externals(base.onnx_path), externals(exported.onnx_path)
    for name in ("lm_head.weight", "lm_head.weight_scale", "lm_head.weight_scale_2"):
        assert d[name] == b[name] and d[name][1]["location"] == "shared.onnx.data"
    assert d["lm_head.weight"][0] == onnx.TensorProto.FLOAT4E2M1
    assert exported.weights.quantized["lm_head.weight"] == "NVFP4"
    head = _chain_values(exported.onnx_path)["lm_head.weight"]
    want = WeightSource(nvfp4).linear("lm_head").dequantize(torch.float32)
    np.testing.assert_array_equal(head, want.numpy())
