"""Image prompts on the TensorRT backend, checked on the CPU with stand-in engines.

A tiny random Qwen2.5-VL (written by transformers) and a random DSpark draft paired with its
language model. The stand-in engines run the exported role graphs eagerly on the bound CPU
buffers (the multimodal ``BaseGraph``, the ``DraftGraph``, the ``VisualGraph``), assembled by
the backend's own :func:`assemble_runtime` from a manifest made of the graphs' declared I/O.

Oracles: the torch backend (prefill logits and taps; greedy outputs; DSpark proposals and
acceptance must be identical), transformers' ``generate`` (greedy output with an image), and
for the exported ONNX graph the torch backend's logits (onnxruntime, fp32, 1e-4). Not covered
here: real TensorRT engines and GPU execution.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from serve_fixtures import torch_threads
from test_dspark_decoding import load_draft, write_tiny_target
from test_trt_backend import GraphRunner, RecordingDSpark, graph_io, strong_markov
from test_vlm_parity import hf_inputs
from vlm_fixtures import (
    IMAGE_PAD,
    hf_model,
    hf_processor,
    noise_image,
    vlm_with_random_draft,
)

from edgebuild.checkpoint.source import WeightSource
from edgebuild.engine.builder import record_profiles
from edgebuild.errors import ConfigError
from edgebuild.export.graphs import BaseGraph, DraftGraph, GraphKind
from edgebuild.export.visual import VisualGraph, vision_fields
from edgebuild.models.llama import LlamaForCausalLM
from edgebuild.models.vision import VisionTower
from edgebuild.ops.rope import rope_cos_sin_table
from edgebuild.runtime.decoding import RequestState, run_to_completion
from edgebuild.runtime.llm import RuntimeOptions
from edgebuild.runtime.multimodal import ImageInputError
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.runtime.torch_backend import TorchTarget
from edgebuild.runtime.trt_backend import assemble_runtime, open_trt_runtime
from edgebuild.runtime.trt_plan import role_profiles

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
OPTIONS = RuntimeOptions(max_kv_rows=4096, page_size=16)
GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
PAGE, ROPE_ROWS, TOP_K = 16, 512, 8
BUILD = {"device": "thor", "precision": "bf16", "max_batch_size": 2, "max_input_len": 160,
         "max_kv_cache_capacity": 256, "page_size": PAGE, "max_image_tokens": 64,
         "max_images": 3}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: the CPU here is shared, and oversubscription is very slow."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return vlm_with_random_draft(tmp_path_factory.mktemp("trt-vlm"), OPTIONS)


def _fill_rope(graph, rotary_dim, rope):
    graph.rope_cos_sin.copy_(rope_cos_sin_table(rotary_dim, graph.rope_cos_sin.shape[0], rope))


def standin_runtime(target_dir, draft_dir=None, n=4, build=None):
    """The TensorRT runtime of a VLM bundle over stand-in engines (and the torch draft)."""
    source = WeightSource(target_dir)
    model = LlamaForCausalLM.from_source(source)
    tdraft = strong_markov(load_draft(draft_dir, target_dir, n, top_k=TOP_K)) if draft_dir else None
    taps = tuple(tdraft.target_layer_ids) if tdraft else ()
    base = BaseGraph(model, taps, GraphKind.PLUGIN, PAGE, ROPE_ROWS, multimodal=True)
    _fill_rope(base, base.rotary_dim, model.config.rope)
    visual = VisualGraph(VisionTower.from_source(source))
    roles = {
        "base": {**graph_io(base), "tap_layers": list(taps), "engine": "base/model.engine"},
        "visual": {**graph_io(visual), "vision": vision_fields(visual.config),
                   "engine": "visual/model.engine"},
    }  # fmt: skip
    runners = {"base": GraphRunner(base), "visual": GraphRunner(visual)}
    manifest = {"build": dict(build or BUILD), "roles": roles,
                "speculative": {"num_speculative_tokens": n if tdraft else 0}}  # fmt: skip
    if tdraft is not None:
        dgraph = DraftGraph(tdraft.model, GraphKind.PLUGIN, PAGE, ROPE_ROWS, TOP_K)
        _fill_rope(dgraph, tdraft.model.config.head_dim, tdraft.model.config.rope)
        roles["draft"] = {**graph_io(dgraph), "engine": "draft/model.engine"}
        manifest["dspark"] = {"block_size": tdraft.block_size,
                              "target_layer_ids": list(tdraft.target_layer_ids)}  # fmt: skip
        runners["draft"] = GraphRunner(dgraph)
    record_profiles(manifest)  # as `edgebuild build` records them
    rt = assemble_runtime(manifest, source, runners, "cpu")
    return rt, runners, model, tdraft, manifest


def requests(llm):
    """An image request, a two-image request and a text request: (ids, PIL images)."""
    one = [noise_image(200, 130, seed=1)]
    two = [noise_image(60, 100, seed=2), noise_image(90, 50, seed=3)]
    img = {"type": "image_url", "image_url": {"url": "data:,"}}
    return [
        (llm.encode_messages([{"role": "user", "content": [img, {"type": "text", "text": "Hi"}]}], llm.process_images(one)), one),
        (llm.encode_messages([{"role": "user", "content": [img, {"type": "text", "text": "vs"}, img]}], llm.process_images(two)), two),
        (llm.encode_messages([{"role": "user", "content": "text only"}]), None),
    ]  # fmt: skip


def states_for(vision, reqs, params=GREEDY):
    """Request states whose image prompts were prepared by ``vision`` (either backend's)."""
    out = []
    for i, (ids, pil) in enumerate(reqs):
        st = RequestState.create(f"r{i}", ids, params)
        if pil:
            st.prompt_images = vision.prepare(ids, vision.process(pil))
        out.append(st)
    return out


# ---------------------------------------------------------------------- the visual engine
def test_the_visual_engine_gives_the_torch_towers_embeddings_and_rows(setup):
    target, _, base = setup
    rt, runners, *_ = standin_runtime(target)
    ids, pil = requests(base)[1]  # two images
    want = base.vision.prepare(ids, base.process_images(pil))
    got = rt.vision.prepare(ids, rt.vision.process(pil))
    assert torch.equal(got.image_rows, want.image_rows)
    assert torch.equal(got.positions, want.positions) and got.rope_delta == want.rope_delta
    assert got.image_rows.tolist() == [i for i, t in enumerate(ids) if t == IMAGE_PAD]
    torch.testing.assert_close(got.image_embeds, want.image_embeds, atol=1e-5, rtol=0)
    assert len(runners["visual"].keys) == 1  # both images in one pass
    assert rt.vision.max_images == 3 and rt.vision.tower.max_tokens == 64


def test_more_image_tokens_than_the_visual_engine_takes_are_refused(setup):
    target, _, base = setup
    small = {**BUILD, "max_image_tokens": 16, "max_images": 1}
    rt, runners, *_ = standin_runtime(target, build=small)
    ids, pil = requests(base)[0]  # one image of 7 x 5 = 35 tokens
    with pytest.raises(ImageInputError, match=r"at most 1 images of 16 tokens.*max_image_tokens"):
        rt.vision.prepare(ids, rt.vision.process(pil))
    assert runners["visual"].keys == []
    assert rt.runtime_options(OPTIONS).max_images == 1  # clamped to the engine


# ---------------------------------------------------------------------- the multimodal base
def test_a_multimodal_prefill_on_the_base_engine_equals_the_torch_backend(setup):
    target, draft, base = setup
    rt, runners, model, tdraft, manifest = standin_runtime(target, draft, n=4)
    ids, pil = requests(base)[0]
    mm_trt = rt.vision.prepare(ids, rt.vision.process(pil))
    mm_torch = base.vision.prepare(ids, base.process_images(pil))
    taps, rows = tuple(tdraft.target_layer_ids), list(range(len(ids)))
    torch_target = TorchTarget(model, max_kv_rows=1024, page_size=PAGE)
    want = torch_target.forward(
        [torch_target.new_sequence()], [torch.tensor(ids)], [rows[-4:]], taps, [mm_torch]
    )
    text_only = torch_target.forward(
        [torch_target.new_sequence()], [torch.tensor(ids)], [rows[-4:]], taps
    )
    got = rt.target.forward([rt.target.new_sequence()], [torch.tensor(ids)], [rows[-4:]], taps,
                            [mm_trt])  # fmt: skip
    assert (got.logits[0] - want.logits[0]).abs().max() <= 1e-5
    assert (got.taps[0] - want.taps[0]).abs().max() <= 1e-5
    assert (want.logits[0] - text_only.logits[0]).abs().max() > 1e-2  # the image matters
    assert runners["base"].keys == [(0, None)]  # the prefill profile, never graph-keyed


@pytest.mark.parametrize("profile", ["prefill", "generate"])
def test_the_image_table_axis_is_one_call_of_image_rows_in_prefill_and_one_row_in_generate(
    setup, profile
):
    target, _, _ = setup
    *_, manifest = standin_runtime(target)
    profiles = {p.name: p for p in role_profiles(manifest, "base")}
    lo, opt, hi = profiles[profile].shapes["image_embeds"]
    assert lo == (1, 64)
    assert hi == ((64, 64) if profile == "prefill" else (1, 64)) and opt == hi
    assert profiles[profile].shapes["mrope_positions"][2][0] == 3


def test_target_only_greedy_with_images_equals_the_torch_backend_and_transformers(setup):
    target, _, base = setup
    rt, runners, *_ = standin_runtime(target)
    reqs = requests(base)
    want = [s.output_ids for s in base.generate_ids([r[0] for r in reqs], GREEDY,
            images=[base.process_images(r[1]) if r[1] else None for r in reqs])]  # fmt: skip
    states = states_for(rt.vision, reqs)
    run_to_completion(rt.decoder(None), states)
    got = [s.output_ids for s in states]
    assert got == want
    assert len({tuple(o) for o in want}) == 3  # the prompts (and images) matter
    # transformers on the one-image request (its own processor and 3-axis positions)
    parts, pil = ("IMG", "Hi"), reqs[0][1]
    inputs = hf_inputs(hf_processor(target), parts, pil)
    assert inputs["input_ids"][0].tolist() == reqs[0][0]
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        ref = hf_model(target).generate(**inputs, max_new_tokens=GREEDY.max_tokens,
                                        do_sample=False)  # fmt: skip
    assert got[0] == ref[0, n:].tolist()
    # 3 requests on engines of max batch 2: decode runs graph-keyed in the generate profile
    assert any(p == 1 and k is not None for p, k in runners["base"].keys)
    assert rt.target.allocator.free_pages == rt.target.limits.num_pages


@pytest.mark.parametrize("n", [2, 4])
def test_dspark_with_images_on_standin_engines_equals_the_torch_backend(setup, n):
    target, draft, base = setup
    rt, runners, model, tdraft, _ = standin_runtime(target, draft, n=n)
    reqs = requests(base)
    expected = [s.output_ids for s in base.generate_ids([r[0] for r in reqs], GREEDY,
                images=[base.process_images(r[1]) if r[1] else None for r in reqs])]  # fmt: skip
    torch_dec = RecordingDSpark(TorchTarget(model, max_kv_rows=4096, page_size=PAGE), tdraft, n)
    want = states_for(base.vision, reqs)
    run_to_completion(torch_dec, want)
    trt_dec = RecordingDSpark(rt.target, rt.draft, n)
    got = states_for(rt.vision, reqs)
    run_to_completion(trt_dec, got)
    assert [s.output_ids for s in got] == [s.output_ids for s in want] == expected
    # the draft's context starts from the multimodal prefill's taps: same proposals
    assert len(trt_dec.proposals) == len(torch_dec.proposals) > 3
    for g_step, w_step in zip(trt_dec.proposals, torch_dec.proposals, strict=True):
        assert [t for t, _ in g_step] == [t for t, _ in w_step]
        for (_, g_conf), (_, w_conf) in zip(g_step, w_step, strict=True):
            assert g_conf == pytest.approx(w_conf, rel=1e-4, abs=1e-6)
    for g, w in zip(got, want, strict=True):
        assert g.metrics.accepted_at == w.metrics.accepted_at
        assert g.metrics.steps > 0
    assert rt.draft.allocator.free_pages == rt.draft.limits.num_pages
    assert not rt.draft.pending and not rt.target.ring.live


# ---------------------------------------------------------------------- bundles and errors
def _resolved(bundle, target, manifest):
    return SimpleNamespace(bundle=bundle, target=target, manifest=manifest)


def test_a_vlm_bundle_without_a_visual_engine_or_image_inputs_is_refused(setup, tmp_path):
    target, _, _ = setup
    *_, manifest = standin_runtime(target)
    no_visual = {**manifest, "roles": {"base": manifest["roles"]["base"]}}
    with pytest.raises(ConfigError, match=r"no visual engine \(manifest roles.visual\)"):
        open_trt_runtime(_resolved(tmp_path, target, no_visual), None)
    onnx_only = json.loads(json.dumps(manifest))
    onnx_only["roles"]["visual"]["engine"] = None
    with pytest.raises(ConfigError, match="no visual engine"):
        open_trt_runtime(_resolved(tmp_path, target, onnx_only), None)
    old_base = json.loads(json.dumps(manifest))
    old_base["roles"]["base"]["inputs"] = [
        i for i in old_base["roles"]["base"]["inputs"] if i["name"] != "image_embeds"
    ]
    with pytest.raises(ConfigError, match="base engine has no image_embeds input.*rebuild"):
        open_trt_runtime(_resolved(tmp_path, target, old_base), None)


TEXT_BASE_INPUTS = [
    ("input_ids", "int32", ["batch", "seq"]),
    ("positions", "int32", ["batch", "seq"]),
    ("past_lengths", "int32", ["batch"]),
    ("input_lengths", "int32", ["batch"]),
    ("logits_rows", "int32", ["batch", "logits_rows"]),
    ("page_table", "int32", ["batch", "max_pages"]),
] + [(f"kv_cache_{i}", "float32", ["num_pages", 2, 2, 8, 16]) for i in range(4)]


def test_a_text_targets_base_graph_io_is_unchanged_and_the_vlm_graph_adds_only_image_inputs(
    setup, tmp_path
):
    target, _, _ = setup
    text_model = LlamaForCausalLM.from_source(WeightSource(write_tiny_target(tmp_path / "t")))
    text_io = graph_io(BaseGraph(text_model, (0, 2), GraphKind.PLUGIN, 8, 64))
    assert [(s["name"], s["dtype"], s["dims"]) for s in text_io["inputs"]] == TEXT_BASE_INPUTS
    assert [s["name"] for s in text_io["outputs"]] == [
        "logits", "target_hidden_states", *[f"present_kv_cache_{i}" for i in range(4)]
    ]  # fmt: skip
    model = LlamaForCausalLM.from_source(WeightSource(target))
    vlm_text = graph_io(BaseGraph(model, (0, 2), GraphKind.PLUGIN, 8, 64))
    vlm = graph_io(BaseGraph(model, (0, 2), GraphKind.PLUGIN, 8, 64, multimodal=True))
    assert vlm["outputs"] == vlm_text["outputs"]
    swapped = [s for s in vlm_text["inputs"] if s["name"] != "positions"]
    swapped[1:1] = [
        {"name": "image_embeds", "dtype": "float32", "dims": ["image_tokens", 64]},
        {"name": "mrope_positions", "dtype": "int32", "dims": [3, "batch", "seq"]},
    ]
    assert vlm["inputs"] == swapped
    with pytest.raises(ConfigError, match="multimodal-RoPE target"):
        BaseGraph(text_model, (), GraphKind.PLUGIN, 8, 64, multimodal=True)


# ---------------------------------------------------------------------- the exported graph
def test_the_plugin_graph_of_a_vlm_feeds_the_attention_a_per_row_rope_table(setup, tmp_path):
    """The plugin reads the table's row count from its input at enqueue, so the gathered
    [B * S, rotary_dim] table with row-index positions fits the attention contract."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    from edgebuild.export import ExportOptions, export_base

    target, _, _ = setup
    options = ExportOptions(kind=GraphKind.PLUGIN, dtype="float32", page_size=PAGE)
    exported = export_base(WeightSource(target), tmp_path / "base", options, (0, 2))  # checked
    model = onnx.load(str(exported.onnx_path), load_external_data=False)
    declared = [(s.name, list(s.dims)) for s in exported.inputs]
    dims = [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in model.graph.input]  # fmt: skip
    assert [(i.name, d) for i, d in zip(model.graph.input, dims, strict=True)] == declared
    producers = {o: n.op_type for n in model.graph.node for o in n.output}
    attention = [n for n in model.graph.node if n.op_type == "EdgebuildAttention"]
    assert len(attention) == 4
    for node in attention:
        positions, table = node.input[5], node.input[6]
        assert positions not in ("positions", "mrope_positions")  # the row index
        assert producers[table] == "GatherElements"  # not the rope_cos_sin initializer


def _ort(path, feeds: dict) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    outs = sess.run(None, {k: v.numpy() for k, v in feeds.items()})
    return {o.name: v for o, v in zip(sess.get_outputs(), outs, strict=True)}


def test_the_exported_vlm_base_graph_in_onnxruntime_equals_the_torch_backend(setup, tmp_path):
    """Portable graph, fp32: a batch of an image prompt and a text prompt, then one decode row
    each, against the torch backend's logits of the same rows (1e-4)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from edgebuild.export import ExportOptions, export_base

    target, _, base = setup
    options = ExportOptions(kind=GraphKind.PORTABLE, dtype="float32", rope_rows=256)
    exported = export_base(WeightSource(target), tmp_path / "base", options, tap_layers=(0, 2))
    assert exported.metadata["edgebuild.multimodal"] == "true"
    assert [s.name for s in exported.inputs][:3] == ["input_ids", "image_embeds", "mrope_positions"]
    (img_ids, pil), _, (text_ids, _) = requests(base)
    mm = base.vision.prepare(img_ids, base.process_images(pil))
    cfg = base.config
    p0, p1, cap = len(img_ids), len(text_ids), 128
    # the torch backend, one sequence at a time: prefill (all rows), then one decode row
    tt = TorchTarget(base.target_model, max_kv_rows=1024, page_size=PAGE)
    s0, s1 = tt.new_sequence(), tt.new_sequence()
    s0.rope_delta = mm.rope_delta
    want_pre = [
        tt.forward([s0], [torch.tensor(img_ids)], [list(range(p0))], (0, 2), [mm]),
        tt.forward([s1], [torch.tensor(text_ids)], [list(range(p1))], (0, 2)),
    ]
    nxt = [int(w.logits[0][-1].argmax()) for w in want_pre]
    want_dec = tt.forward([s0, s1], [torch.tensor([t]) for t in nxt], [[0], [0]], (0, 2))
    # the graph's contract: pad rows carry vocab + table row; text rows t = h = w
    ids = torch.zeros(2, p0, dtype=torch.int32)
    ids[0], ids[1, :p1] = torch.tensor(img_ids), torch.tensor(text_ids)
    ids[0, mm.image_rows] = cfg.vocab_size + torch.arange(mm.num_image_rows, dtype=torch.int32)
    pos = torch.arange(p0, dtype=torch.int32).expand(3, 2, p0).clone()
    pos[:, 0] = mm.positions
    caches = {
        f"kv_cache_{i}": torch.zeros(2, 2, cfg.num_key_value_heads, cap, cfg.head_dim)
        for i in range(cfg.num_hidden_layers)
    }
    feeds = {
        "input_ids": ids,
        "image_embeds": mm.image_embeds,
        "mrope_positions": pos,
        "past_lengths": torch.zeros(2, dtype=torch.int32),
        "input_lengths": torch.tensor([p0, p1], dtype=torch.int32),
        "logits_rows": torch.arange(p0, dtype=torch.int32).expand(2, p0).contiguous(),
        **caches,
    }
    pre = _ort(exported.onnx_path, feeds)
    for b, n in enumerate((p0, p1)):
        got = torch.from_numpy(pre["logits"][b, :n])
        assert (got - want_pre[b].logits[0]).abs().max() <= 1e-4
        taps = torch.from_numpy(pre["target_hidden_states"][b, :n])
        assert (taps - want_pre[b].taps[0]).abs().max() <= 1e-4
    slot = torch.tensor([p0 + mm.rope_delta, p1], dtype=torch.int32)
    dec_feeds = {
        "input_ids": torch.tensor([[nxt[0]], [nxt[1]]], dtype=torch.int32),
        "image_embeds": torch.zeros(1, cfg.hidden_size),  # text rows: a table no id selects
        "mrope_positions": slot.view(1, 2, 1).expand(3, 2, 1).contiguous(),
        "past_lengths": torch.tensor([p0, p1], dtype=torch.int32),
        "input_lengths": torch.ones(2, dtype=torch.int32),
        "logits_rows": torch.zeros(2, 1, dtype=torch.int32),
        **{k: torch.from_numpy(pre["present_" + k]) for k in caches},
    }
    dec = _ort(exported.onnx_path, dec_feeds)
    for b in range(2):
        got = torch.from_numpy(dec["logits"][b])
        assert (got - want_dec.logits[b]).abs().max() <= 1e-4
