"""`generation_config.json`: a checkpoint's default end-of-sequence ids and sampling settings.

Hugging Face semantics (``GenerationConfig.from_pretrained``): when the file exists, its
``eos_token_id`` (an int or a list) is the model's default stop set and replaces the one in
``config.json``; without the file (or without the key) ``config.json``'s ids are used. Chat
models often list more ids here than in ``config.json`` (Qwen2.5-VL, Qwen3 instruct:
``<|im_end|>`` and ``<|endoftext|>``). ``do_sample`` / ``temperature`` / ``top_p`` / ``top_k``
are the default sampling settings; with ``do_sample`` false (HF's default) decoding is greedy.
Other sampling knobs (``repetition_penalty`` ...) are not implemented by edgebuild's samplers;
they are listed in :attr:`GenerationDefaults.not_applied` and reported by ``inspect``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgebuild.checkpoint.config import text_config_view
from edgebuild.errors import CheckpointError

log = logging.getLogger("edgebuild.checkpoint")

GENERATION_CONFIG = "generation_config.json"
# Sampling knobs edgebuild's samplers do not implement, and their no-op values.
_NOT_IMPLEMENTED = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_p": None,
    "typical_p": 1.0,
    "num_beams": 1,
    "no_repeat_ngram_size": 0,
}
HF_TOP_K = 50  # GenerationConfig's default top_k when sampling


def _eos_list(value: Any, where: str, vocab: Any = None) -> tuple[int, ...] | None:
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise CheckpointError(
            f"{where}: 'eos_token_id' must be a token id or a list of token ids, got {value!r}"
        )
    if isinstance(vocab, int) and not isinstance(vocab, bool):
        outside = [i for i in items if i >= vocab]
        if outside:
            raise CheckpointError(
                f"{where}: 'eos_token_id' {outside} outside the vocabulary (config.json "
                f"vocab_size {vocab}): no token could ever stop generation there; fix the id"
            )
    return tuple(dict.fromkeys(items))


def _number(gen: dict, key: str, integer: bool, path: Path) -> Any:
    value = gen.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        want = "an integer" if integer else "a number"
        raise CheckpointError(f"{path}: '{key}' must be {want}, got {value!r}")
    return value


@dataclass(frozen=True)
class GenerationDefaults:
    """Default stop ids and sampling settings of a checkpoint (HF semantics).

    Attributes:
        eos_token_ids: ids that end generation by default.
        eos_source: the file they come from (generation_config.json or config.json), or "".
        do_sample: False = greedy by default.
        temperature, top_p, top_k: the sampling defaults when ``do_sample`` (None = not set).
        not_applied: sampling knobs set in the file that edgebuild does not implement.
    """

    eos_token_ids: tuple[int, ...] = ()
    eos_source: str = ""
    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    not_applied: tuple[str, ...] = ()

    def sampling(self) -> dict[str, float | int]:
        """``{temperature, top_p, top_k}`` a request gets when it sets none (HF semantics).

        Greedy (temperature 0) unless ``do_sample``; sampling takes the file's values, else
        HF's defaults (temperature 1, top_p 1, top_k 50).
        """
        if not self.do_sample:
            return {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
        return {
            "temperature": 1.0 if self.temperature is None else float(self.temperature),
            "top_p": 1.0 if self.top_p is None else float(self.top_p),
            "top_k": HF_TOP_K if self.top_k is None else int(self.top_k),
        }

    def describe(self) -> dict[str, str]:
        """Lines for ``edgebuild inspect``: which ids end generation, and the sampling defaults."""
        s = self.sampling()
        mode = (
            f"sample (temperature {s['temperature']}, top_p {s['top_p']}, top_k {s['top_k']})"
            if self.do_sample
            else "greedy"
        )
        out = {
            "eos_token_ids": f"{list(self.eos_token_ids)} ({self.eos_source or 'none found'})",
            "sampling_defaults": mode,
        }
        if self.not_applied:
            out["sampling_not_applied"] = ", ".join(self.not_applied) + " (not implemented)"
        return out


def read_generation_defaults(model_dir: Path, config: dict | None = None) -> GenerationDefaults:
    """The defaults of the checkpoint at ``model_dir`` (``config``: its config.json, if read).

    Raises:
        CheckpointError: an unreadable generation_config.json, or a mistyped field (naming
            the file and the field).
    """
    model_dir = Path(model_dir)
    if config is None:
        path = model_dir / "config.json"
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    text = text_config_view(config)
    vocab = text.get("vocab_size")
    cfg_eos = _eos_list(text.get("eos_token_id"), str(model_dir / "config.json"), vocab)
    path = model_dir / GENERATION_CONFIG
    if not path.is_file():
        return GenerationDefaults(cfg_eos or (), "config.json" if cfg_eos else "")
    try:
        gen = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read the generation config ({exc})") from None
    if not isinstance(gen, dict):
        raise CheckpointError(f"{path}: must be a JSON object, got {type(gen).__name__}")
    eos = _eos_list(gen.get("eos_token_id"), str(path), vocab)
    do_sample = gen.get("do_sample", False)
    if not isinstance(do_sample, bool):
        raise CheckpointError(f"{path}: 'do_sample' must be true or false, got {do_sample!r}")
    not_applied = tuple(
        f"{k}={gen[k]}" for k, noop in _NOT_IMPLEMENTED.items() if gen.get(k, noop) != noop
    )
    if not_applied and do_sample:
        log.warning("%s: %s not implemented; sampling without them", path, not_applied)
    return GenerationDefaults(
        eos_token_ids=eos if eos is not None else (cfg_eos or ()),
        eos_source=GENERATION_CONFIG if eos is not None else ("config.json" if cfg_eos else ""),
        do_sample=do_sample,
        temperature=_number(gen, "temperature", False, path),
        top_p=_number(gen, "top_p", False, path),
        top_k=_number(gen, "top_k", True, path),
        not_applied=not_applied,
    )


def tokenizer_eos(model_dir: Path) -> tuple[str, int | None] | None:
    """The tokenizer's ``eos_token`` (tokenizer_config.json) and its id in tokenizer.json.

    The runtime also stops on the tokenizer's EOS; this reads it from the files, for
    ``inspect`` (no tokenizer is loaded). None when tokenizer_config.json names no eos_token.
    """
    from edgebuild.checkpoint.pairing import tokenizer_tokens

    path = Path(model_dir) / "tokenizer_config.json"
    try:
        tok_cfg = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    eos = tok_cfg.get("eos_token") if isinstance(tok_cfg, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(eos, str):
        return None
    ids = {t: i for i, t in (tokenizer_tokens(model_dir) or {}).items()}
    return eos, ids.get(eos)
