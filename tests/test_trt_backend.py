"""The TensorRT backend's CPU-checkable parts: planning, the engine I/O contract, backend
selection, the plugin library check, the tap ring, the lattice walk, and the whole backend
driven by stand-in engines that run the exported graphs eagerly on the CPU.

Oracles: hand-computed byte counts; the exporter's own ``BaseGraph.io()`` / ``DraftGraph.io()``;
the torch backend (greedy outputs and DSpark acceptance must be identical). What needs a GPU
(real engines, CUDA graphs, speed) is in scripts/gpu_check_engines.py. Image prompts (the
visual engine and the multimodal base engine) are in test_trt_vlm.py.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from dspark_fixtures import make_random_draft
from test_dspark_decoding import load_draft, write_tiny_target

from edgebuild.checkpoint.source import WeightSource
from edgebuild.engine.builder import record_profiles
from edgebuild.errors import BundleError, ConfigError, EngineError, MissingDependencyError
from edgebuild.export.graphs import BaseGraph, DraftGraph, GraphKind
from edgebuild.models.llama import LlamaForCausalLM
from edgebuild.ops.rope import rope_cos_sin_table
from edgebuild.runtime import select
from edgebuild.runtime.backend import MultimodalPrefill
from edgebuild.runtime.decoding import (
    DSparkDecoder,
    RequestState,
    TargetOnlyDecoder,
    run_to_completion,
)
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.runtime.select import HostProbe, select_backend
from edgebuild.runtime.torch_backend import TorchTarget
from edgebuild.runtime.trt_backend import TapRing, TrtDraft, TrtTarget, walk_lattice
from edgebuild.runtime.trt_engine import (
    GraphCache,
    alias_problems,
    load_plugin_library,
    profile_problems,
)
from edgebuild.runtime.trt_plan import (
    EngineLimits,
    EngineTensor,
    check_io_contract,
    choose_profile,
    io_problems,
    plan_buffers,
    role_io,
    role_profiles,
)

transformers = pytest.importorskip("transformers")


# ---------------------------------------------------------------------- a hand-made manifest
def _spec(name, dtype, dims):
    return {"name": name, "dtype": dtype, "dims": list(dims)}


def hand_manifest() -> dict:
    """2 layers, Hkv 2, D 8, V 100, hidden 32, 2 taps; batch 2, input 32, KV 64, page 16, n 3."""
    cache = ("num_pages", 2, 2, 16, 8)
    base_in = [
        _spec("input_ids", "int32", ("batch", "seq")),
        _spec("positions", "int32", ("batch", "seq")),
        _spec("past_lengths", "int32", ("batch",)),
        _spec("input_lengths", "int32", ("batch",)),
        _spec("logits_rows", "int32", ("batch", "logits_rows")),
        _spec("page_table", "int32", ("batch", "max_pages")),
    ] + [_spec(f"kv_cache_{i}", "bfloat16", cache) for i in range(2)]
    base_out = [
        _spec("logits", "float32", ("batch", "logits_rows", 100)),
        _spec("target_hidden_states", "bfloat16", ("batch", "seq", 64)),
    ] + [_spec(f"present_kv_cache_{i}", "bfloat16", cache) for i in range(2)]
    draft_in = [
        _spec("context_features", "bfloat16", ("batch", "context_len", 64)),
        _spec("context_positions", "int32", ("batch", "context_len")),
        _spec("context_lengths", "int32", ("batch",)),
        _spec("past_lengths", "int32", ("batch",)),
        _spec("anchor_ids", "int32", ("batch",)),
        _spec("block_positions", "int32", ("batch", 4)),
        _spec("page_table", "int32", ("batch", "max_pages")),
        _spec("kv_cache_0", "bfloat16", cache),
    ]
    draft_out = [
        _spec("draft_candidate_ids", "int32", ("batch", 4, 5)),
        _spec("draft_scores", "float32", ("batch", 4, 5, 5)),
        _spec("draft_confidence", "float32", ("batch", 4, 5)),
        _spec("present_kv_cache_0", "bfloat16", cache),
    ]
    return record_profiles(
        {  # as `edgebuild build` writes it: the engines' profiles recorded
            "build": {
                "device": "thor",
                "precision": "bf16",
                "max_batch_size": 2,
                "max_input_len": 32,
                "max_kv_cache_capacity": 64,
                "page_size": 16,
                "weights": "native",
            },
            "speculative": {"method": "dspark", "num_speculative_tokens": 3},
            "roles": {
                "base": {"inputs": base_in, "outputs": base_out, "tap_layers": [0, 1]},
                "draft": {"inputs": draft_in, "outputs": draft_out, "top_k": 5},
            },
        }
    )


def test_limits_come_from_the_build_settings_and_the_verify_length():
    lim = EngineLimits.from_manifest(hand_manifest())
    assert (lim.max_batch, lim.max_input_len, lim.kv_capacity, lim.page_size) == (2, 32, 64, 16)
    assert lim.verify_len == 4 and lim.pages_per_seq == 4 and lim.num_pages == 8
    assert lim.tap_ring_rows == 2 * 2 * (32 + 4)


def test_buffer_plan_byte_counts_match_a_hand_computation():
    plan = plan_buffers(hand_manifest())
    nbytes = {(b.role, b.name, b.location): b.nbytes for b in plan.buffers}
    # base: the largest shapes over the prefill (seq <= 32) and generate (seq <= 4) profiles
    assert nbytes["base", "input_ids", "device"] == 2 * 32 * 4
    assert nbytes["base", "input_ids", "host"] == 2 * 32 * 4
    assert nbytes["base", "page_table", "device"] == 2 * 4 * 4
    assert nbytes["base", "logits_rows", "device"] == 2 * 4 * 4
    assert nbytes["base", "kv_cache_0", "device"] == 8 * 2 * 2 * 16 * 8 * 2  # 8 pages, bf16
    assert nbytes["base", "present_kv_cache_0", "device"] == 0  # aliases the pool
    assert nbytes["base", "logits", "device"] == nbytes["base", "logits", "host"] == 2 * 4 * 100 * 4
    assert nbytes["base", "target_hidden_states", "device"] == 2 * 32 * 64 * 2
    assert nbytes["base", "tap_ring", "device"] == 144 * 64 * 2
    assert ("base", "target_hidden_states", "host") not in nbytes  # taps never visit the host
    # draft: the first context update carries a whole prompt (context_len <= 32)
    assert nbytes["draft", "context_features", "device"] == 2 * 32 * 64 * 2
    assert ("draft", "context_features", "host") not in nbytes
    assert nbytes["draft", "draft_scores", "host"] == 2 * 4 * 5 * 5 * 4
    assert nbytes["draft", "kv_cache_0", "device"] == 8 * 2 * 2 * 16 * 8 * 2
    base_device = (
        2 * 32 * 4 * 2  # input_ids, positions
        + 2 * 4 * 2  # past_lengths, input_lengths
        + 2 * 4 * 4  # logits_rows
        + 2 * 4 * 4  # page_table
        + 2 * 8192  # two KV pools
        + 3200  # logits
        + 8192  # taps
        + 18432  # tap ring
    )
    assert plan.bytes("device", "base") == base_device


def test_profiles_are_the_builders_and_decode_shapes_pick_generate():
    m = hand_manifest()
    profiles = role_profiles(m, "base")
    assert [p.name for p in profiles] == ["prefill", "generate"]
    assert profiles[1].shapes["input_ids"][2] == (2, 4)
    assert profiles[0].shapes["input_ids"][2] == (2, 32)
    decode = {"input_ids": (1, 1), "logits_rows": (1, 1), "page_table": (1, 4)}
    prefill = {"input_ids": (2, 20), "logits_rows": (2, 1), "page_table": (2, 4)}
    assert choose_profile(profiles, decode) == 1
    assert choose_profile(profiles, prefill) == 0
    with pytest.raises(EngineError, match="no optimization profile admits"):
        choose_profile(profiles, {"input_ids": (3, 1)})  # batch 3 > max batch 2
    assert [p.name for p in role_profiles(m, "draft")] == ["all"]


# ---------------------------------------------------------------------- the I/O contract
def engine_description(io_json: dict) -> list[EngineTensor]:
    """What TensorRT reports for an engine built from a graph with this I/O: -1 for axes."""
    out = []
    for key, is_input in (("inputs", True), ("outputs", False)):
        for s in io_json[key]:
            dims = tuple(d if isinstance(d, int) else -1 for d in s["dims"])
            out.append(EngineTensor(s["name"], is_input, s["dtype"], dims))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("trt_tiny")
    target_dir = write_tiny_target(root / "target")
    draft_dir = make_random_draft(root / "draft", target_dir, num_layers=1, block_size=5)
    model = LlamaForCausalLM.from_source(WeightSource(target_dir))
    return target_dir, draft_dir, model


def graph_io(graph) -> dict:
    inputs, outputs = graph.io()
    return {"inputs": [s.to_json() for s in inputs], "outputs": [s.to_json() for s in outputs]}


def test_an_engine_built_from_the_exported_graphs_passes_the_contract(tiny):
    target_dir, draft_dir, model = tiny
    base = BaseGraph(model, (0, 2), GraphKind.PLUGIN, 8, 64)
    declared = role_io({"roles": {"base": graph_io(base)}}, "base")
    check_io_contract(engine_description(graph_io(base)), declared)  # no error
    draft = load_draft(draft_dir, target_dir, 4).model
    dgraph = DraftGraph(draft, GraphKind.PLUGIN, 8, 64, 8)
    ddeclared = role_io({"roles": {"draft": graph_io(dgraph)}}, "draft")
    assert io_problems(engine_description(graph_io(dgraph)), ddeclared) == []


@pytest.mark.parametrize(
    "mutate, message",
    [
        ("rename", "'logits' is missing from the engine"),
        ("drop", "input 'page_table' is missing"),
        ("dtype", "'kv_cache_1' is float16 in the engine, declared float32"),
        ("static_dim", "'logits' dim 2 is 95 in the engine, declared 96"),
        ("mode", "'past_lengths' is an engine output, declared as an input"),
    ],
)
def test_the_contract_names_a_renamed_missing_or_wrong_tensor(tiny, mutate, message):
    _, _, model = tiny
    io = graph_io(BaseGraph(model, (0, 2), GraphKind.PLUGIN, 8, 64))
    declared = role_io({"roles": {"base": io}}, "base")
    engine = engine_description(io)
    by_name = {t.name: i for i, t in enumerate(engine)}

    def replace(tensor, **kw):
        t = engine[by_name[tensor]]
        fields = {"name": t.name, "is_input": t.is_input, "dtype": t.dtype, "dims": t.dims, **kw}
        engine[by_name[tensor]] = EngineTensor(**fields)

    if mutate == "rename":
        replace("logits", name="logit")
    elif mutate == "drop":
        del engine[by_name["page_table"]]
    elif mutate == "dtype":
        replace("kv_cache_1", dtype="float16")
    elif mutate == "static_dim":
        replace("logits", dims=(-1, -1, 95))
    elif mutate == "mode":
        replace("past_lengths", is_input=False)
    with pytest.raises(EngineError) as err:
        check_io_contract(engine, declared, "base/model.engine")
    assert message in str(err.value)
    assert "edgebuild build" in str(err.value)
    if mutate == "rename":
        assert "'logit' is not declared by the exporter (renamed?)" in str(err.value)


class FakeEngine:
    """The profile and alias queries of a deserialized engine, answered from a manifest."""

    def __init__(self, profiles, aliases):
        self.profiles, self.aliases = profiles, aliases
        self.num_optimization_profiles = len(profiles)

    def get_tensor_profile_shape(self, name, k):
        return [list(s) for s in self.profiles[k].shapes[name]]

    def get_aliased_input_tensor(self, name):
        return self.aliases.get(name)


def test_engine_profiles_and_kv_aliasing_are_checked_against_the_manifest():
    m = hand_manifest()
    io, profiles = role_io(m, "base"), role_profiles(m, "base")
    aliased = {f"present_kv_cache_{i}": f"kv_cache_{i}" for i in range(2)}
    engine = FakeEngine(profiles, aliased)
    assert profile_problems(engine, io, profiles) == [] and alias_problems(engine, io) == []
    # an engine built with max_input_len 16 instead of the manifest's 32
    small = copy.deepcopy(m)
    small["build"]["max_input_len"] = 16
    record_profiles(small)
    wrong = FakeEngine(role_profiles(small, "base"), {})
    problems = profile_problems(wrong, io, profiles)
    assert any("profile prefill input 'input_ids'" in p for p in problems)
    assert any("does not alias input 'kv_cache_1'" in p for p in alias_problems(wrong, io))
    assert (
        "1 optimization profiles" in profile_problems(FakeEngine(profiles[:1], {}), io, profiles)[0]
    )


# ---------------------------------------------------------------------- backend selection
def write_bundle(path, *, sm="sm_110", builder_version="10.13.0.35", status="built"):
    path.mkdir(parents=True, exist_ok=True)
    manifest = {
        "format": "edgebuild-bundle",
        "graph_kind": "plugin",
        "build": {"device": "thor"},
        "engines": {"status": status, "builder": "tensorrt", "builder_version": builder_version},
        "roles": {"base": {"engine": "base/model.engine" if status == "built" else None}},
    }
    if sm is not None:
        manifest["engines"]["sm"] = sm
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


THOR = HostProbe(gpu=True, gpu_sm="sm_110", gpu_name="Jetson Thor", tensorrt_version="10.13.0.35")


def test_auto_falls_back_to_torch_without_a_gpu_and_says_why(tmp_path):
    bundle = write_bundle(tmp_path / "b")
    choice = select_backend("auto", bundle, HostProbe(gpu=False, tensorrt_version="10.13.0.35"))
    assert choice.name == "torch"
    assert "no CUDA GPU visible" in choice.reason
    assert "sm_" not in choice.reason  # no SM complaint when there is no GPU at all


def test_auto_falls_back_when_the_engines_were_built_for_another_sm(tmp_path):
    bundle = write_bundle(tmp_path / "b", sm="sm_110")
    h200 = HostProbe(
        gpu=True, gpu_sm="sm_90", gpu_name="NVIDIA H200", tensorrt_version="10.13.0.35"
    )
    choice = select_backend("auto", bundle, h200)
    assert choice.name == "torch"
    assert (
        "built for sm_110" in choice.reason and "this GPU is sm_90 (NVIDIA H200)" in choice.reason
    )


def test_the_sm_of_the_build_device_is_used_when_the_manifest_records_none(tmp_path):
    bundle = write_bundle(tmp_path / "b", sm=None)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["build"]["device"] = "orin"
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    choice = select_backend("auto", bundle, THOR)
    assert choice.name == "torch" and "built for sm_87 (build.device 'orin')" in choice.reason


def test_auto_falls_back_on_a_tensorrt_version_mismatch(tmp_path):
    bundle = write_bundle(tmp_path / "b", builder_version="10.13.0.35")
    probe = HostProbe(gpu=True, gpu_sm="sm_110", tensorrt_version="10.3.0.26")
    choice = select_backend("auto", bundle, probe)
    assert choice.name == "torch"
    assert "TensorRT version mismatch" in choice.reason
    assert "10.13.0.35" in choice.reason and "10.3.0.26" in choice.reason


def test_auto_uses_tensorrt_when_engines_gpu_and_tensorrt_fit(tmp_path):
    bundle = write_bundle(tmp_path / "b")
    choice = select_backend("auto", bundle, THOR)
    assert choice.name == "tensorrt" and "sm_110" in choice.reason
    # a rebuild number differing in the 4th field is the same TensorRT release
    same = HostProbe(gpu=True, gpu_sm="sm_110", tensorrt_version="10.13.0.99")
    assert select_backend("auto", bundle, same).name == "tensorrt"


def test_a_checkpoint_or_an_onnx_only_bundle_has_no_engines(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert "not a bundle" in select_backend("auto", ckpt, THOR).reason
    onnx_only = write_bundle(tmp_path / "b", status="not built: --onnx-only")
    choice = select_backend("auto", onnx_only, THOR)
    assert (
        choice.name == "torch"
        and "no built *.engine files (not built: --onnx-only)" in choice.reason
    )


def test_backend_tensorrt_refuses_with_every_reason(tmp_path):
    bundle = write_bundle(tmp_path / "b")
    with pytest.raises(ConfigError) as err:
        select_backend("tensorrt", bundle, HostProbe(gpu=False))
    assert "--backend tensorrt cannot run" in str(err.value)
    assert "no CUDA GPU" in str(err.value) and "tensorrt Python module" in str(err.value)
    assert select_backend("tensorrt", bundle, THOR).name == "tensorrt"
    assert select_backend("torch", bundle, THOR).name == "torch"


def test_the_default_probe_is_used_when_none_is_given(tmp_path, monkeypatch):
    bundle = write_bundle(tmp_path / "b")
    monkeypatch.setattr(select, "probe_host", lambda: THOR)
    assert select_backend("auto", bundle).name == "tensorrt"
    monkeypatch.setattr(select, "probe_host", lambda: HostProbe(gpu=False))
    assert select_backend("auto", bundle).name == "torch"


# ---------------------------------------------------------------------- plugin library
class FakeRegistry:
    def __init__(self, versions):
        self.versions, self.loaded = versions, []

    def load_library(self, path):
        self.loaded.append(path)
        return object()

    def get_creator(self, name, version, namespace):
        return object() if (name, version, namespace) in self.versions else None


PLUGIN = {"name": "EdgebuildAttention", "version": "1", "namespace": "edgebuild",
          "library": "libedgebuild_plugins.so"}  # fmt: skip


def test_a_missing_plugin_library_names_it_and_how_to_build_it(tmp_path):
    with pytest.raises(MissingDependencyError) as err:
        load_plugin_library(FakeRegistry(set()), PLUGIN, None, tmp_path)
    from edgebuild.doctor import plugin_build_hint

    assert "libedgebuild_plugins.so" in str(err.value) and plugin_build_hint() in str(err.value)


def test_a_plugin_library_of_another_version_is_refused(tmp_path):
    lib = tmp_path / "libedgebuild_plugins.so"
    lib.write_bytes(b"")
    registry = FakeRegistry({("EdgebuildAttention", "2", "edgebuild")})
    with pytest.raises(
        MissingDependencyError, match="does not provide the EdgebuildAttention version 1"
    ):
        load_plugin_library(registry, PLUGIN, lib, tmp_path)
    ok = FakeRegistry({("EdgebuildAttention", "1", "edgebuild")})
    assert load_plugin_library(ok, PLUGIN, lib, tmp_path) == lib and ok.loaded == [str(lib)]


# ---------------------------------------------------------------------- tap ring, graphs
def test_the_tap_ring_keeps_each_sequences_latest_block_and_refuses_overflow():
    ring = TapRing(torch.zeros(10, 2))
    a = ring.write(0, torch.full((4, 2), 1.0))
    b = ring.write(1, torch.full((4, 2), 2.0))
    assert a.eq(1).all() and b.eq(2).all()
    a2 = ring.write(0, torch.full((2, 2), 3.0))  # replaces sequence 0's block
    assert b.eq(2).all() and a2.eq(3).all()
    with pytest.raises(EngineError, match="tap ring full"):
        ring.write(2, torch.zeros(5, 2))
    ring.release(1)
    assert ring.write(2, torch.full((5, 2), 4.0)).eq(4).all()
    assert a2.eq(3).all()  # still pending: never overwritten


def test_cuda_graphs_are_captured_for_shapes_that_repeat():
    cache = GraphCache()
    assert not cache.should_capture((1, 1, 1, 1))
    assert cache.should_capture((1, 1, 1, 1))
    assert not cache.should_capture((1, 1, 5, 5))
    disabled = GraphCache(enabled=False)
    assert not disabled.should_capture((1,)) and not disabled.should_capture((1,))


# ---------------------------------------------------------------------- lattice walk
def strong_markov(tdraft, gain=40.0):
    """Scale the Markov head so that the previous token really moves the choice."""
    with torch.no_grad():
        tdraft.model.markov_head.markov_w1.weight.mul_(gain)
    return tdraft


def _lattice_inputs(draft, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, draft.config.block_size, draft.config.hidden_size, generator=g)
    return h, torch.tensor([3, 17])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_lattice_walk_proposes_what_the_torch_draft_walks(tiny, temperature):
    target_dir, draft_dir, _ = tiny
    tdraft = strong_markov(load_draft(draft_dir, target_dir, 4, top_k=8))
    graph = DraftGraph(tdraft.model, GraphKind.PLUGIN, 8, 64, 8)
    h, anchors = _lattice_inputs(tdraft.model)
    with torch.no_grad():
        cand, scores, conf = graph._lattice(tdraft.model, tdraft.model.norm(h), anchors)
        hn = tdraft.model.norm(h)
        want = tdraft.walk(hn, tdraft.model.base_logits(hn), anchors.tolist(), [4, 3],
                           [SamplingParams(temperature=temperature, seed=1)] * 2,
                           [torch.Generator().manual_seed(s) for s in (5, 6)])  # fmt: skip
    params = [SamplingParams(temperature=temperature, seed=1)] * 2
    got = walk_lattice(cand, scores, conf, [4, 3], params,
                       [torch.Generator().manual_seed(s) for s in (5, 6)])  # fmt: skip
    for w, g in zip(want, got, strict=True):
        assert g.tokens == w.tokens
        torch.testing.assert_close(g.confidence, w.confidence, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g.dense_q(96), w.dense_q(96), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------- stand-in engines
class GraphRunner:
    """An engine stand-in: runs the exported graph eagerly on the bound CPU buffers.

    KV outputs are bound to the pools (as the aliased plugin outputs are), so copying the
    functional ``present_kv_cache`` into them is the in-place update.
    """

    def __init__(self, graph):
        self.graph, self.keys = graph, []

    @torch.no_grad()
    def execute(self, profile, bindings, graph_key=None):
        self.keys.append((profile, graph_key))
        outs = self.graph(*[bindings[n] for n in self.graph.input_names()])
        outs = (outs,) if isinstance(outs, torch.Tensor) else outs  # the visual graph: one
        for name, value in zip(self.graph.output_names(), outs, strict=True):
            bindings[name].copy_(value)


def _fill_rope(graph, rotary_dim, rope):
    buf = graph.rope_cos_sin
    buf.copy_(rope_cos_sin_table(rotary_dim, buf.shape[0], rope))


def standin_backends(tiny, n=4, top_k=8, max_batch=2, page_size=8):
    """TrtTarget + TrtDraft over stand-in engines, and the torch pair they must equal."""
    target_dir, draft_dir, model = tiny
    tdraft = strong_markov(load_draft(draft_dir, target_dir, n, top_k=top_k))
    taps = tdraft.target_layer_ids
    base = BaseGraph(model, taps, GraphKind.PLUGIN, page_size, 256)
    _fill_rope(base, base.rotary_dim, model.config.rope)
    dgraph = DraftGraph(tdraft.model, GraphKind.PLUGIN, page_size, 256, top_k)
    _fill_rope(dgraph, tdraft.model.config.head_dim, tdraft.model.config.rope)
    manifest = {
        "build": {"device": "thor", "precision": "bf16", "max_batch_size": max_batch,
                  "max_input_len": 48, "max_kv_cache_capacity": 128, "page_size": page_size},
        "speculative": {"num_speculative_tokens": n},
        "roles": {"base": {**graph_io(base), "tap_layers": list(taps)},
                  "draft": graph_io(dgraph)},
    }  # fmt: skip
    record_profiles(manifest)
    plan = plan_buffers(manifest)
    brun, drun = GraphRunner(base), GraphRunner(dgraph)
    trt_target = TrtTarget(brun, role_io(manifest, "base"), role_profiles(manifest, "base"),
                           plan, taps, 1024, "cpu")  # fmt: skip
    trt_draft = TrtDraft(drun, role_io(manifest, "draft"), role_profiles(manifest, "draft"),
                         plan, tdraft.block_size, taps, 96, "cpu")  # fmt: skip
    torch_target = TorchTarget(model, max_kv_rows=4096, page_size=page_size)
    return trt_target, trt_draft, torch_target, tdraft, brun, drun


PROMPTS = [[5, 9, 2, 33, 7], [11, 4, 80, 3, 3, 19, 60, 2, 41], [1, 2, 3]]


def _run(decoder, max_tokens=14, temperature=0.0):
    states = [
        RequestState.create(
            f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i)
        )
        for i, p in enumerate(PROMPTS)
    ]
    run_to_completion(decoder, states)
    return states


def test_target_only_greedy_on_standin_engines_equals_the_torch_backend(tiny):
    trt_target, _, torch_target, _, brun, _ = standin_backends(tiny)
    want = [s.output_ids for s in _run(TargetOnlyDecoder(torch_target))]
    got = [s.output_ids for s in _run(TargetOnlyDecoder(trt_target))]
    assert got == want
    # 3 requests on engines of max batch 2: decode runs as chunks of 2 and 1 in the generate
    # profile (1) with CUDA-graph keys (batch, rows, logits rows); the 9-token prompt (more
    # rows than a verify call) runs in the prefill profile (0), never graph-keyed
    keys = brun.keys
    assert {(1, (2, 1, 1)), (1, (1, 1, 1))} <= set(keys)
    assert (0, None) in keys and all(k is None for p, k in keys if p == 0)
    assert sum(k == (2, 1, 1) for _, k in keys) >= 2  # a repeating shape: captured on a GPU
    assert trt_target.allocator.free_pages == trt_target.limits.num_pages  # all freed


class RecordingDSpark(DSparkDecoder):
    """Keeps every proposal (tokens and confidences) for comparison."""

    def __init__(self, *args):
        super().__init__(*args)
        self.proposals = []

    def propose(self, live):
        out = super().propose(live)
        self.proposals.append([(p.tokens, p.confidence.tolist()) for p in out])
        return out


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_dspark_on_standin_engines_equals_the_torch_backend(tiny, temperature):
    trt_target, trt_draft, torch_target, tdraft, brun, drun = standin_backends(tiny)
    torch_dec = RecordingDSpark(torch_target, tdraft, 4)
    trt_dec = RecordingDSpark(trt_target, trt_draft, 4)
    want = _run(torch_dec, temperature=temperature)
    got = _run(trt_dec, temperature=temperature)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert len(trt_dec.proposals) == len(torch_dec.proposals) > 3
    assert sum(len(t) for step in trt_dec.proposals for t, _ in step) > 20
    for g_step, w_step in zip(trt_dec.proposals, torch_dec.proposals, strict=True):
        for (g_tok, g_conf), (w_tok, w_conf) in zip(g_step, w_step, strict=True):
            assert g_tok == w_tok
            assert g_conf == pytest.approx(w_conf, rel=1e-4, abs=1e-6)
    for g, w in zip(got, want, strict=True):
        assert (
            g.metrics.to_dict()["acceptance_by_position"]
            == w.metrics.to_dict()["acceptance_by_position"]
        )
    # verify calls are graph-keyed (rows = 1 + drafts); draft calls with few context rows too
    assert any(k is not None and k[1] == 5 for p, k in brun.keys if p == 1)
    assert any(k is not None for _, k in drun.keys)
    assert trt_draft.allocator.free_pages == trt_draft.limits.num_pages
    assert not trt_draft.pending and not trt_target.ring.live


def test_a_sequence_beyond_the_engines_kv_capacity_is_refused_before_running(tiny):
    trt_target, _, _, _, brun, _ = standin_backends(tiny)
    seq = trt_target.new_sequence()
    rows = torch.arange(40) % 90
    trt_target.forward([seq], [rows], [[39]])
    trt_target.forward([seq], [rows], [[39]])
    trt_target.forward([seq], [rows], [[39]])  # 120 rows of 128
    calls = len(brun.keys)
    from edgebuild.runtime.kv_cache import CacheCapacityError

    with pytest.raises(CacheCapacityError, match="KV capacity of 128 rows per sequence"):
        trt_target.forward([seq], [rows[:9]], [[8]])
    assert len(brun.keys) == calls and seq.length == 120


def test_an_image_prompt_on_a_text_base_engine_is_refused_before_running(tiny):
    trt_target, _, _, _, brun, _ = standin_backends(tiny)
    assert not trt_target.multimodal
    seq = trt_target.new_sequence()
    images = MultimodalPrefill(
        torch.tensor([1]), torch.zeros(1, 64), torch.zeros(3, 2, dtype=torch.long), 0
    )
    with pytest.raises(ConfigError, match="without an image_embeds input.*edgebuild build"):
        trt_target.forward([seq], [torch.tensor([1, 2])], [[1]], (), [images])
    assert brun.keys == [] and seq.length == 0


def test_a_bundle_that_records_no_engine_profiles_is_refused_with_how_to_rebuild():
    m = hand_manifest()
    del m["roles"]["base"]["profiles"]  # a bundle built before profiles were recorded
    with pytest.raises(BundleError, match=r"roles.base records no engine optimization profiles"):
        role_profiles(m, "base")
    m["roles"]["draft"]["profiles"] = [{"name": "all", "shapes": {"input_ids": [[1, 1]]}}]
    with pytest.raises(BundleError, match="malformed entry.*rebuild"):
        role_profiles(m, "draft")
