"""`PairedSources`: a draft checkpoint plus its target, opened as a second weight source.

Published DSpark / DFlash drafts (SpecForge, RadixArk) ship no `lm_head` and no
`embed_tokens`: both are the target's (spec/draft-checkpoint-formats.md sections 1.1, 5, 6.9).
Whether the draft "has its own head" is decided by the tensors present, never by comparing
vocab sizes. A target with tied embeddings gives `model.embed_tokens.weight` as its head. An
NVFP4 target head stays a :class:`QuantizedWeight` (never reinterpreted as a dense weight).
Every resolved tensor records which checkpoint it came from. :meth:`PairedSources.validate`
refuses a draft whose hidden size or vocab size differs from the target's (padding included:
verification compares the two distributions over one vocabulary) or whose own tokenizer
differs from the target's at some id.
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


def tokenizer_file(model_dir: Path) -> Path | None:
    """The file that holds a checkpoint's vocabulary: ``tokenizer.json``, else ``vocab.json``."""
    for name in ("tokenizer.json", "vocab.json"):
        if (Path(model_dir) / name).is_file():
            return Path(model_dir) / name
    return None


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def tokenizer_tokens(model_dir: Path) -> dict[int, str] | None:
    """{id: token} of a checkpoint's tokenizer (vocab + added tokens), or None.

    From ``tokenizer.json``: BPE / WordPiece / WordLevel vocabularies are ``{token: id}``,
    Unigram (SentencePiece) is ``[[piece, score], ...]`` in id order, plus ``added_tokens``.
    Else from ``vocab.json`` (``{token: id}``) plus ``tokenizer_config.json``'s
    ``added_tokens_decoder``. None when neither file is there or readable.
    """
    path = tokenizer_file(model_dir)
    tok = _read_json(path) if path is not None else None
    if not isinstance(tok, dict):
        return None
    out: dict[int, str] = {}
    if path.name == "vocab.json":
        out.update({i: t for t, i in tok.items() if isinstance(i, int)})
        cfg = _read_json(Path(model_dir) / "tokenizer_config.json")
        added = cfg.get("added_tokens_decoder") if isinstance(cfg, dict) else None
        for i, t in (added or {}).items():
            if str(i).isdigit() and isinstance(t, dict):
                out[int(i)] = str(t.get("content"))
        return out
    vocab = (tok.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, dict):
        out.update({i: t for t, i in vocab.items() if isinstance(i, int)})
    elif isinstance(vocab, list):
        out.update({i: p[0] for i, p in enumerate(vocab) if isinstance(p, list) and p})
    for t in tok.get("added_tokens") or []:
        if isinstance(t, dict) and isinstance(t.get("id"), int):
            out[t["id"]] = str(t.get("content"))
    return out


def target_vocab_limit(target_dir: Path) -> int | None:
    """Number of real tokens of the target tokenizer (max id + 1), or None if unknown."""
    tokens = tokenizer_tokens(target_dir)
    return max(tokens) + 1 if tokens else None


def _check_tokenizers(draft_dir: Path, target_dir: Path) -> None:
    """A draft folder's own tokenizer must equal the target's, except for padding.

    Every id in both tokenizers must be the same token; an id only one of them has must lie
    beyond the other's last id (tokens appended in the padding rows of the embedding).

    Raises:
        PairingError: naming both tokenizer files, the first differing id and both tokens.
    """
    dpath, tpath = tokenizer_file(draft_dir), tokenizer_file(target_dir)
    if dpath is None:
        return  # the draft uses the target's tokenizer (published drafts ship none)
    draft_tokens, target_tokens = tokenizer_tokens(draft_dir), tokenizer_tokens(target_dir)
    if draft_tokens is None or target_tokens is None:
        unreadable = dpath if draft_tokens is None else (tpath or Path(target_dir))
        log.warning("%s: cannot compare the draft's tokenizer with the target's", unreadable)
        return
    d_end, t_end = max(draft_tokens, default=-1), max(target_tokens, default=-1)
    for i in sorted(set(draft_tokens) | set(target_tokens)):
        d, t = draft_tokens.get(i), target_tokens.get(i)
        if d == t or (d is None and i > d_end) or (t is None and i > t_end):
            continue
        raise PairingError(
            f"the draft's tokenizer {dpath} differs from the target's {tpath} at id {i}: "
            f"{d!r} vs {t!r}; the draft was trained with another tokenizer. Pair it with its "
            "own target, or remove the draft's tokenizer files if they are a stale copy"
        )


class PairedSources:
    """A draft and its target; resolves the draft's `lm_head` and `embed_tokens`.

    Args:
        draft: the draft checkpoint (opened as "component").
        target: the paired target checkpoint (opened as "target").

    Raises:
        PairingError: (in :meth:`validate`) hidden size, vocab or tokenizer mismatch, or no
            head anywhere; messages name both files.
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

        Hidden sizes and vocab sizes must be equal (a vocabulary padded differently is refused
        too: the verify step compares the draft's and the target's distributions row by row,
        spec section 6.4); a tokenizer in the draft folder must equal the target's except for
        padding (:func:`_check_tokenizers`); a head must exist.

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
            padding = real is not None and sizes_known and min(d_vocab, t_vocab) >= real
            why = (
                f"the difference is only padding (the target tokenizer has {real} tokens), but "
                "draft tokens are verified against the target's logits over the whole "
                f"vocabulary; pad or cut the draft's vocabulary-sized tensors to {t_vocab} rows "
                f"and set vocab_size {t_vocab}"
                if padding
                else "the difference is not padding (target tokenizer has "
                f"{real if real is not None else 'an unknown number of'} tokens); the draft "
                "must use the target's tokenizer"
            )
            raise PairingError(
                f"draft vocab_size {d_vocab} ({dpath}) != target vocab_size {t_vocab} "
                f"({tpath}): {why}"
            )
        _check_tokenizers(self.draft.path, self.target.path)
        self.lm_head()  # raises PairingError when no head can be found

    def provenance(self) -> dict[str, str]:
        """{role: "component" | "target"} for the draft's borrowed tensors (for inspect)."""
        return {
            "lm_head": self.lm_head().checkpoint_source,
            "embed_tokens": self.embed_tokens().checkpoint_source,
        }
