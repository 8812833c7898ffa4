"""Issue 27: sliding-window DSpark drafts on a fixed ring of pages per request.

Oracles: the same draft run with a full paged cache and the attention op's explicit window
mask (``TorchDraft(ring=False)``; the op's window is checked against dense attention in
tests/test_attention_op.py) proposes the same drafts, within fp32 tolerance, at every step up
to a context of 3W (W = 8, block size 4, page size 4: the ring wraps several times), while the
same draft without the window does not; the ring's pages stay the same from context 1k to 8k;
greedy DSpark equals target-only with a random and with a perfect windowed draft.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from dspark_fixtures import make_random_draft
from test_dspark_decoding import speculative, target_only, write_tiny_target

from edgebuild.checkpoint.config import ModelConfig
from edgebuild.checkpoint.draft import pair_draft
from edgebuild.checkpoint.source import WeightSource
from edgebuild.errors import ConfigError
from edgebuild.models.common import FusedLayers
from edgebuild.models.dspark import DSparkDraft
from edgebuild.models.llama import LlamaForCausalLM
from edgebuild.runtime.backend import Proposal
from edgebuild.runtime.dspark_backend import RingSequence, TorchDraft
from edgebuild.runtime.sampling import SamplingParams

W, BLOCK, PAGE = 8, 4, 4
SPELLINGS = {
    "deepspec-use-swa": {"dflash_config.use_swa": True, "dflash_config.swa_window_size": W},
    "hf-use-sliding-window": {
        "use_sliding_window": True,
        "sliding_window": W,
        "max_window_layers": 0,
    },
    "layer-types": {"layer_types": ["sliding_attention"] * 2, "sliding_window": W},
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_tiny_target(tmp_path_factory.mktemp("t") / "target")


def windowed_draft(out, target, spelling="layer-types", seed=0):
    return make_random_draft(
        out, target, num_layers=2, block_size=BLOCK, seed=seed, scale=0.2,
        overrides=SPELLINGS[spelling],
    )  # fmt: skip


def load_model(draft, target) -> DSparkDraft:
    plan = pair_draft(WeightSource(target), draft)
    return DSparkDraft.from_plan(plan, torch.float32)


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_each_packaging_spelling_gives_the_window(spelling, target, tmp_path):
    draft = windowed_draft(tmp_path / "d", target, spelling)
    cfg = pair_draft(WeightSource(target), draft).config
    assert cfg.sliding_window == W
    budget = cfg.kv_budget(2, page_size=PAGE)
    assert budget["attention"] == "sliding" and budget["ring_rows"] == 16  # (3 + 1) pages of 4
    assert budget["bytes_per_request"] == 16 * cfg.kv_bytes_per_row(2)


def test_half_sliding_layers_are_refused_by_name(target, tmp_path):
    draft = make_random_draft(
        tmp_path / "d", target, num_layers=2, block_size=BLOCK,
        overrides={"use_sliding_window": True, "sliding_window": W, "max_window_layers": 1},
    )  # fmt: skip
    with pytest.raises(ConfigError, match="max_window_layers' = 1.*set max_window_layers to 0"):
        pair_draft(WeightSource(target), draft)


def _proposals(draft, seqs, anchors):
    g = [torch.Generator().manual_seed(0) for _ in seqs]
    greedy = [SamplingParams(temperature=0.0)] * len(seqs)
    return draft.propose(seqs, anchors, [BLOCK] * len(seqs), greedy, g)


def test_the_ring_equals_a_full_cache_with_the_window_mask_up_to_3w(target, tmp_path):
    model = load_model(windowed_draft(tmp_path / "d", target), target)
    ring = TorchDraft(model, 512, PAGE, top_k=8, ring=True)
    full = TorchDraft(model, 512, PAGE, top_k=8, ring=False)
    nowin = TorchDraft(load_model(windowed_draft(tmp_path / "d", target), target), 512, PAGE, 8)
    for layer in nowin.model.layers:  # the same weights without the window: must differ
        layer.self_attn.block_spec = layer.self_attn.block_spec.replace(sliding_window=0)
    nowin.model.block_program = FusedLayers.build(nowin.model.layers, block=True)  # its spec
    nowin.ring = None
    width = model.fc.in_features
    g = torch.Generator().manual_seed(1)
    chunks = [[1, 3], [3, 1], [5, 6], [2, 2], [7, 1], [1, 9], [4, 2], [1, 1]]  # 24 rows each
    seqs = {name: [d.new_sequence(), d.new_sequence()] for name, d in
            (("ring", ring), ("full", full), ("nowin", nowin))}  # fmt: skip
    assert all(isinstance(s, RingSequence) for s in seqs["ring"])
    differed = False
    for step, (a, b) in enumerate(chunks):
        feats = [torch.randn(a, width, generator=g), torch.randn(b, width, generator=g)]
        anchors = [3 + step, 40 + step]
        got = {}
        for name, d in (("ring", ring), ("full", full), ("nowin", nowin)):
            d.update_context(seqs[name], [f.clone() for f in feats])
            got[name] = _proposals(d, seqs[name], anchors)
        for pr, pf, pn in zip(got["ring"], got["full"], got["nowin"], strict=True):
            assert pr.tokens == pf.tokens
            torch.testing.assert_close(pr.q, pf.q, atol=1e-5, rtol=0)
            torch.testing.assert_close(pr.confidence, pf.confidence, atol=1e-5, rtol=0)
            differed |= not torch.allclose(pr.q, pn.q, atol=1e-4)
        assert [ring.context_length(s) for s in seqs["ring"]] == [s.length for s in seqs["full"]]
        for s in seqs["ring"]:  # a fixed ring: the same pages, rotated
            assert len(s.pages) == ring.ring_pages == 4
    assert sum(a for a, _ in chunks) == 3 * W
    assert seqs["ring"][0].base > 0 and seqs["ring"][1].base > 0  # it wrapped
    assert differed  # past the window the mask matters: the test can tell


def test_the_rings_pages_stay_the_same_from_context_1k_to_8k(target, tmp_path):
    model = load_model(windowed_draft(tmp_path / "d", target), target)
    ring = TorchDraft(model, 512, PAGE, top_k=8)
    seq = ring.new_sequence()
    width = model.fc.in_features
    held = []
    for rows in (1000, 3000, 4000):  # contexts 1k, 4k, 8k
        ring.update_context([seq], [torch.randn(rows, width)])
        _proposals(ring, [seq], [5])
        held.append((len(seq.pages), ring.allocator.free_pages, ring.pages_to_grow(seq, 100)))
    assert ring.context_length(seq) == 8000
    bytes_per_page = sum(p[0].numel() * p.element_size() for p in ring.pools)
    assert held == [(4, ring.allocator.num_pages - 4, 0)] * 3
    assert 4 * bytes_per_page == model.config.kv_budget(4, PAGE)["bytes_per_request"]


class PerfectRing:
    """The windowed draft (its ring does all its work) with the target's own continuation as
    its proposals: everything is accepted."""

    def __init__(self, inner: TorchDraft, vocab: int):
        self.inner, self.vocab, self.full = inner, vocab, {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, seqs, anchors, num_tokens, params, generators):
        self.inner.propose(seqs, anchors, num_tokens, params, generators)
        out = []
        for s, n in zip(seqs, num_tokens, strict=True):
            at = self.inner.context_length(s)
            toks = list(self.full[s.seq_id][at + 1 : at + 1 + n])
            toks += [0] * (n - len(toks))
            q = torch.nn.functional.one_hot(torch.tensor(toks, dtype=torch.long), self.vocab)
            out.append(Proposal(toks, q.float().reshape(n, self.vocab), torch.ones(n)))
        return out


def check_greedy_equals_target_only(target, make_draft, lengths=(1, 3)) -> None:
    """Greedy DSpark with ``make_draft()``'s draft (random weights: rejections happen)
    and with a perfect one (its ring does all its work) equals target-only past 3W (prompts
    + 40 tokens); everything is accepted with the perfect draft; the rings are given back."""
    model = LlamaForCausalLM.from_source(WeightSource(target))
    vocab = ModelConfig.from_file(target).vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab - 1, (n,), generator=g).tolist() for n in (5, 19, 11)]
    params = SamplingParams(max_tokens=40)
    ref = target_only(model, prompts, params)
    want = [s.output_ids for s in ref]
    draft = make_draft()
    for n in lengths:
        got = speculative(model, draft, prompts, params, n)
        assert [s.output_ids for s in got] == want
        assert any(a < 1.0 for st in got for a in st.metrics.acceptance_by_position)
    full = [p + s.output_ids for p, s in zip(prompts, ref, strict=True)]
    got = speculative(model, PerfectRing(draft, vocab), prompts, params, 3, full=full)
    assert [s.output_ids for s in got] == want
    for st in got:  # everything accepted
        assert all(a == 1.0 for a in st.metrics.acceptance_by_position)
    assert draft.allocator.free_pages == draft.allocator.num_pages  # rings given back


def test_greedy_dspark_with_a_windowed_draft_equals_target_only(target, tmp_path):
    model = load_model(windowed_draft(tmp_path / "d", target), target)
    check_greedy_equals_target_only(target, lambda: TorchDraft(model, 4096, PAGE))


# ---------------------------------------------------------------------- the TensorRT draft
def trt_ring_draft(model: DSparkDraft, max_batch=2, rope_rows=256):
    """A TrtDraft over a stand-in engine (tests/test_trt_backend.py's GraphRunner runs the
    exported plugin graph eagerly on the bound CPU buffers), planned from a hand manifest
    whose dspark.kv_cache is the draft's own budget (as `edgebuild build` writes it)."""
    from test_trt_backend import GraphRunner, _fill_rope, graph_io

    from edgebuild.engine.builder import record_profiles
    from edgebuild.export.graphs import DraftGraph, GraphKind
    from edgebuild.runtime.trt_backend import TrtDraft
    from edgebuild.runtime.trt_plan import plan_buffers, role_io, role_profiles

    cfg = model.config
    graph = DraftGraph(model, GraphKind.PLUGIN, PAGE, rope_rows, 8)
    _fill_rope(graph, cfg.head_dim, cfg.rope)
    manifest = {
        "build": {"device": "thor", "precision": "bf16", "max_batch_size": max_batch,
                  "max_input_len": 48, "max_kv_cache_capacity": 64, "page_size": PAGE},
        "speculative": {"num_speculative_tokens": BLOCK},
        "dspark": {"block_size": BLOCK, "kv_cache": cfg.kv_budget(4, PAGE)},
        "roles": {"draft": graph_io(graph)},
    }  # fmt: skip
    record_profiles(manifest)
    plan = plan_buffers(manifest)
    draft = TrtDraft(GraphRunner(graph), role_io(manifest, "draft"),
                     role_profiles(manifest, "draft"), plan, BLOCK, cfg.target_layer_ids,
                     cfg.vocab_size, "cpu")  # fmt: skip
    return draft, plan, manifest


class FailingRunner:
    def execute(self, profile, bindings, graph_key=None):
        raise RuntimeError("engine failed")


def _ring_rows(draft, seq, layer: int) -> torch.Tensor:
    """K/V [2, H, W, D] of the last W context positions, read from the ring's pages."""
    pool = draft.buffers.pool(f"kv_cache_{layer}")
    rows = torch.cat([pool[p] for p in seq.pages], dim=2)  # slot order
    return rows[:, :, seq.total - W - seq.base : seq.total - seq.base]


def test_the_trt_drafts_ring_equals_a_full_cache_with_the_window_mask_up_to_3w(target, tmp_path):
    """Rotated page table, slot past lengths, absolute positions: the same drafts as the CPU
    reference with every row kept; after every step (the ring wraps several times) the ring
    holds exactly the reference's K/V of the last W positions (no stale rows)."""
    model = load_model(windowed_draft(tmp_path / "d", target), target)
    draft, plan, _ = trt_ring_draft(model)
    full = TorchDraft(model, 512, PAGE, top_k=8, ring=False)
    assert plan.draft_ring.pages == 4 and plan.draft_ring.window == W
    width = model.fc.in_features
    g = torch.Generator().manual_seed(1)
    chunks = [[1, 3], [3, 1], [5, 6], [2, 2], [7, 1], [1, 9], [4, 2], [1, 1]]  # 24 rows each
    seqs, refs = [draft.new_sequence(), draft.new_sequence()], [full.new_sequence() for _ in "ab"]
    for step, (a, b) in enumerate(chunks):
        feats = [torch.randn(a, width, generator=g), torch.randn(b, width, generator=g)]
        anchors = [3 + step, 40 + step]
        for d, ss in ((draft, seqs), (full, refs)):
            d.update_context(ss, [f.clone() for f in feats])
        if step == 5:  # a failed engine call after the wrap: the ring is as it was before
            before = [(list(s.pages), s.base, s.length, s.total) for s in seqs]
            real, draft.runner = draft.runner, FailingRunner()
            with pytest.raises(RuntimeError, match="engine failed"):
                _proposals(draft, seqs, anchors)
            draft.runner = real
            assert [(list(s.pages), s.base, s.length, s.total) for s in seqs] == before
        got, want = _proposals(draft, seqs, anchors), _proposals(full, refs, anchors)
        for pg, pw in zip(got, want, strict=True):
            assert pg.tokens == pw.tokens
            torch.testing.assert_close(pg.dense_q(96), pw.dense_q(96), atol=1e-5, rtol=0)
        for s, r in zip(seqs, refs, strict=True):
            assert len(s.pages) == 4 and draft.context_length(s) == r.length
            if s.total >= W:
                for layer in range(model.config.num_hidden_layers):
                    ref = torch.cat([full.pools[layer][p] for p in r.pages], dim=2)
                    ref = ref[:, :, r.length - W : r.length]
                    torch.testing.assert_close(_ring_rows(draft, s, layer), ref, atol=1e-5, rtol=0)
    assert all(s.base > 0 for s in seqs)  # it wrapped
    for s in seqs:
        draft.free(s)
    assert draft.allocator.free_pages == draft.allocator.num_pages == plan.draft_pages


def test_the_trt_drafts_ring_pages_and_buffers_stay_the_same_from_context_1k_to_8k(
    target, tmp_path
):
    model = load_model(windowed_draft(tmp_path / "d", target), target)
    draft, plan, manifest = trt_ring_draft(model, rope_rows=8192)
    pools = [draft.buffers.pool(f"kv_cache_{i}") for i in range(2)]
    ring_bytes = 4 * sum(p[0].numel() * p.element_size() for p in pools)
    assert ring_bytes == manifest["dspark"]["kv_cache"]["bytes_per_request"]
    # the plan's draft pools: whole rings, as many as the full pool's 2 x 16 pages hold
    assert plan.draft_pages == 32 and all(p.shape[0] == 32 for p in pools)
    seq = draft.new_sequence()
    held = []
    for rows in (1000, 3000, 4000):  # contexts 1k, 4k, 8k: past the engines' 64-row capacity
        draft.update_context([seq], [torch.randn(rows, model.fc.in_features)])
        _proposals(draft, [seq], [5])
        held.append((len(seq.pages), draft.allocator.free_pages, draft.pages_to_grow(seq, 99)))
    assert draft.context_length(seq) == 8000 and seq.length <= 16
    assert held == [(4, 28, 0)] * 3


def test_greedy_dspark_with_the_trt_ring_draft_equals_target_only(target, tmp_path):
    """Rejections never leave a stale row in the TensorRT draft's ring either."""
    model = load_model(windowed_draft(tmp_path / "d", target), target)
    check_greedy_equals_target_only(target, lambda: trt_ring_draft(model)[0], lengths=(3,))


def test_the_exported_draft_graphs_carry_the_window(windowed_bundle, tmp_path):
    """Portable graph in onnxruntime == the eager graph with the window at a context of 3W
    (and != without it); the plugin graph's block nodes carry sliding_window = W (the
    windowed bundle's base/draft.onnx)."""
    import onnx
    from export_fixtures import draft_feeds, make_tiny_target, run_ort

    from edgebuild.checkpoint.pairing import PairedSources
    from edgebuild.checkpoint.source import COMPONENT, TARGET
    from edgebuild.export import ExportOptions, GraphKind, export_draft
    from edgebuild.export.graphs import ROPE_BUFFER, DraftGraph
    from edgebuild.ops.rope import rope_cos_sin_table

    target = make_tiny_target(tmp_path / "t", "qwen3")
    draft = windowed_draft(tmp_path / "d", target)
    pair = PairedSources(WeightSource(draft, COMPONENT), WeightSource(target, TARGET))
    tcfg = ModelConfig.from_file(target)
    opts = ExportOptions(kind=GraphKind.PORTABLE, dtype="float32", top_k=5)
    exported = export_draft(pair, tcfg, tmp_path / "out", opts)
    feeds = draft_feeds(pair_draft(WeightSource(target), draft).config, context=3 * W, capacity=40)
    got = run_ort(exported.onnx_path, feeds)

    def eager(window: int):
        head, embed = pair.lm_head(), pair.embed_tokens()
        model = DSparkDraft.from_source(pair.draft, tcfg, head.value, embed.value, torch.float32)
        for layer in model.layers:
            layer.self_attn.block_spec = layer.self_attn.block_spec.replace(sliding_window=window)
        graph = DraftGraph(model, GraphKind.PORTABLE, 32, tcfg.max_position_embeddings, 5)
        rows = tcfg.max_position_embeddings
        getattr(graph, ROPE_BUFFER).copy_(
            rope_cos_sin_table(model.config.head_dim, rows, tcfg.rope)
        )
        with torch.no_grad():
            out = graph(*[t.clone() for t in feeds.values()])
        return dict(zip(graph.output_names(), out, strict=True))

    ref, nowin = eager(W), eager(0)
    torch.testing.assert_close(
        torch.from_numpy(got["draft_scores"]), ref["draft_scores"], atol=1e-4, rtol=0
    )
    assert not torch.allclose(ref["draft_scores"], nowin["draft_scores"], atol=1e-3)
    model = onnx.load(str(windowed_bundle[0] / "base" / "draft.onnx"), load_external_data=False)
    attrs = [
        {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        for n in model.graph.node
        if n.op_type == "EdgebuildAttention"
    ]
    assert sorted((a["write_kv"], a["sliding_window"]) for a in attrs) == [
        (0, W),
        (0, W),
        (1, 0),
        (1, 0),
    ]


@pytest.fixture(scope="module")
def windowed_bundle(tmp_path_factory):
    """A tiny fp32 bundle (graphs only) of a qwen3 target and a W = 8 draft, page size 4."""
    from export_fixtures import make_tiny_target, write_tiny_tokenizer

    from edgebuild.bundle.build import BuildOptions, build_bundle, recipe_from_flags

    root = tmp_path_factory.mktemp("windowed")
    target = make_tiny_target(root / "t", "qwen3", num_hidden_layers=2)
    write_tiny_tokenizer(target, ModelConfig.from_file(target).vocab_size)
    draft = windowed_draft(root / "d", target)
    recipe = recipe_from_flags(target, draft, max_batch_size=2, max_input_len=32,
                               max_kv_cache_capacity=96, page_size=PAGE)  # fmt: skip
    out = root / "bundle"
    build_bundle(recipe, out, BuildOptions(onnx_only=True, progress=False, dtype="float32"))
    return out, target


def test_a_windowed_bundle_on_onnxruntime_keeps_the_ring_and_equals_target_only(windowed_bundle):
    """The bundle's own graphs through runtime/trt/ (issue 24's onnxruntime adapter, the
    plugin node by its host build): the plan keeps a 4-page ring per request, the manifest
    states the ring's bytes at the engines' page size, greedy DSpark equals target-only past
    3W, and the ring's pages stay the same as the context grows."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxruntime_extensions")
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to build the plugin's host code")
    from edgebuild.runtime.llm import LLM, RuntimeOptions

    bundle, _ = windowed_bundle
    llm = LLM(bundle, backend="onnxruntime", options=RuntimeOptions(dtype=torch.float32))
    kv = json.loads((bundle / "manifest.json").read_text())["dspark"]["kv_cache"]
    assert kv["attention"] == "sliding" and kv["ring_rows"] == 16  # 4 pages of 4
    assert llm.draft.ring.pages == 4
    prompts = [[5, 9, 2, 33, 7, 1, 8], [11, 4, 80, 3, 3, 19, 60, 2, 41]]
    sp = SamplingParams(max_tokens=30, temperature=0.0)  # contexts of 37 and 39 > 3W
    want = [s.output_ids for s in llm.without_draft().generate_ids(prompts, sp)]
    seen = []
    original = llm.draft.propose

    def spy(seqs, *args):
        out = original(seqs, *args)
        seen.extend((llm.draft.context_length(s), len(s.pages)) for s in seqs)
        return out

    llm.draft.propose = spy
    assert [s.output_ids for s in llm.generate_ids(prompts, sp)] == want
    assert max(c for c, _ in seen) > 3 * W and {p for _, p in seen} == {4}
    assert llm.draft.allocator.free_pages == llm.draft.allocator.num_pages


def test_a_windowed_drafts_ring_does_not_limit_one_requests_length(target, tmp_path):
    """LLM.max_model_len ignores a windowed draft's small pool (its ring is fixed per
    request), where a full-attention draft with the same rows limits it."""
    from export_fixtures import write_tiny_tokenizer

    from edgebuild.runtime.llm import LLM, RuntimeOptions

    target = shutil.copytree(target, tmp_path / "target")
    write_tiny_tokenizer(target, json.loads((target / "config.json").read_text())["vocab_size"])
    draft = windowed_draft(tmp_path / "d", target)
    spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": BLOCK - 1}
    opts = RuntimeOptions(max_kv_rows=128, max_input_len=64, page_size=PAGE, max_draft_kv_rows=32)
    llm = LLM(target, speculative=spec, options=opts)
    assert llm.draft.ring is not None and llm.draft_seq_capacity is None
    assert llm.max_model_len == min(128, llm.config.max_position_embeddings)
    full = make_random_draft(tmp_path / "f", target, num_layers=2, block_size=BLOCK)
    spec_full = {**spec, "model": str(full)}
    assert LLM(target, speculative=spec_full, options=opts).max_model_len == 32
