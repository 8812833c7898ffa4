"""Streamed deltas never show a split UTF-8 character or a partial stop string, and always
concatenate to the non-streamed text (real SmolLM2 tokenizer, no model)."""

from __future__ import annotations

import pytest

from edgebuild.runtime.llm import load_tokenizer
from edgebuild.runtime.stopping import IncrementalDetokenizer, StopChecker
from edgebuild.serve.text import next_delta, stop_prefix_len

TEXTS = ["🎉 你好, café ✓ done", "日本語のテキスト and more", "plain ascii only"]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


def stream(tokenizer, ids, block, max_tokens=1000, stop=()):
    """Feed `ids` in blocks of `block` (like accepted speculative blocks); collect deltas."""
    stopper = StopChecker(max_tokens, frozenset(), tuple(stop), IncrementalDetokenizer(tokenizer))
    sent, deltas = "", []
    for i in range(0, len(ids), block):
        stopper.feed_many(ids[i : i + block])
        delta = next_delta(stopper, sent)
        sent += delta
        deltas.append(delta)
        if stopper.finish_reason:
            break
    return stopper, deltas


@pytest.mark.parametrize("block", [1, 2, 3, 8])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_hold_back_split_characters_and_concatenate_to_the_text(tokenizer, text, block):
    ids = tokenizer.encode(text, add_special_tokens=False)
    split = [tokenizer.decode(ids[:i]) for i in range(1, len(ids))]
    if text != TEXTS[-1]:
        assert any(s.endswith("\ufffd") for s in split), "the sample must split a character"
    stopper, deltas = stream(tokenizer, ids, block, max_tokens=len(ids))
    assert stopper.finish_reason == "length"
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == stopper.final_text() == text


@pytest.mark.parametrize("block", [1, 3, 7])
def test_a_stop_string_across_tokens_is_never_streamed(tokenizer, block):
    text = "alpha beta STOP gamma"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stopper, deltas = stream(tokenizer, ids, block, stop=("STOP",))
    assert stopper.finish_reason == "stop"
    assert "".join(deltas) == stopper.final_text() == "alpha beta "


def test_a_false_start_of_a_stop_string_is_released_later(tokenizer):
    ids = tokenizer.encode("a STAR is not a STOP", add_special_tokens=False)
    stopper, deltas = stream(tokenizer, ids, 1, stop=("STOP",))
    assert "".join(deltas) == stopper.final_text() == "a STAR is not a "


def test_stop_prefix_len_finds_the_longest_partial_stop():
    assert stop_prefix_len("hello wor", ("world",)) == 3
    assert stop_prefix_len("hello", ("world",)) == 0
    assert stop_prefix_len("x\n", ("\n\n", "xyz")) == 1
    assert stop_prefix_len("ab", ("abc", "b")) == 2
