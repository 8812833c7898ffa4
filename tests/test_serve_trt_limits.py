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
from export_fixtures import write_tiny_tokenizer
from test_trt_backend import standin_backends, tiny  # noqa: F401 (tiny: fixture)

from edgebuild.errors import ConfigError
from edgebuild.runtime.decoding import DSparkDecoder
from edgebuild.runtime.llm import LLM, RuntimeOptions, load_tokenizer
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.runtime.speculative import SpeculativeConfig
from edgebuild.runtime.trt_backend import TrtRuntime
from edgebuild.serve.scheduler import Scheduler


def runtime(tiny, draft=True):  # noqa: F811
    trt_target, trt_draft, _, _, _, _ = standin_backends(tiny)  # max batch 2, 128 rows/seq
    target_dir, _, model = tiny
    rt = TrtRuntime(
        trt_target,
        trt_draft if draft else None,
        model.config,
        SimpleNamespace(limits=trt_target.limits),
    )
    return rt, model


def test_the_pool_and_the_per_sequence_capacity_are_two_limits(tiny):  # noqa: F811
    rt, _ = runtime(tiny)
    opts = rt.runtime_options(RuntimeOptions())
    # build.max_kv_cache_capacity (128) is per sequence; the engines' pools hold 2 of them
    assert opts.max_seq_rows == opts.seq_capacity == 128
    assert opts.max_kv_rows == 2 * 128 == rt.target.allocator.num_pages * 8


def trt_llm(tiny, tmp_path):  # noqa: F811
    """An LLM over the stand-in TensorRT target (what LLM(backend='tensorrt') assembles)."""
    rt, model = runtime(tiny, draft=False)
    write_tiny_tokenizer(tmp_path, model.config.vocab_size)
    llm = LLM.__new__(LLM)
    llm.options = rt.runtime_options(RuntimeOptions(max_input_len=48))
    llm.config, llm.target, llm.draft, llm.vision = model.config, rt.target, None, None
    llm.decoder, llm.speculative, llm.backend = rt.decoder(None), None, "tensorrt"
    llm.model_dir, llm.tokenizer, llm._ids = tmp_path, load_tokenizer(tmp_path), itertools.count()
    return llm


def test_the_scheduler_admits_as_many_sequences_as_the_engines_pool_holds(tiny, tmp_path):  # noqa: F811
    llm = trt_llm(tiny, tmp_path)
    batches = []
    real = llm.decoder.step

    def step(states):
        batches.append(len(states))
        return real(states)

    llm.decoder.step = step
    params = SamplingParams(max_tokens=100, ignore_eos=True)  # 105 of the 128 rows each

    async def main():
        sched = Scheduler(llm, max_batch_size=2)
        sched.start()
        try:
            tickets = [sched.submit([5, 9, 2, 33, 7], params) for _ in range(2)]
            ends = []
            for t in tickets:
                async for ev in t.events():
                    if ev.kind != "token":
                        ends.append(ev)
            return ends
        finally:
            await asyncio.to_thread(sched.close)

    ends = asyncio.run(asyncio.wait_for(main(), 120))
    assert [e.kind for e in ends] == ["done", "done"], [e.message for e in ends]
    assert [e.completion_tokens for e in ends] == [100, 100]
    assert max(batches) == 2  # both sequences ran together, as the pool allows
    assert llm.target.allocator.free_pages == llm.target.allocator.num_pages


def spec_for(draft_dir, **extra):
    return SpeculativeConfig.parse(
        {"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": 4, **extra}
    )


def test_a_draft_top_k_the_engine_was_not_built_for_is_refused(tiny):  # noqa: F811
    rt, _ = runtime(tiny)
    _, draft_dir, _ = tiny
    assert rt.draft.top_k == 8
    with pytest.raises(ConfigError, match="draft_top_k 5 cannot be honoured.*built for 8"):
        rt.decoder(spec_for(draft_dir, draft_top_k=5))
    assert isinstance(rt.decoder(spec_for(draft_dir, draft_top_k=8)), DSparkDecoder)
    assert isinstance(rt.decoder(spec_for(draft_dir)), DSparkDecoder)  # default: the engine's
