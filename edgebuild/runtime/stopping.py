"""Stop conditions applied token by token, so that a stop inside an accepted block is exact.

A speculative step can commit several tokens at once; they are fed here one at a time and
nothing after the first stop is emitted or counted. EOS and stop token ids are kept in the
token output (and counted) but their text is not shown; a stop string ends generation at the
token that completes it and is cut from the text (OpenAI semantics). A stop inside the budget
wins over the length cap.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, holding back incomplete UTF-8.

    Byte-level BPE tokens can split one multi-byte character; decoding the whole id list and
    keeping back a trailing U+FFFD until more tokens arrive guarantees streamed deltas never
    contain a replacement character that the final text does not.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = 0  # characters of text already handed out

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)

    def add(self, token_id: int) -> None:
        self.ids.append(token_id)

    def stable_text(self) -> str:
        """Decoded text without a trailing incomplete character."""
        text = self.text()
        return text[:-1] if text.endswith("\ufffd") else text


@dataclass
class StopChecker:
    """Feeds committed tokens and reports where generation ends.

    Attributes:
        max_tokens: the budget.
        stop_token_ids: EOS ids (unless ignore_eos) + the request's stop_token_ids.
        stop: stop strings; needs `detok` to see text.
        min_tokens: no stop (id or string) ends generation before this many tokens.
    """

    max_tokens: int
    stop_token_ids: frozenset[int]
    stop: tuple[str, ...] = ()
    detok: IncrementalDetokenizer | None = None
    min_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_text_end: int | None = None  # text length to keep when a stop string matched
    matched_stop: str | int | None = None

    def feed(self, token_id: int) -> bool:
        """Append one committed token; return True when generation is finished."""
        if self.finish_reason is not None:
            raise RuntimeError("feed after finish")
        self.output_ids.append(token_id)
        if self.detok is not None:
            self.detok.add(token_id)
        if len(self.output_ids) < self.min_tokens:
            pass  # min_tokens: the stop ids are masked; stop strings do not count yet
        elif token_id in self.stop_token_ids:
            self.finish_reason, self.matched_stop = "stop", token_id
        elif self.stop and self.detok is not None:
            text = self.detok.text()
            window = max(len(s) for s in self.stop) + 16
            best = None
            for s in self.stop:
                i = text.find(s, max(0, len(text) - window - len(s)))
                if i >= 0 and (best is None or i < best[0]):
                    best = (i, s)
            if best is not None:
                self.finish_reason, self.matched_stop = "stop", best[1]
                self.stop_text_end = best[0]
        if self.finish_reason is None and len(self.output_ids) >= self.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def feed_many(self, tokens: list[int]) -> list[int]:
        """Feed tokens in order until finished; returns the ones actually committed."""
        taken = []
        for t in tokens:
            taken.append(t)
            if self.feed(t):
                break
        return taken

    def final_text(self) -> str:
        """The output text with special tokens skipped and a matched stop string cut."""
        if self.detok is None:
            return ""
        text = self.detok.text()
        return text[: self.stop_text_end] if self.stop_text_end is not None else text
