"""The ``draft`` graph: DSpark context update + block + top-k lattice, plugin and portable.

The portable graph runs in onnxruntime against the same graph module run eagerly, and its
greedy chain walk over ``draft_scores`` proposes exactly the tokens (and confidences) of the
torch runtime's Markov walk (:class:`edgebuild.runtime.dspark_backend.TorchDraft`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from dspark_fixtures import make_random_draft
from export_fixtures import draft_feeds, make_tiny_target, run_ort, walk_greedy

from edgebuild.checkpoint.config import ModelConfig
from edgebuild.checkpoint.pairing import PairedSources
from edgebuild.checkpoint.source import COMPONENT, TARGET, WeightSource
from edgebuild.errors import ConfigError
from edgebuild.export import ExportOptions, GraphKind, export_draft
from edgebuild.export.graphs import ROPE_BUFFER, DraftGraph
from edgebuild.models.dspark import DSparkDraft
from edgebuild.ops.rope import rope_cos_sin_table
from edgebuild.runtime.dspark_backend import TorchDraft
from edgebuild.runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = json.loads((ROOT / "plugins" / "contract.json").read_text())
TOP_K = 5


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("ckpt") / "qwen3", "qwen3")


def _pair(draft: Path, target: Path) -> PairedSources:
    return PairedSources(WeightSource(draft, COMPONENT), WeightSource(target, TARGET))


def _eager_graph(pair: PairedSources, target: Path) -> DraftGraph:
    tcfg = ModelConfig.from_file(target)
    head, embed = pair.lm_head(), pair.embed_tokens()
    model = DSparkDraft.from_source(pair.draft, tcfg, head.value, embed.value, torch.float32)
    graph = DraftGraph(model, GraphKind.PORTABLE, 32, tcfg.max_position_embeddings, TOP_K)
    table = rope_cos_sin_table(model.config.head_dim, tcfg.max_position_embeddings, tcfg.rope)
    getattr(graph, ROPE_BUFFER).copy_(table)
    return graph


HEADS = {
    "vanilla-confidence-with-markov": dict(markov_head_type="vanilla", confidence=True),
    "gated-no-confidence": dict(markov_head_type="gated", confidence=False),
}


@pytest.mark.parametrize("case", sorted(HEADS))
def test_portable_draft_lattice_walks_to_the_torch_runtime_proposal(case, target, tmp_path):
    draft = make_random_draft(tmp_path / "draft", target, num_layers=2, block_size=4, **HEADS[case])
    pair = _pair(draft, target)
    options = ExportOptions(kind=GraphKind.PORTABLE, dtype="float32", top_k=TOP_K)
    exported = export_draft(pair, ModelConfig.from_file(target), tmp_path / "out", options)
    graph = _eager_graph(pair, target)
    cfg = graph.config
    feeds = draft_feeds(cfg)
    got = run_ort(exported.onnx_path, feeds)
    with torch.no_grad():
        ref = graph(*[t.clone() for t in feeds.values()])
    for name, value in zip(graph.output_names(), ref, strict=True):
        torch.testing.assert_close(torch.from_numpy(got[name]), value, atol=1e-4, rtol=0)
    # the runtime's own walk over the same context and anchors
    torch_draft = TorchDraft(graph._draft, max_kv_rows=256, page_size=8, top_k=TOP_K)
    lengths = feeds["context_lengths"].tolist()
    seqs = [torch_draft.new_sequence() for _ in lengths]
    features = feeds["context_features"]
    torch_draft.update_context(seqs, [features[b, :n] for b, n in enumerate(lengths)])
    n = cfg.block_size
    proposals = torch_draft.propose(
        seqs,
        feeds["anchor_ids"].tolist(),
        [n] * len(seqs),
        [SamplingParams(temperature=0.0)] * len(seqs),
        [torch.Generator() for _ in seqs],
    )
    for b, proposal in enumerate(proposals):
        tokens, prev = walk_greedy(got["draft_candidate_ids"], got["draft_scores"], b)
        assert tokens == proposal.tokens
        if cfg.enable_confidence_head:
            conf = [got["draft_confidence"][b, slot, i] for slot, i in enumerate(prev)]
            np.testing.assert_allclose(conf, proposal.confidence.numpy(), atol=1e-5)
        else:
            assert "draft_confidence" not in got


def test_plugin_draft_writes_context_then_reads_it_in_a_non_causal_block(target, tmp_path):
    draft = make_random_draft(tmp_path / "draft", target, num_layers=2, block_size=4)
    pair = _pair(draft, target)
    options = ExportOptions(kind=GraphKind.PLUGIN, dtype="float32", top_k=TOP_K, page_size=8)
    exported = export_draft(pair, ModelConfig.from_file(target), tmp_path / "out", options)
    onnx.checker.check_model(str(exported.onnx_path), full_check=True)
    model = onnx.load(str(exported.onnx_path), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == CONTRACT["onnx"]["op_type"]]
    assert len(nodes) == 4  # context update + block, per draft layer
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nodes]
    context = [n for n, a in zip(nodes, attrs, strict=True) if a["write_kv"] == 1]
    block = [n for n, a in zip(nodes, attrs, strict=True) if a["write_kv"] == 0]
    assert len(context) == len(block) == 2
    assert all(a["causal"] == (a["write_kv"]) for a in attrs)  # block rows: non-causal
    for layer, (ctx, blk) in enumerate(zip(context, block, strict=True)):
        assert ctx.input[1] == f"kv_cache_{layer}"
        assert blk.input[1] == ctx.output[1]  # the block reads the updated cache
        assert blk.output[1] == f"present_kv_cache_{layer}"
    props = {p.key: p.value for p in model.metadata_props}
    assert props["edgebuild.lm_head_source"] == "target"
    assert props["edgebuild.embed_tokens_source"] == "target"
    borrowed = json.loads(props["edgebuild.weight_sources"])
    assert borrowed["lm_head.weight"]["checkpoint_source"] == "target"
    assert borrowed["lm_head.weight"]["tensor"] == "lm_head.weight"
    dspark = json.loads(props["edgebuild.dspark"])
    assert dspark["block_size"] == 4 and dspark["markov_head_type"] == "vanilla"
    outputs = [o.name for o in model.graph.output]
    assert outputs[:3] == ["draft_candidate_ids", "draft_scores", "draft_confidence"]
    dims = [d.dim_param or d.dim_value for d in model.graph.output[1].type.tensor_type.shape.dim]
    assert dims == ["batch", 4, TOP_K, TOP_K]


def test_an_rnn_markov_head_is_refused_with_the_field_named(target, tmp_path):
    draft = make_random_draft(tmp_path / "draft", target, markov_head_type="rnn")
    with pytest.raises(ConfigError, match="markov_head_type.*rnn.*vanilla, gated"):
        export_draft(
            _pair(draft, target), ModelConfig.from_file(target), tmp_path / "out", ExportOptions()
        )


def test_a_tied_targets_embedding_is_stored_once_in_the_draft_graph(tmp_path):
    """Head and embedding are one tensor of a tied target: one initializer (issue 16.16)."""
    target = make_tiny_target(tmp_path / "tied", "qwen3", tied=True)
    draft = make_random_draft(tmp_path / "draft", target, num_layers=1, block_size=4)
    pair = _pair(draft, target)
    assert pair.lm_head().name == pair.embed_tokens().name == "model.embed_tokens.weight"
    options = ExportOptions(kind=GraphKind.PORTABLE, dtype="float32", top_k=TOP_K)
    exported = export_draft(pair, ModelConfig.from_file(target), tmp_path / "out", options)
    model = onnx.load(str(exported.onnx_path), load_external_data=False)
    tcfg = ModelConfig.from_file(target)
    vd = [tcfg.vocab_size, tcfg.hidden_size]
    inits = {i.name: list(i.dims) for i in model.graph.initializer}
    assert [n for n, dims in inits.items() if dims == vd] == ["embed_tokens.weight"]
    data = exported.onnx_path.with_name("model.onnx.data").stat().st_size
    external = [i for i in model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    stored = sum(  # each external initializer once
        int(np.prod(i.dims)) * onnx.helper.tensor_dtype_to_np_dtype(i.data_type).itemsize
        for i in external
    )
    assert stored <= data <= stored + 4096 * len(external)  # alignment only, no 2nd copy
    # the shared initializer still feeds both the Gather and the head: same outputs as eager
    graph = _eager_graph(pair, target)
    feeds = draft_feeds(graph.config)
    got = run_ort(exported.onnx_path, feeds)
    with torch.no_grad():
        ref = graph(*[t.clone() for t in feeds.values()])
    for name, value in zip(graph.output_names(), ref, strict=True):
        torch.testing.assert_close(torch.from_numpy(got[name]), value, atol=1e-4, rtol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_a_draft_exported_after_its_base_reads_the_shared_tensors_and_computes_the_same(
    tied, tmp_path
):
    """Issue 27: with :class:`SharedWeights` the base graph writes the borrowed head and
    embedding into ``shared.onnx.data``; the draft graph is saved next to it, names the same
    offsets, holds no copy, and onnxruntime computes what the eager draft computes."""
    from edgebuild.export import SharedWeights, export_base

    target = make_tiny_target(tmp_path / "t", "qwen3", tied=tied)
    draft = make_random_draft(tmp_path / "draft", target, num_layers=1, block_size=4)
    pair = _pair(draft, target)
    tcfg = ModelConfig.from_file(target)
    options = ExportOptions(kind=GraphKind.PORTABLE, dtype="float32", top_k=TOP_K)
    shared = SharedWeights.for_pair(pair)
    base = export_base(pair.target, tmp_path / "b", options, (0,), shared=shared)
    exported = export_draft(pair, tcfg, tmp_path / "d", options, shared=shared)
    assert exported.onnx_path == tmp_path / "b" / "draft.onnx"
    assert base.shared_path == exported.shared_path == tmp_path / "b" / "shared.onnx.data"
    vd = tcfg.vocab_size * tcfg.hidden_size * 4
    assert base.shared_path.stat().st_size in range((1 if tied else 2) * vd, 2 * vd + 8192)
    model = onnx.load(str(exported.onnx_path), load_external_data=False)
    where = {
        i.name: {e.key: e.value for e in i.external_data}.get("location")
        for i in model.graph.initializer
    }
    heads = ["embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
    assert sorted(exported.weights.shared) == sorted(heads)
    assert all(where[n] == "shared.onnx.data" for n in heads)
    own = [n for n, loc in where.items() if loc == "draft.onnx.data"]
    dims = {i.name: list(i.dims) for i in model.graph.initializer}
    assert [tcfg.vocab_size, tcfg.hidden_size] not in [dims[n] for n in own]
    graph = _eager_graph(pair, target)
    feeds = draft_feeds(graph.config)
    got = run_ort(exported.onnx_path, feeds)
    with torch.no_grad():
        ref = graph(*[t.clone() for t in feeds.values()])
    for name, value in zip(graph.output_names(), ref, strict=True):
        torch.testing.assert_close(torch.from_numpy(got[name]), value, atol=1e-4, rtol=0)
    # the base graph still reads its own embedding from the shared file
    base_model = onnx.load(str(base.onnx_path), load_external_data=False)
    base_where = {
        i.name: {e.key: e.value for e in i.external_data}.get("location")
        for i in base_model.graph.initializer
    }
    assert base_where["model.embed_tokens.weight"] == "shared.onnx.data"
