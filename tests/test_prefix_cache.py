"""Prefix caching: chained block hashes, refcounted read-only pages, LRU eviction, and greedy
outputs with cache hits equal to cold runs (chunked and batched prefill on, bf16).

Oracles: hashlib by hand (hashes); hand-built page schedules (refcounts, eviction order); the
same requests on a decoder with prefix caching and chunking off, one at a time (outputs).
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from dspark_fixtures import make_random_draft
from test_dspark_decoding import write_tiny_target

from edgebuild.checkpoint.source import WeightSource
from edgebuild.models.llama import LlamaForCausalLM
from edgebuild.runtime.decoding import (
    DSparkDecoder,
    RequestState,
    TargetOnlyDecoder,
    run_to_completion,
)
from edgebuild.runtime.dspark_loader import prepare_torch_draft as prepare_draft
from edgebuild.runtime.kv_cache import CacheCapacityError, PageAllocator, block_hashes
from edgebuild.runtime.llm import RuntimeOptions
from edgebuild.runtime.prefill import PrefillConfig
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.runtime.torch_backend import TorchTarget
from edgebuild.speculative.config import SpeculativeConfig

PS = 8  # page size of the tiny tests
COLD = PrefillConfig(enable_chunked_prefill=False, enable_prefix_caching=False)
WARM = PrefillConfig(prefill_chunk=16, max_num_batched_tokens=40)  # chunked, batched, cached


# ---------------------------------------------------------------------- the allocator
def test_block_hashes_chain_every_full_block_to_its_prefix():
    ids = list(range(20))
    hashes = block_hashes(ids, PS)
    assert len(hashes) == 2  # the partial third block has none
    h0 = hashlib.sha256(b"")
    h0.update(torch.tensor(ids[:8], dtype=torch.int64).numpy().tobytes())
    h1 = hashlib.sha256(h0.digest())
    h1.update(torch.tensor(ids[8:16], dtype=torch.int64).numpy().tobytes())
    assert hashes == [h0.digest(), h1.digest()]
    other = block_hashes([99] + ids[1:], PS)  # same second block, another first block
    assert other[0] != hashes[0] and other[1] != hashes[1]
    assert block_hashes(ids[:16] + [5, 5], PS) == hashes


def _filled(alloc, rows):
    seq = alloc.new_sequence()
    alloc.reserve(seq, rows)
    alloc.advance(seq, rows)
    return seq


def test_shared_pages_are_refcounted_and_stay_cached_after_their_last_user():
    alloc = PageAllocator(6, PS)
    a = _filled(alloc, 20)  # 3 pages, 2 full
    hashes = [b"h0", b"h1"]
    assert [alloc.register(a, i, h) for i, h in enumerate(hashes)] == [True, True]
    assert a.shared_rows == 16 and alloc.cached_pages == 2
    b = alloc.new_sequence()
    hit = alloc.match(hashes + [b"h2"])
    assert hit == a.pages[:2]
    alloc.attach(b, hit)
    assert b.length == b.shared_rows == 16
    assert [alloc.refcount(p) for p in hit] == [2, 2]
    alloc.free(a)
    assert [alloc.refcount(p) for p in hit] == [1, 1]
    assert alloc.free_pages == 6 - 2  # b holds the two shared pages
    alloc.free(b)
    assert alloc.free_pages == 6 and alloc.cached_pages == 2  # evictable, still cached
    assert alloc.match(hashes) == hit


def test_a_second_registration_of_a_cached_block_keeps_its_page_private():
    alloc = PageAllocator(4, PS)
    a, b = _filled(alloc, 8), _filled(alloc, 8)
    assert alloc.register(a, 0, b"h") and not alloc.register(b, 0, b"h")
    alloc.free(b)
    assert alloc.cached_pages == 1 and alloc.free_pages == 3


def test_eviction_takes_the_least_recently_released_cached_page_only_when_none_is_free():
    alloc = PageAllocator(4, PS)
    a, b = _filled(alloc, 16), _filled(alloc, 16)
    for s, tag in ((a, b"a"), (b, b"b")):
        alloc.register(s, 0, tag + b"0")
        alloc.register(s, 1, tag + b"1")
    pages_a, pages_b = list(a.pages), list(b.pages)
    alloc.free(a)  # released tail first: a1, a0
    alloc.free(b)  # then b1, b0
    assert alloc.free_pages == 4
    c = alloc.new_sequence()
    alloc.reserve(c, 8)
    alloc.advance(c, 8)
    assert c.pages == [pages_a[1]]  # the oldest release
    assert alloc.match([b"a0", b"a1"]) == [pages_a[0]]  # a1 is gone, a0 is still cached
    d = alloc.new_sequence()
    alloc.attach(d, alloc.match([b"a0"]))  # a0 in use again: no longer evictable
    alloc.reserve(c, 16)  # two more pages: b1 then b0 (a0 is held by d)
    alloc.advance(c, 16)
    assert c.pages == [pages_a[1], pages_b[1], pages_b[0]]
    assert alloc.match([b"b0"]) == [] and alloc.free_pages == 0
    with pytest.raises(CacheCapacityError):
        alloc.reserve(c, 8)


def test_a_shared_page_is_never_rolled_back_into_or_freed_by_a_reader():
    alloc = PageAllocator(6, PS)
    a = _filled(alloc, 16)
    alloc.register(a, 0, b"h0")
    alloc.register(a, 1, b"h1")
    b = alloc.new_sequence()
    alloc.attach(b, alloc.match([b"h0", b"h1"]))
    alloc.reserve(b, 5)  # new rows go to a new page, after the shared ones
    alloc.advance(b, 5)
    assert b.pages[:2] == a.pages[:2] and b.pages[2] not in a.pages
    alloc.rollback(b, 5)  # down to the shared rows: allowed
    with pytest.raises(RuntimeError, match="shared prefix"):
        alloc.rollback(b, 1)
    with pytest.raises(RuntimeError, match="shared prefix"):
        alloc.truncate(a, 10)
    with pytest.raises(RuntimeError, match="not empty"):
        alloc.attach(b, a.pages[:1])
    alloc.free(b)
    assert alloc.refcount(a.pages[0]) == 1  # a still holds it


# ---------------------------------------------------------------------- decoders (tiny, bf16)
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-bf16")
    target_dir = write_tiny_target(root / "target")
    draft_dir = make_random_draft(root / "draft", target_dir, block_size=5, target_layer_ids=[1, 2])
    return target_dir, draft_dir


def target_of(tiny, rows=4096):
    model = LlamaForCausalLM.from_source(WeightSource(tiny[0]), torch.bfloat16)
    return TorchTarget(model, max_kv_rows=rows, page_size=PS)


def dspark_of(tiny, prefill, rows=4096):
    spec = SpeculativeConfig.parse(
        {"method": "dspark", "model": str(tiny[1]), "num_speculative_tokens": 4}
    )
    opts = RuntimeOptions(max_kv_rows=rows, page_size=PS, dtype=torch.bfloat16)
    draft = prepare_draft(spec, WeightSource(tiny[0]))(opts)
    return DSparkDecoder(target_of(tiny, rows), draft, 4, prefill=prefill)


def record_context(decoder):
    """Keep every context row the draft is given, by draft sequence id."""
    seen: dict[int, list[torch.Tensor]] = {}
    update = decoder.draft.update_context

    def recording(seqs, features):
        for s, f in zip(seqs, features, strict=True):
            seen.setdefault(s.seq_id, []).append(f.clone())
        update(seqs, features)

    decoder.draft.update_context = recording
    return seen


def decode(decoder, prompts, max_tokens=12, together=True):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    states = [RequestState.create(f"r{i}", p, params) for i, p in enumerate(prompts)]
    if isinstance(decoder, DSparkDecoder):
        if not hasattr(decoder, "seen"):
            decoder.seen = record_context(decoder)
        seen = decoder.seen
        for st in states:  # [rows, n_t * d] all context rows the draft got for the request
            st.draft_context = lambda st=st: torch.cat(seen[st.draft_seq.seq_id])
    if together:
        run_to_completion(decoder, states)
    else:
        for st in states:
            run_to_completion(decoder, [st])
    return states


def chat_prompts(vocab=96, seed=5):
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(2, vocab, (37,), generator=g).tolist()
    turns = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (5, 11, 19, 3)]
    return [system + t for t in turns]


@pytest.mark.parametrize("kind", ["target", "dspark"])
def test_requests_sharing_a_prefix_equal_cold_runs_and_hit_the_cache(tiny, kind):
    prompts = chat_prompts()
    make = (lambda p: TargetOnlyDecoder(target_of(tiny), p)) if kind == "target" else None
    make = make or (lambda p: dspark_of(tiny, p))
    cold = decode(make(COLD), prompts, together=False)
    warm = make(WARM)
    first = decode(warm, prompts[:1])  # fills the cache with the system prompt's pages
    rest = decode(warm, prompts[1:])  # concurrently, each hitting 4 cached pages
    assert [s.output_ids for s in first + rest] == [s.output_ids for s in cold]
    if kind == "dspark":  # the draft got the cold run's context, bit for bit
        for w, g in zip(cold, first + rest, strict=True):
            assert torch.equal(g.draft_context(), w.draft_context())
    assert [s.metrics.cached_prompt_tokens for s in rest] == [32, 32, 32]
    assert warm.stats.prefix_hits == 96 and warm.stats.prefix_queries == sum(map(len, prompts))
    alloc = warm.target.allocator
    assert alloc.free_pages == alloc.num_pages  # everything released (cached pages evictable)
    if kind == "dspark":
        assert all(s.metrics.tau > 1.0 for s in rest)  # the draft had its full context


def test_a_multi_turn_second_turn_reuses_the_first_turns_prompt_pages(tiny):
    first = chat_prompts()[0] + [7] * 27  # 69 tokens: 8 full pages
    cold = TargetOnlyDecoder(target_of(tiny), COLD)
    warm = TargetOnlyDecoder(target_of(tiny), WARM)
    turn1 = decode(warm, [first])[0]
    second = first + turn1.output_ids + [9, 10, 11]
    turn2 = decode(warm, [second])[0]
    assert turn2.metrics.cached_prompt_tokens == 64  # the first turn's prompt pages only
    assert turn2.output_ids == decode(cold, [second])[0].output_ids


def test_a_hit_never_covers_the_whole_prompt(tiny):
    warm = TargetOnlyDecoder(target_of(tiny), WARM)
    prompt = chat_prompts()[0][:32]  # exactly 4 pages
    a = decode(warm, [prompt])[0]
    b = decode(warm, [prompt])[0]  # its last token is recomputed: 3 pages from the cache
    c = decode(warm, [prompt + [3]])[0]
    assert (a.metrics.cached_prompt_tokens, b.metrics.cached_prompt_tokens) == (0, 24)
    assert c.metrics.cached_prompt_tokens == 32
    assert a.output_ids == b.output_ids


def test_concurrent_readers_never_change_a_shared_page(tiny):
    warm = TargetOnlyDecoder(target_of(tiny), WARM)
    prompts = chat_prompts()
    decode(warm, prompts[:1])
    tgt = warm.target
    hit = tgt.allocator.match(block_hashes(prompts[0], PS)[:4])
    before = [pool[hit].clone() for pool in tgt.pools]
    decode(warm, prompts[1:] * 2, max_tokens=20)
    assert all(torch.equal(pool[hit], b) for pool, b in zip(tgt.pools, before, strict=True))


def test_eviction_under_pressure_keeps_outputs_exact(tiny):
    """A pool of 10 pages of 8 rows, requests one after the other, two system prompts in turn
    (A, B, A): B's requests evict A's cached pages; every output equals its cold run."""
    prompts = chat_prompts() + chat_prompts(seed=9) + chat_prompts()
    cold = TargetOnlyDecoder(target_of(tiny), COLD)
    want = [s.output_ids for s in decode(cold, prompts, max_tokens=10, together=False)]
    warm = TargetOnlyDecoder(target_of(tiny, rows=10 * PS), WARM)
    got = decode(warm, prompts, max_tokens=10, together=False)
    assert [s.output_ids for s in got] == want
    hits = [s.metrics.cached_prompt_tokens for s in got]
    assert hits == [0, 32, 32, 32] * 3  # A's pages were evicted while B ran, then recomputed
    alloc = warm.target.allocator
    assert alloc.free_pages == alloc.num_pages


@pytest.mark.parametrize("speculative", [False, True])
def test_a_preempted_request_resumes_from_the_cache_and_stays_exact(tmp_path, speculative):
    from serve_fixtures import write_tiny_chat_model

    from edgebuild.runtime.llm import LLM

    path = write_tiny_chat_model(tmp_path / "tiny")
    spec = None
    if speculative:
        draft = make_random_draft(tmp_path / "draft", path, block_size=5)
        spec = {
            "method": "dspark",
            "model": str(draft),
            "num_speculative_tokens": 4,
            "confidence_scheduling": False,
        }  # fixed lengths: cold and warm step alike
    llm = LLM(path, speculative=spec, options=RuntimeOptions(dtype=torch.bfloat16, page_size=8))
    cold = LLM(path, speculative=spec, options=RuntimeOptions(dtype=torch.bfloat16, page_size=8))
    cold.set_prefill(COLD)
    llm.set_prefill(WARM)
    system = list(range(10, 50))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = [cold.generate_ids([system + t], params)[0].output_ids for t in ([3, 4], [5, 6, 7])]
    first = llm.generate_ids([system + [3, 4]], params)[0]
    st = llm.new_request(system + [5, 6, 7], params)
    assert st.metrics.cached_prompt_tokens == 40
    llm.decoder.step([st])
    llm.decoder.step([st])
    llm.preempt(st)
    llm.resume(st)  # recomputed on the cached prompt pages
    while not st.finished:
        llm.decoder.step([st])
    llm.finish(st)
    assert [first.output_ids, st.output_ids] == want
    assert llm.decoder.stats.prefix_hits == 80
