"""`PairedSources`: a draft checkpoint plus its target, opened as a second weight source.

Published DSpark / DFlash drafts (SpecForge, RadixArk) ship no `lm_head` and no
`embed_tokens`: both are the target's (spec/draft-checkpoint-formats.md sections 1.1, 5, 6.9).
Whether the draft "has its own head" is decided by the tensors present, never by comparing
vocab sizes. A target with tied embeddings gives `model.embed_tokens.weight` as its head. An
NVFP4 target head stays a :class:`QuantizedWeight` (never reinterpreted as a dense weight).
Every resolved tensor records which checkpoint it came from.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from edgebuild.checkpoint.config import text_config_view
from edgebuild.checkpoint.quant import QuantizedWeight
from edgebuild.checkpoint.source import COMPONENT, TARGET, WeightSource
from edgebuild.errors import PairingError

log = logging.getLogger("edgebuild.checkpoint")

# Where each family keeps its embedding / head (first match wins).
EMBED_NAMES = (
    "embed_tokens.weight",
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
)
HEAD_NAMES = ("lm_head.weight", "model.lm_head.weight")


@dataclass(frozen=True)
class Resolved:
    """A tensor resolved for a draft: its value, name, origin and file.

    `value` is a dense tensor or a QuantizedWeight (NVFP4/FP8, scales included).
    `checkpoint_source` is "component" (the draft's own) or "target".
    """

    value: torch.Tensor | QuantizedWeight
    name: str
    checkpoint_source: str
    file: str

    @property
    def shape(self) -> tuple[int, ...]:
        v = self.value
        return tuple(v.shape)

    @property
    def format(self) -> str:
        v = self.value
        return v.format.value if isinstance(v, QuantizedWeight) else str(v.dtype).split(".")[-1]


def _first(source: WeightSource, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in source), None)


def _resolve(source: WeightSource, name: str) -> Resolved:
    prefix = name.rpartition(".")[0]
    value = source.linear(prefix) if prefix else source.get(name)
    return Resolved(value, name, source.checkpoint_source, str(source.info(name).file))


def target_vocab_limit(target_dir: Path) -> int | None:
    """Number of real tokens of the target tokenizer (max id + 1), or None if unknown."""
    path = Path(target_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        tok = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(tok, dict):
        return None
    vocab = (tok.get("model") or {}).get("vocab") or {}
    # BPE / WordPiece: {token: id}; Unigram (SentencePiece): [[piece, score], ...] in id order
    ids = [i for i in vocab.values() if isinstance(i, int)] if isinstance(vocab, dict) else []
    if isinstance(vocab, list):
        ids.append(len(vocab) - 1)
    ids += [t.get("id") for t in tok.get("added_tokens") or [] if isinstance(t, dict)]
    ids = [i for i in ids if isinstance(i, int)]
    return max(ids) + 1 if ids else None


class PairedSources:
    """A draft and its target; resolves the draft's `lm_head` and `embed_tokens`.

    Args:
        draft: the draft checkpoint (opened as "component").
        target: the paired target checkpoint (opened as "target").

    Raises:
        PairingError: (in :meth:`validate`) hidden size or vocab mismatch, or no head
            anywhere; messages name both config files.
    """

    def __init__(self, draft: WeightSource | str | Path, target: WeightSource | str | Path):
        self.draft = draft if isinstance(draft, WeightSource) else WeightSource(draft, COMPONENT)
        self.target = target if isinstance(target, WeightSource) else WeightSource(target, TARGET)
        if self.target.checkpoint_source != TARGET:
            self.target = WeightSource(self.target.path, TARGET)

    def draft_has_own_head(self) -> bool:
        """True when the draft checkpoint itself holds an lm_head tensor."""
        return _first(self.draft, HEAD_NAMES) is not None

    def lm_head(self) -> Resolved:
        """The draft's output head [V, d]: its own, else the target's (tied: target embedding).

        Raises:
            PairingError: the target has neither `lm_head.weight` nor a tied embedding.
        """
        own = _first(self.draft, HEAD_NAMES)
        if own is not None:
            return _resolve(self.draft, own)
        head = _first(self.target, HEAD_NAMES)
        if head is not None:
            return _resolve(self.target, head)
        embed = _first(self.target, EMBED_NAMES)
        tied = bool(self.target.config.get("tie_word_embeddings", False))
        if embed is not None and tied:
            return _resolve(self.target, embed)
        raise PairingError(
            f"the draft {self.draft.path} has no lm_head, and the target {self.target.path} "
            f"has no 'lm_head.weight'{' nor a tied embedding' if not tied else ''} "
            f"(tie_word_embeddings: {tied} in {self.target.config_path}); the draft cannot "
            "produce logits — pair it with its own target checkpoint"
        )

    def embed_tokens(self) -> Resolved:
        """The draft's input embedding [V, d]: its own, else the target's."""
        own = _first(self.draft, EMBED_NAMES)
        if own is not None:
            return _resolve(self.draft, own)
        embed = _first(self.target, EMBED_NAMES)
        if embed is None:
            raise PairingError(
                f"neither the draft {self.draft.path} nor the target {self.target.path} has "
                f"an embedding (looked for {', '.join(EMBED_NAMES)})"
            )
        return _resolve(self.target, embed)

    def validate(self) -> None:
        """Check that the draft fits the target before any expensive work.

        Hidden sizes must be equal; vocab sizes must be equal unless the difference is only
        padding (both >= the target tokenizer's real vocabulary).

        Raises:
            PairingError: naming both config files and the fix.
        """
        dc, tc = self.draft.config, text_config_view(self.target.config)  # VLM: text_config
        dpath, tpath = self.draft.config_path, self.target.config_path
        d_hidden, t_hidden = dc.get("hidden_size"), tc.get("hidden_size")
        if d_hidden != t_hidden:
            raise PairingError(
                f"draft hidden_size {d_hidden} ({dpath}) != target hidden_size {t_hidden} "
                f"({tpath}); this draft was trained for another target"
            )
        d_vocab, t_vocab = dc.get("vocab_size"), tc.get("vocab_size")
        if d_vocab != t_vocab:
            real = target_vocab_limit(self.target.path)
            sizes_known = isinstance(d_vocab, int) and isinstance(t_vocab, int)
            if real is None or not sizes_known or min(d_vocab, t_vocab) < real:
                raise PairingError(
                    f"draft vocab_size {d_vocab} ({dpath}) != target vocab_size {t_vocab} "
                    f"({tpath}) and the difference is not padding (target tokenizer has "
                    f"{real if real is not None else 'an unknown number of'} tokens); "
                    "the draft must use the target's tokenizer"
                )
            log.info(
                "draft vocab %s vs target vocab %s: padding only (tokenizer has %s tokens)",
                d_vocab,
                t_vocab,
                real,
            )
        self.lm_head()  # raises PairingError when no head can be found

    def provenance(self) -> dict[str, str]:
        """{role: "component" | "target"} for the draft's borrowed tensors (for inspect)."""
        return {
            "lm_head": self.lm_head().checkpoint_source,
            "embed_tokens": self.embed_tokens().checkpoint_source,
        }
