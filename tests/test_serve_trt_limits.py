"""Issue 16 items 8 and 9 on the TensorRT backend, with the stand-in engines of
test_trt_backend (the exported graphs run eagerly on the CPU): the KV pool and the
per-sequence capacity are two limits with two names, the scheduler admits as many sequences
as the engines' pool holds, and a `draft_top_k` the draft engine was not built for is
refused instead of ignored."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import pytest
from dspark_fixtures import make_random_draft
from export_fixtures import write_tiny_tokenizer
from test_dspark_decoding import write_tiny_target
from test_trt_backend import standin_backends

from edgebuild.checkpoint.source import WeightSource
from edgebuild.errors import ConfigError
from edgebuild.models.llama import LlamaForCausalLM
from edgebuild.runtime.decoding import DSparkDecoder, run_to_completion
from edgebuild.runtime.llm import LLM, RuntimeOptions, load_tokenizer
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.runtime.trt_backend import TrtRuntime
from edgebuild.serve.scheduler import Scheduler
from edgebuild.speculative.config import SpeculativeConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """test_trt_backend's tiny target and draft (the stand-in engines are exported from them)."""
    root = tmp_path_factory.mktemp("trt_tiny")
    target_dir = write_tiny_target(root / "target")
    draft_dir = make_random_draft(root / "draft", target_dir, num_layers=1, block_size=5)
    return target_dir, draft_dir, LlamaForCausalLM.from_source(WeightSource(target_dir))


def runtime(tiny, draft=True):
    trt_target, trt_draft, _, _, _, _ = standin_backends(tiny)  # max batch 2, 128 rows/seq
    target_dir, _, model = tiny
    rt = TrtRuntime(
        trt_target,
        trt_draft if draft else None,
        model.config,
        SimpleNamespace(limits=trt_target.limits),
    )
    return rt, model


def test_the_pool_and_the_per_sequence_capacity_are_two_limits(tiny):
    rt, _ = runtime(tiny)
    opts = rt.runtime_options(RuntimeOptions())
    # build.max_kv_cache_capacity (128) is per sequence; the engines' pools hold 2 of them
    assert opts.max_seq_rows == opts.seq_capacity == 128
    assert opts.max_kv_rows == 2 * 128 == rt.target.allocator.num_pages * 8


def trt_llm(tiny, tmp_path, with_draft=False):
    """An LLM over the stand-in TensorRT engines (what LLM(backend='tensorrt') assembles)."""
    rt, model = runtime(tiny, draft=with_draft)
    tmp_path.mkdir(parents=True, exist_ok=True)
    write_tiny_tokenizer(tmp_path, model.config.vocab_size)
    spec = spec_for(tiny[1]) if with_draft else None
    llm = LLM.__new__(LLM)
    llm.options = rt.runtime_options(RuntimeOptions(max_input_len=48))
    llm.config, llm.target, llm.draft, llm.vision = model.config, rt.target, rt.draft, None
    llm.decoder, llm.speculative, llm.backend = rt.decoder(spec), spec, "tensorrt"
    llm.model_dir, llm.tokenizer, llm._ids = tmp_path, load_tokenizer(tmp_path), itertools.count()
    return llm


def recording(llm):
    batches, real = [], llm.decoder.step

    def step(states, *args):
        batches.append(len(states))
        return real(states, *args)

    llm.decoder.step = step
    return batches


def run_scheduler(llm, prompts, params, max_batch_size):
    """Final events of `prompts` submitted together to a Scheduler over `llm`, and the
    number of preemptions."""

    async def main():
        sched = Scheduler(llm, max_batch_size=max_batch_size)
        sched.start()
        try:
            tickets = [sched.submit(p, params) for p in prompts]
            ends = []
            for t in tickets:
                async for ev in t.events():
                    if ev.kind != "token":
                        ends.append(ev)
            return ends, sched.metrics.preemptions._value.get()
        finally:
            await asyncio.to_thread(sched.close)

    return asyncio.run(asyncio.wait_for(main(), 300))


def test_the_scheduler_admits_as_many_sequences_as_the_engines_pool_holds(tiny, tmp_path):
    llm = trt_llm(tiny, tmp_path)
    batches = recording(llm)
    params = SamplingParams(max_tokens=100, ignore_eos=True)  # 105 of the 128 rows each
    ends, _ = run_scheduler(llm, [[5, 9, 2, 33, 7]] * 2, params, max_batch_size=2)
    assert [e.kind for e in ends] == ["done", "done"], [e.message for e in ends]
    assert [e.completion_tokens for e in ends] == [100, 100]
    assert max(batches) == 2  # both sequences ran together, as the pool allows
    assert llm.target.allocator.free_pages == llm.target.allocator.num_pages


PROMPTS = [[5, 9, 2, 33, 7], [11, 4, 80, 3], [1, 2, 3, 4, 5, 6]]


@pytest.mark.parametrize("with_draft", [False, True], ids=["target-only", "dspark"])
def test_preempted_requests_on_tensorrt_engines_resume_and_equal_solo_runs(
    tiny,
    tmp_path,
    with_draft,
):
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    solo = []
    for p in PROMPTS:  # each alone on fresh engines
        alone = trt_llm(tiny, tmp_path / f"solo{len(solo)}", with_draft)
        st = alone.new_request(p, params)
        run_to_completion(alone.decoder, [st])
        solo.append(st.stopper.final_text())
    llm = trt_llm(tiny, tmp_path / "served", with_draft)
    batches = recording(llm)
    # 3 requests of ~105 rows on a pool of 2 x 128 rows: the third to arrive is preempted
    # (more rows than one engine call takes, so its recompute runs in pieces)
    ends, preemptions = run_scheduler(llm, PROMPTS, params, max_batch_size=3)
    assert [e.kind for e in ends] == ["done"] * 3, [e.message for e in ends]
    assert preemptions >= 1 and max(batches) == 3
    assert [e.final_text for e in ends] == solo
    assert llm.free_pages() == (
        llm.target.allocator.num_pages,
        llm.draft.allocator.num_pages if with_draft else 0,
    )


def spec_for(draft_dir, **extra):
    return SpeculativeConfig.parse(
        {"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": 4, **extra}
    )


def test_a_draft_top_k_the_engine_was_not_built_for_is_refused(tiny):
    rt, _ = runtime(tiny)
    _, draft_dir, _ = tiny
    assert rt.draft.top_k == 8
    with pytest.raises(ConfigError, match="draft_top_k 5 cannot be honoured.*built for 8"):
        rt.decoder(spec_for(draft_dir, draft_top_k=5))
    assert isinstance(rt.decoder(spec_for(draft_dir, draft_top_k=8)), DSparkDecoder)
    assert isinstance(rt.decoder(spec_for(draft_dir)), DSparkDecoder)  # default: the engine's


def test_a_draft_quantization_is_refused_by_the_engine_backends(tiny):
    """The engines' draft runs as built: the torch runtime's packing key is refused by name."""
    rt, _ = runtime(tiny)
    _, draft_dir, _ = tiny
    with pytest.raises(ConfigError, match="quantization 'int4' applies to the torch"):
        rt.decoder(spec_for(draft_dir, quantization="int4"))


def test_a_given_token_map_is_refused_by_the_engine_backends(tiny, tmp_path):
    """The draft engine computes the vocabulary it was built with: a token_map given in the
    speculative config is refused by name (one the draft directory ships is not asked for)."""
    rt, _ = runtime(tiny)
    _, draft_dir, _ = tiny
    path = tmp_path / "map.json"
    path.write_text("[1, 2, 3]")
    with pytest.raises(ConfigError, match="token_map .*map.json' applies to the torch"):
        rt.decoder(spec_for(draft_dir, token_map=str(path)))
    assert isinstance(rt.decoder(spec_for(draft_dir, token_map=None)), DSparkDecoder)
