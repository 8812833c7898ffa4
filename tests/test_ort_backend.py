"""A bundle's own ONNX graphs run end to end on the CPU through runtime/trt/ (the onnxruntime
adapter, :mod:`edgebuild.runtime.ort_engine`), the attention plugin node executed by the
plugin's host build (plugins/src/attention_host.cpp).

Oracle: the torch backend over the bundle's source checkpoints, at float32 (the bundles are
built ``--onnx-only --dtype float32``; onnxruntime's CPU provider has no bfloat16 MatMul).
Tolerance policy (fp32): prompt logits and cached K/V within atol 1e-4, rtol 1e-4 of torch's
on the tiny 2-layer bundle, atol 3e-3, rtol 1e-3 on the 30-layer example (largest difference
seen 9.2e-4: GEMM summation order); greedy tokens (target-only and DSpark) identical. Meta-tests: deliberate export faults applied to
a copy of the base graph (two inputs swapped; the RoPE table offset by one row; one NVFP4
dequantize scale replaced by 1) make the check fail. Also on the adapter: a tiny NVFP4
bundle (FP4 DequantizeLinear chains folded in memory, runtime/ort_dequant.py) against the
torch backend's NVFP4 target; preemption in the serving scheduler; sampled DSpark against the
target's exact law (chi-square); a tiny VLM bundle with two images. The example SmolLM2-135M
bundles (BF16 checkpoint, and its NVFP4 export with the NVFP4 head; + the shipped DSpark
draft) are ``slow``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from dspark_fixtures import make_random_draft
from export_fixtures import make_tiny_target, write_tiny_tokenizer

from edgebuild.bundle.build import BuildOptions, build_bundle, recipe_from_flags
from edgebuild.errors import ConfigError, EngineError
from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.runtime.sampling import SamplingParams

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxruntime_extensions")
if shutil.which("g++") is None:
    pytest.skip("g++ is needed to build the plugin's host code", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
ATOL = RTOL = 1e-4
EXAMPLE_ATOL, EXAMPLE_RTOL = 3e-3, 1e-3  # the 30-layer example model (see its test)
FP32 = RuntimeOptions(dtype=torch.float32, ort_threads=1)
N_SAMPLED = 800  # requests of the sampled-DSpark distribution test


def build_fp32(target: Path, draft: Path | None, out: Path, **limits) -> Path:
    recipe = recipe_from_flags(target, draft, **limits)
    build_bundle(recipe, out, BuildOptions(onnx_only=True, progress=False, dtype="float32"))
    return out


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ort")
    target = make_tiny_target(root / "qwen3", "qwen3", num_hidden_layers=2)  # q/k norm
    write_tiny_tokenizer(target, 256)
    draft = make_random_draft(root / "draft", target, num_layers=1, block_size=4)
    limits = dict(max_batch_size=2, max_input_len=32, max_kv_cache_capacity=64, page_size=8)
    return build_fp32(target, draft, root / "bundle", **limits)


TINY_PROMPTS = [[5, 9, 2, 33, 7], [11, 4, 80, 3, 3, 19, 60, 2, 41], [1, 2, 3], [200, 17]]


def _pools(target) -> list[torch.Tensor]:
    if hasattr(target, "pools"):  # the torch backend
        return list(target.pools)
    n = sum(1 for t in target.io.inputs if t.name.startswith("kv_cache_"))
    return [target.buffers.pool(f"kv_cache_{i}") for i in range(n)]


def _seq_kv(target, seq) -> torch.Tensor:
    """The sequence's cached K/V rows of every layer [L, 2, Hkv, rows, D] (page order)."""
    layers = [torch.cat([pool[p] for p in seq.pages], dim=2) for pool in _pools(target)]
    return torch.stack(layers)[:, :, :, : seq.length]


def prompt_logits(llm: LLM, prompts) -> list[torch.Tensor]:
    """Per prompt (one at a time): fp32 logits of its last rows (at most the engines' verify
    length) and of one decode row, then every layer's cached K/V rows (RoPE'd at absolute
    positions: a table offset that attention's relative positions hide shows here)."""
    out = []
    for p in prompts:
        seq = llm.target.new_sequence()
        rows = torch.tensor(p)
        step = llm.target.forward([seq], [rows], [list(range(max(0, len(p) - 4), len(p)))])
        nxt = torch.tensor([int(step.logits[0][-1].argmax())])
        step2 = llm.target.forward([seq], [nxt], [[0]])
        kv = _seq_kv(llm.target, seq).float().flatten()
        out.append(torch.cat([step.logits[0].flatten(), step2.logits[0].flatten(), kv]))
        llm.target.free(seq)
    return out


def greedy(llm: LLM, prompts, max_tokens: int, draft: bool) -> list[list[int]]:
    runner = llm if draft else llm.without_draft()
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [s.output_ids for s in runner.generate_ids(prompts, sp)]


def check_parity(ort: LLM, ref: LLM, prompts, max_tokens: int, atol=ATOL, rtol=RTOL) -> None:
    """The fp32 tolerance policy (module docstring); AssertionError on any difference."""
    for got, want in zip(prompt_logits(ort, prompts), prompt_logits(ref, prompts), strict=True):
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    want = greedy(ref, prompts, max_tokens, draft=False)
    assert greedy(ort, prompts, max_tokens, draft=False) == want
    if ort.draft is not None:
        assert greedy(ort, prompts, max_tokens, draft=True) == want


@pytest.fixture(scope="module")
def tiny_pair(tiny_bundle):
    return (
        LLM(tiny_bundle, backend="onnxruntime", options=FP32),
        LLM(tiny_bundle, backend="torch", options=FP32),
    )


def test_the_tiny_bundles_graphs_on_onnxruntime_equal_the_torch_backend(tiny_pair):
    ort, ref = tiny_pair
    assert ort.draft is not None and type(ort.target).__name__ == "TrtTarget"
    check_parity(ort, ref, TINY_PROMPTS, max_tokens=10)
    runner = ort.target.runner
    assert {p for p, _ in runner.keys} == {0, 1}  # prefill and generate profiles both ran
    # every KV output was the plugin's in-place write into the pool (no copy back)
    assert runner.in_place == 2 * len(runner.keys) and ort.draft.runner.in_place > 0
    assert ort.target.allocator.free_pages == ort.target.limits.num_pages


def test_without_bound_pools_the_full_present_kv_cache_is_copied_back_and_equal(
    tiny_pair, monkeypatch
):
    """The fallback path (a node whose pool is not bound returns the whole updated pool, the
    runner copies it in) gives the same logits and K/V as the in-place path."""
    from contextlib import contextmanager

    from edgebuild.runtime import ort_attention

    real = ort_attention.bound_pools

    @contextmanager
    def unbound(pools):
        with real({}) as written:
            yield written

    ort, ref = tiny_pair
    before = ort.target.runner.in_place
    monkeypatch.setattr(ort_attention, "bound_pools", unbound)
    got = prompt_logits(ort, TINY_PROMPTS[:2])
    assert ort.target.runner.in_place == before  # nothing was written in place
    for g, w in zip(got, prompt_logits(ref, TINY_PROMPTS[:2]), strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------------- meta-tests
def _swap_inputs(model, a="past_lengths", b="input_lengths"):
    for node in model.graph.node:
        node.input[:] = [b if x == a else a if x == b else x for x in node.input]


def _offset_rope(model):
    from onnx import numpy_helper

    for i, init in enumerate(model.graph.initializer):
        if init.name == "rope_cos_sin":
            table = numpy_helper.to_array(init)
            shifted = np.concatenate([table[1:], table[-1:]])  # row p holds position p + 1
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(shifted, init.name))
            return
    raise AssertionError("no rope_cos_sin initializer in the base graph")


def faulty_copy(bundle: Path, fault, tmp_path: Path) -> LLM:
    """An adapter LLM over a copy of ``bundle`` whose base graph has ``fault`` applied."""
    copy = tmp_path / "faulty"
    shutil.copytree(bundle, copy)
    path = copy / "base" / "model.onnx"
    model = onnx.load(str(path))
    fault(model)
    for f in (copy / "base").glob("model.onnx*"):
        f.unlink()
    onnx.save(model, str(path), save_as_external_data=True, location="model.onnx.data")
    return LLM(copy, backend="onnxruntime", options=FP32, verify_bundle=False)


@pytest.mark.parametrize("fault", [_swap_inputs, _offset_rope], ids=["swap", "rope"])
def test_a_deliberate_export_fault_in_a_copy_of_the_graph_fails_the_check(
    tiny_bundle, tiny_pair, fault, tmp_path
):
    faulty = faulty_copy(tiny_bundle, fault, tmp_path)
    with pytest.raises((AssertionError, EngineError)):
        check_parity(faulty, tiny_pair[1], TINY_PROMPTS[:2], max_tokens=4)


def test_a_bfloat16_bundle_is_refused_with_how_to_rebuild(tiny_bundle, tmp_path):
    import json

    copy = tmp_path / "bf16"
    shutil.copytree(tiny_bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    for e in manifest["roles"]["base"]["inputs"]:
        if e["name"].startswith("kv_cache_"):
            e["dtype"] = "bfloat16"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"bfloat16 graph.*--dtype float32"):
        LLM(copy, backend="onnxruntime", options=FP32, verify_bundle=False)


# ---------------------------------------------------------------------- NVFP4 weights
@pytest.fixture(scope="module")
def nvfp4_bundle(tmp_path_factory) -> Path:
    """A tiny Qwen3 quantized to NVFP4 by ModelOpt (lm_head too, so the draft graph borrows an
    NVFP4 head), with a random DSpark draft, built with native DequantizeLinear chains."""
    pytest.importorskip("modelopt.torch.quantization", reason="the NVFP4 fixture needs modelopt")
    from modelopt_fixtures import make_tiny_nvfp4_qwen3

    root = tmp_path_factory.mktemp("ort-nvfp4")
    target = make_tiny_nvfp4_qwen3(root, quantize_lm_head=True)
    write_tiny_tokenizer(target, 1000)
    draft = make_random_draft(root / "draft", target, num_layers=1, block_size=4)
    limits = dict(max_batch_size=2, max_input_len=32, max_kv_cache_capacity=64, page_size=8)
    return build_fp32(target, draft, root / "bundle", **limits)


@pytest.fixture(scope="module")
def nvfp4_pair(nvfp4_bundle):
    return (
        LLM(nvfp4_bundle, backend="onnxruntime", options=FP32),
        LLM(nvfp4_bundle, backend="torch", options=FP32),
    )


def test_the_fp8_and_fp4_decoders_equal_torchs_and_the_spec_table():
    from edgebuild.runtime.ort_dequant import e2m1_values, e4m3fn_values

    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(e4m3fn_values(), want)  # NaN == NaN here
    assert e4m3fn_values()[0x7E] == 448.0 and e4m3fn_values()[0x01] == 2.0**-9
    assert list(e2m1_values()[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]  # spec table
    assert list(e2m1_values()[8:]) == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def test_an_nvfp4_bundle_runs_its_folded_weights_and_equals_the_torch_nvfp4_target(
    nvfp4_bundle, nvfp4_pair
):
    """The shipped graphs hold FP4 DequantizeLinear chains (onnxruntime has no kernel); the
    adapter folds them in memory (runtime/ort_dequant.py) and equals the torch runtime's
    NVFP4 target (dequantized by edgebuild.checkpoint.quant)."""
    base = onnx.load(str(nvfp4_bundle / "base" / "model.onnx"), load_external_data=False)
    fp4 = {t.name for t in base.graph.initializer if t.data_type == onnx.TensorProto.FLOAT4E2M1}
    assert "lm_head.weight" in fp4 and len(fp4) == 2 * 7 + 1  # the file on disk: unchanged
    ort, ref = nvfp4_pair
    assert ort.target.runner.folded == 2 * len(fp4) and ort.draft.runner.folded == 2
    check_parity(ort, ref, TINY_PROMPTS, max_tokens=10)


def _drop_a_scale(model):
    """weight_scale_2 (the global scale of the NVFP4 block scales) of one linear set to 1."""
    from onnx import numpy_helper

    name = "model.layers.1.mlp.down_proj.weight_scale_2"
    for i, init in enumerate(model.graph.initializer):
        if init.name == name:
            one = np.ones_like(numpy_helper.to_array(init))
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(one, name))
            return
    raise AssertionError(f"no {name} initializer in the base graph")


def test_a_dropped_dequantize_scale_in_a_copy_of_the_graph_fails_the_check(
    nvfp4_bundle, nvfp4_pair, tmp_path
):
    faulty = faulty_copy(nvfp4_bundle, _drop_a_scale, tmp_path)
    with pytest.raises(AssertionError):
        check_parity(faulty, nvfp4_pair[1], TINY_PROMPTS[:2], max_tokens=4)


# ---------------------------------------------------------------------- a VLM bundle
@pytest.fixture(scope="module")
def vlm_pair(tmp_path_factory):
    """The tiny random Qwen2.5-VL of tests/vlm_fixtures.py with a random DSpark draft, built
    ``--onnx-only --dtype float32``: plugin base and draft graphs, portable visual graph."""
    pytest.importorskip("transformers")
    pytest.importorskip("PIL")
    from vlm_fixtures import write_tiny_vlm

    root = tmp_path_factory.mktemp("ort-vlm")
    target = write_tiny_vlm(root / "vlm")
    draft = make_random_draft(root / "draft", target, block_size=5, num_layers=1)
    limits = dict(max_batch_size=2, max_input_len=128, max_kv_cache_capacity=256, page_size=16,
                  max_image_tokens=64, max_images=3)  # fmt: skip
    bundle = build_fp32(target, draft, root / "bundle", **limits)
    return (
        LLM(bundle, backend="onnxruntime", options=FP32),
        LLM(bundle, backend="torch", options=FP32),
        bundle,
    )


def test_a_vlm_bundle_with_two_images_on_the_adapter_equals_the_torch_backend(vlm_pair):
    """The visual graph and the multimodal base graph run on onnxruntime: greedy target-only
    and DSpark tokens of a two-image prompt (and a one-image one) equal the torch backend's."""
    from vlm_fixtures import noise_image

    ort, ref, _ = vlm_pair
    img = {"type": "image_url", "image_url": {"url": "data:,"}}
    two = [noise_image(60, 100, seed=2), noise_image(90, 50, seed=3)]
    one = [noise_image(200, 130, seed=1)]
    msgs = [[{"role": "user", "content": [img, {"type": "text", "text": "vs"}, img]}],
            [{"role": "user", "content": [img, {"type": "text", "text": "Hi"}]}]]  # fmt: skip
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run(llm, draft, pictures):
        images = [llm.process_images(p) for p in pictures]
        ids = [llm.encode_messages(m, im) for m, im in zip(msgs, images, strict=True)]
        runner = llm if draft else llm.without_draft()
        return [s.output_ids for s in runner.generate_ids(ids, sp, images=images)]

    want = run(ref, False, [two, one])
    assert run(ort, False, [two, one]) == want
    assert run(ort, True, [two, one]) == want
    assert ort.target.runner.keys and ort.vision.tower.runner.keys  # the visual graph ran
    swapped = [two[::-1], one]  # the images matter to the tokens
    assert run(ort, False, swapped) == run(ref, False, swapped) != want


def test_a_vlm_bundle_without_its_visual_graph_is_refused_naming_it(vlm_pair, tmp_path):
    import json

    copy = tmp_path / "novis"
    shutil.copytree(vlm_pair[2], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["roles"]["visual"]["onnx"] = None
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"no visual graph \(manifest roles.visual.onnx\)"):
        LLM(copy, backend="onnxruntime", options=FP32, verify_bundle=False)


# ---------------------------------------------------------------------- the example bundle
EXAMPLE_PROMPTS = [
    [1, 2, 3, 4, 5],
    [10, 20, 30, 40, 50, 60, 70],
    [504, 216, 34],
    [198, 29, 254, 29, 1195],
    [2000, 3000, 4000, 5000],
    [42],
    [7, 7, 7, 7, 7, 7, 7, 7, 7],
    [1234, 567, 89, 10, 11, 12],
]


@pytest.mark.slow
def test_the_example_bundle_on_onnxruntime_equals_the_torch_backend(smollm2_dir, tmp_path_factory):
    example = smollm2_dir  # prepared on first use (never skipped for want of a prior test)
    draft = ROOT / "edgebuild" / "data" / "smollm2-135m-dspark"
    limits = dict(max_batch_size=2, max_input_len=32, max_kv_cache_capacity=64, page_size=16)
    bundle = build_fp32(example, draft, tmp_path_factory.mktemp("ex") / "bundle", **limits)
    ort = LLM(bundle, backend="onnxruntime", options=FP32)
    ref = LLM(bundle, backend="torch", options=FP32)
    # 30 fp32 layers whose GEMMs sum in another order (MLAS vs torch): logits of magnitude
    # ~20 differ by up to ~1e-3 (seen: 9.2e-4); tokens must still be identical
    check_parity(ort, ref, EXAMPLE_PROMPTS, max_tokens=6, atol=EXAMPLE_ATOL, rtol=EXAMPLE_RTOL)


@pytest.mark.slow
def test_the_example_nvfp4_bundle_on_onnxruntime_equals_the_torch_nvfp4_target(
    nvfp4_dir, tmp_path_factory
):
    """The example's NVFP4 target (ModelOpt NVFP4 weights and lm_head, the draft borrowing the
    NVFP4 head) with the shipped draft: its FP4 DequantizeLinear chains folded in memory
    (runtime/ort_dequant.py); the same policy as the BF16 example (largest logit difference
    seen 1.4e-3). About 2 minutes here: a 41 s build, 50 s of loading (the fold decodes 30
    layers' weights), 15 s of decoding."""
    draft = ROOT / "edgebuild" / "data" / "smollm2-135m-dspark"
    limits = dict(max_batch_size=2, max_input_len=32, max_kv_cache_capacity=64, page_size=16)
    bundle = build_fp32(nvfp4_dir, draft, tmp_path_factory.mktemp("exnv") / "bundle", **limits)
    ort = LLM(bundle, backend="onnxruntime", options=FP32)
    ref = LLM(bundle, backend="torch", options=FP32)
    assert ort.target.runner.folded > 2 * 7 * 30 and ort.draft.runner.folded == 2  # + lm_head
    check_parity(ort, ref, EXAMPLE_PROMPTS, max_tokens=6, atol=EXAMPLE_ATOL, rtol=EXAMPLE_RTOL)


# ---------------------------------------------------------------------- serving paths, CLI
def test_prefix_cache_hits_and_chunked_prefill_on_the_adapter_equal_the_torch_backend(
    tiny_bundle,
):
    from edgebuild.runtime.prefill import PrefillConfig

    prefill = PrefillConfig(enable_chunked_prefill=True, prefill_chunk=8)
    options = RuntimeOptions(dtype=torch.float32, ort_threads=1, prefill=prefill)
    ort = LLM(tiny_bundle, backend="onnxruntime", options=options)
    ref = LLM(tiny_bundle, backend="torch", options=options)
    shared = [7, 3, 90, 14, 2, 2, 51, 8, 9, 30, 31, 4, 77, 5, 6, 60, 61, 62]  # 2 full pages
    prompts = [shared + [1, 2], shared + [40], [9] * 21]  # 21 rows: three chunks of <= 8
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    want = [[s.output_ids for s in ref.generate_ids([p], sp)][0] for p in prompts]
    got = [[s.output_ids for s in ort.generate_ids([p], sp)][0] for p in prompts]
    assert got == want
    assert ort.decoder.stats.prefix_hits >= 16  # the second prompt reused the shared pages


def chi2_limit(dof: int) -> float:
    """The chi-square 0.999 quantile (Wilson-Hilferty), as tests/test_dspark_decoding.py."""
    import math

    return dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3


@pytest.fixture(scope="module")
def vocab8_pair(tmp_path_factory):
    """The sampled-DSpark test's pair: the vocab-8 tiny Llama of tests/test_dspark_decoding.py
    (few outcomes: the chi-square has power at a few hundred requests) with a random draft."""
    from tiny_checkpoints import write_tiny_llama

    root = tmp_path_factory.mktemp("ort-v8")
    target = write_tiny_llama(root / "t", vocab=8, layers=2, seed=5, sharpen=3.0)
    write_tiny_tokenizer(target, 8)
    draft = make_random_draft(root / "d", target, block_size=4, markov_rank=4, scale=0.5)
    limits = dict(max_batch_size=2, max_input_len=16, max_kv_cache_capacity=32, page_size=8)
    bundle = build_fp32(target, draft, root / "bundle", num_speculative_tokens=3,
                        draft_top_k=4, **limits)  # fmt: skip
    return (
        LLM(bundle, backend="onnxruntime", options=FP32),
        LLM(bundle, backend="torch", options=FP32),
    )


def test_sampled_dspark_on_the_adapter_follows_the_targets_law(vocab8_pair):
    """Chi-square of (token 2, token 3) against the exact law from the torch backend's target
    (as tests/test_dspark_decoding.py): token 1 comes from the prefill, tokens 2 and 3 are
    drafted and verified by rejection sampling (max_tokens 4), one fixed seed per request.
    Power (tried once): the counts against the law at temperature 1.1 or 1.6 instead of 1.3
    give chi2 100 / 124, the limit is 48 (22 degrees of freedom)."""
    ort, ref = vocab8_pair
    prompt, temp, n = [1, 2, 3], 1.3, N_SAMPLED

    def probs(ids):
        seq = ref.target.new_sequence()
        step = ref.target.forward([seq], [torch.tensor(ids)], [[len(ids) - 1]])
        ref.target.free(seq)
        return torch.softmax(step.logits[0][0].double() / temp, -1)

    vocab = 8
    exact = torch.zeros(vocab, vocab, dtype=torch.float64)  # the law of (t2, t3)
    p1 = probs(prompt)
    for t1 in range(vocab):
        p2 = probs(prompt + [t1])
        for t2 in range(vocab):
            exact[t2] += p1[t1] * p2[t2] * probs(prompt + [t1, t2])
    counts, accepted = torch.zeros_like(exact), 0
    for i in range(0, n, 2):
        params = [SamplingParams(max_tokens=4, temperature=temp, seed=7000 + i + j,
                                 ignore_eos=True) for j in (0, 1)]  # fmt: skip
        for st in ort.generate_ids([prompt, prompt], params):
            counts[st.output_ids[1], st.output_ids[2]] += 1
            accepted += st.metrics.accepted_at[0] if st.metrics.accepted_at else 0
    expected, counts = exact.flatten() * n, counts.flatten()
    keep = expected >= 5  # chi-square validity; pool the rest
    obs = torch.cat([counts[keep], counts[~keep].sum().reshape(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().reshape(1)])
    chi2, dof = float(((obs - exp) ** 2 / exp.clamp_min(1e-9)).sum()), int(keep.sum())
    assert chi2 < chi2_limit(dof), (chi2, chi2_limit(dof), dof)
    assert 0.05 * n < accepted < 0.95 * n, accepted  # drafts both accepted and rejected


def run_scheduler(llm, prompts, params) -> tuple[list, int]:
    """The final events of ``prompts`` submitted together to the serving scheduler, and its
    preemption count (as tests/test_draft_kv_budget.py)."""
    import asyncio

    from edgebuild.serve.scheduler import Scheduler

    async def main():
        sched = Scheduler(llm, max_batch_size=2)
        sched.start()
        try:
            tickets = [sched.submit(p, params) for p in prompts]
            ends = [ev for t in tickets async for ev in t.events() if ev.kind != "token"]
            return ends, sched.metrics.preemptions._value.get()
        finally:
            await asyncio.to_thread(sched.close)

    return asyncio.run(asyncio.wait_for(main(), 300))


def test_a_pool_too_small_for_two_requests_preempts_on_the_adapter_and_stays_exact(tiny_pair):
    """The engines' pool (16 pages of 8 rows) less 6 pages held by another sequence: each
    request (~50 rows, 7 pages) fits alone, both do not; the scheduler preempts one, which
    recomputes through the adapter, and both equal the torch backend's solo runs."""
    ort, ref = tiny_pair
    prompts = [[5, 9, 2, 33, 7, 11], [12, 4, 80, 3, 19]]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = [ref.generate_ids([p], params)[0].stopper.final_text() for p in prompts]
    alloc = ort.target.allocator
    hog = alloc.new_sequence()
    alloc.reserve(hog, 6 * alloc.page_size)
    try:
        ends, preemptions = run_scheduler(ort, prompts, params)
    finally:
        alloc.free(hog)
    assert [e.kind for e in ends] == ["done", "done"], [e.message for e in ends]
    assert preemptions >= 1
    assert [e.completion_tokens for e in ends] == [40, 40]
    assert [e.final_text for e in ends] == want
    assert ort.free_pages() == (alloc.num_pages, ort.draft.allocator.num_pages)


def test_auto_never_picks_onnxruntime_and_it_needs_a_bundle(tiny_bundle, tmp_path):
    from edgebuild.runtime.select import HostProbe, select_backend

    thor = HostProbe(gpu=True, gpu_sm="sm_110", tensorrt_version="10.13.0.35")
    for probe in (HostProbe(gpu=False), thor):
        assert select_backend("auto", tiny_bundle, probe).name != "onnxruntime"
    assert select_backend("onnxruntime", tiny_bundle, thor).name == "onnxruntime"
    with pytest.raises(ConfigError, match="not a bundle.*--onnx-only --dtype float32"):
        select_backend("onnxruntime", tmp_path, thor)


def test_edgebuild_run_backend_onnxruntime_prints_the_torch_backends_text(tiny_bundle):
    import json

    from click.testing import CliRunner

    from edgebuild.cli import main

    def run(backend):
        args = ["run", str(tiny_bundle), "--prompt", "a b c", "--max-tokens", "6",
                "--temperature", "0", "--dtype", "float32", "--json", "--backend", backend]  # fmt: skip
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 0, res.output
        return json.loads(res.output[res.output.index("{") :])

    got, want = run("onnxruntime"), run("torch")
    assert (got["backend"], want["backend"], got["mode"]) == ("onnxruntime", "torch", "dspark")
    assert got["output_ids"] == want["output_ids"] and got["texts"] == want["texts"]
    assert len(got["output_ids"][0]) == 6


def test_serving_a_bundle_on_onnxruntime_plans_it_and_a_checkpoint_is_refused(tiny_bundle):
    from edgebuild.deploy import prepare_serve
    from edgebuild.runtime.select import HostProbe
    from edgebuild.serve.config import ServeConfig

    config = ServeConfig(model=str(tiny_bundle), backend="onnxruntime")
    config.validate()
    plan = prepare_serve(config, HostProbe(gpu=False))(None)
    assert plan.backend.name == "onnxruntime" and Path(plan.model) == tiny_bundle
    target = json_source(tiny_bundle)
    with pytest.raises(ConfigError, match="--backend onnxruntime serves a bundle"):
        prepare_serve(ServeConfig(model=str(target), backend="onnxruntime"), HostProbe(gpu=False))


def json_source(bundle: Path) -> Path:
    import json

    manifest = json.loads((bundle / "manifest.json").read_text())
    return Path(manifest["sources"]["target"]["path"])
