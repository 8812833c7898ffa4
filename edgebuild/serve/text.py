"""What part of a request's output text is safe to stream now.

Two things are held back until more tokens arrive: an incomplete UTF-8 character at the end
(a multi-byte character split across tokens, or across a speculative block, decodes to
U+FFFD until its last byte comes), and a tail that could be the start of a stop string (it is
cut from the final text if the stop completes). With both held back, every streamed delta
extends the previous ones, and their concatenation is exactly the non-streamed text.
"""

from __future__ import annotations

import logging

from edgebuild.runtime.stopping import StopChecker

log = logging.getLogger("edgebuild.serve")

REPLACEMENT = "\ufffd"


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def stable_text(stopper: StopChecker) -> str:
    """The text that can no longer change: final text when finished, else the held-back text."""
    if stopper.finish_reason is not None:
        return stopper.final_text()
    if stopper.detok is None:
        return ""
    text = stopper.detok.stable_text().rstrip(REPLACEMENT)
    return text[: len(text) - stop_prefix_len(text, stopper.stop)]


def next_delta(stopper: StopChecker, sent: str) -> str:
    """The text to stream after `sent` (the concatenation of the deltas so far)."""
    text = stable_text(stopper)
    if not text.startswith(sent):
        # decoding is prefix-stable for byte-level BPE; never re-send or contradict text
        log.warning("output text changed behind the stream; holding it back")
        return ""
    return text[len(sent) :]
