"""A prompt row's bits do not depend on how the prompt is cut or batched (bf16, real SmolLM2).

Chunked prefill and the prefix cache hand a request rows computed in other calls than a cold,
one-pass prefill would use: chunks of the same prompt, a pass shared with other prompts, or
another request's prefill of the same prefix. Greedy outputs stay the same only if those rows
are bit-identical (docs/ARCHITECTURE.md, "The runtime": exactness). The oracle is the prompt run in one pass, alone.

Measured before the prefill attention path (ops/attention_fast.py): chunks of 32 or 64 rows
changed the K/V, taps and logits of a 600-token prompt (first at rows >= 256), a 1-row chunk
went through the decode kernel, and a <= 16-row prompt batched with a longer one took another
kernel than alone.
"""

from __future__ import annotations

import pytest
import torch

from edgebuild.runtime.llm import LLM, RuntimeOptions

TAPS = (1, 5, 9)


@pytest.fixture(scope="module")
def target(smollm2_dir):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(smollm2_dir, options=RuntimeOptions(dtype=torch.bfloat16, max_kv_rows=8192))
    yield llm
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prompts(target):
    long = " ".join(f"Sentence {i} is about cats and the moon." for i in range(60))
    return {
        "long": target.encode(long)[:600],
        "mid": target.encode("Tell me about Paris and its history, " * 20)[:150],
        "short": target.encode("Say hello.", chat=False),
    }


def kv_rows(tgt, seq) -> torch.Tensor:
    """[layers, rows, 2, Hkv, D] the sequence's cached K/V, gathered from its pages."""
    ps = tgt.allocator.page_size
    slots = torch.arange(seq.length)
    pages = torch.tensor(seq.pages)[slots // ps]
    return torch.stack([pool[pages, :, :, slots % ps] for pool in tgt.pools])


def run(tgt, ids, chunk=None, prefill=True):
    """(last-row logits, taps of every row, K/V) of `ids` prefilled `chunk` rows a call."""
    seq = tgt.new_sequence()
    chunk = chunk or len(ids)
    taps = []
    try:
        for i in range(0, len(ids), chunk):
            part = ids[i : i + chunk]
            out = tgt.forward([seq], [torch.tensor(part)], [[len(part) - 1]], TAPS, prefill=prefill)
            taps.append(out.taps[0])
        return out.logits[0], torch.cat(taps), kv_rows(tgt, seq)
    finally:
        tgt.free(seq)


@pytest.mark.parametrize("chunk", [1, 7, 32, 33, 64, 256])
def test_a_chunked_prefill_equals_one_pass_bit_for_bit(target, prompts, chunk):
    tgt = target.target
    ids = prompts["long"][:96] if chunk < 16 else prompts["long"]  # (1-row calls are slow)
    want = run(tgt, ids)
    got = run(tgt, ids, chunk)
    for name, w, g in zip(("logits", "taps", "kv"), want, got, strict=True):
        assert torch.equal(w, g), f"{name} differ with chunks of {chunk}"


def test_without_the_prefill_path_chunks_change_the_bits(target, prompts):
    """The control: the same comparison through the decode/plain path is not exact (so the
    test above can fail)."""
    tgt = target.target
    want = run(tgt, prompts["long"], prefill=False)
    got = run(tgt, prompts["long"], 64, prefill=False)
    assert not all(torch.equal(w, g) for w, g in zip(want, got, strict=True))


def test_a_prefill_batched_with_other_prompts_equals_it_alone(target, prompts):
    tgt = target.target
    names = ["mid", "long", "short"]
    alone = {n: run(tgt, prompts[n]) for n in names}
    seqs = [tgt.new_sequence() for _ in names]
    try:
        ids = [prompts[n] for n in names]
        out = tgt.forward(
            seqs, [torch.tensor(i) for i in ids], [[len(i) - 1] for i in ids], TAPS, prefill=True
        )
        for b, n in enumerate(names):
            logits, taps, kv = alone[n]
            assert torch.equal(out.logits[b][-1], logits[-1]), n
            assert torch.equal(out.taps[b], taps), n
            assert torch.equal(kv_rows(tgt, seqs[b]), kv), n
    finally:
        for s in seqs:
            tgt.free(s)


def test_a_prefill_continued_after_a_prefix_from_another_call_equals_one_pass(target, prompts):
    """A prefix-cache hit: the first 320 rows from one call (as part of a longer prompt
    cut at another place), the rest from a second call batched with another prompt."""
    tgt = target.target
    ids = prompts["long"]
    want = run(tgt, ids)
    seq, other = tgt.new_sequence(), tgt.new_sequence()
    try:
        first = tgt.forward([seq], [torch.tensor(ids[:320])], [[319]], TAPS, prefill=True)
        mid = prompts["mid"]
        rest = tgt.forward(
            [other, seq],
            [torch.tensor(mid), torch.tensor(ids[320:])],
            [[len(mid) - 1], [len(ids) - 321]],
            TAPS,
            prefill=True,
        )
        assert torch.equal(rest.logits[1][-1], want[0][-1])
        assert torch.equal(torch.cat([first.taps[0], rest.taps[1]]), want[1])
        assert torch.equal(kv_rows(tgt, seq), want[2])
    finally:
        tgt.free(seq)
        tgt.free(other)
