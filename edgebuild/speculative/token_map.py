"""A draft vocabulary cut to frequent tokens (FR-Spec's hot-token list, SGLang's token map).

A DSpark draft borrows the target's ``lm_head``: every proposal computes ``V`` logits per
drafted row (SmolLM2: 49,152 x 576; Llama-3 / Qwen3: 128k-152k rows), then keeps the top-k.
FR-Spec (Zhao et al., 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via
Frequency-Ranked Speculative Sampling") restricts the draft's head to the most frequent
tokens of a corpus; SGLang takes such a list as ``--speculative-token-map`` (a ``.pt`` file of
token ids). Verification is unchanged and exact: the draft's q is zero outside the map (as it
already is outside the walk's top-k candidates, spec draft-checkpoint-formats.md section 3),
so a token outside the map is never drafted, only committed by the target's bonus or resample.
Only the draft's cost and acceptance change.

File formats read by :func:`read_token_map`: a JSON list of token ids (what
:func:`write_token_map` and ``tools/train_dspark/token_map.py`` write), or a ``.pt`` / ``.pth``
holding a 1-D integer tensor or list (FR-Spec's / SGLang's files), loaded with
``torch.load(weights_only=True)``. As SGLang's flag, the config also takes a file of a Hub
repository, ``org/name/path/file.pt``, from the Hub cache (``HF_HUB_OFFLINE`` honoured). The ids are returned sorted ascending, so that ties of the
walk's top-k still resolve to the lower token id, as over the whole vocabulary.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from edgebuild.errors import ConfigError

TOKEN_MAP_FILE = "token_map.json"
"""The file a draft directory may ship; used by default when present (``"token_map"``
in ``--speculative-config`` overrides it, ``null`` turns it off)."""


def read_token_map(path: Path, vocab_size: int) -> torch.Tensor:
    """The token ids of a token-map file: int64 ``[V']``, unique, sorted ascending.

    Args:
        path: a ``.json`` list of ints, or a ``.pt`` 1-D integer tensor / list of ints.
        vocab_size: the draft's vocabulary ``V``; every id must be in ``[0, V)``.

    Raises:
        ConfigError: an unreadable file, another structure or dtype, an empty list, an id
            outside ``[0, V)`` or a repeated id (names the file and the fix).
    """
    path = Path(path)
    fix = "write it with tools/train_dspark/token_map.py, or pass token_map null"
    try:
        if path.suffix in (".pt", ".pth"):
            raw = torch.load(path, map_location="cpu", weights_only=True)
        else:
            raw = json.loads(path.read_text(encoding="utf-8"))
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise ConfigError(f"{path}: cannot read the token map ({exc}); {fix}") from None
    ids = None
    if isinstance(raw, torch.Tensor):
        integer = not (raw.is_floating_point() or raw.is_complex() or raw.dtype == torch.bool)
        ids = raw.long() if raw.dim() == 1 and integer else None
    elif isinstance(raw, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
        if all(-(2**63) <= i < 2**63 for i in raw):
            ids = torch.tensor(raw, dtype=torch.long)
        else:
            big = next(i for i in raw if not -(2**63) <= i < 2**63)
            raise ConfigError(
                f"{path}: token id {big} is outside the draft's vocabulary [0, {vocab_size}); {fix}"
            )
    if ids is None or ids.numel() == 0:
        raise ConfigError(
            f"{path}: a token map must be a non-empty 1-D list of integer token ids (a JSON "
            f"list, or a .pt integer tensor); {fix}"
        )
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        raise ConfigError(
            f"{path}: token id {int(ids[bad][0])} is outside the draft's vocabulary "
            f"[0, {vocab_size}); was the map made for another tokenizer? {fix}"
        )
    ids = ids.sort().values
    dup = ids[1:] == ids[:-1]
    if bool(dup.any()):
        raise ConfigError(f"{path}: token id {int(ids[1:][dup][0])} is listed twice; {fix}")
    return ids


def rank_tokens(counts: torch.Tensor, size: int, always: list[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent token ids, sorted ascending (FR-Spec's selection).

    Args:
        counts: int ``[V]``, occurrences of each token id in a corpus.
        size: tokens to keep, ``1..V``.
        always: ids kept whatever their count (e.g. the end-of-sequence tokens); they count
            towards ``size``.

    Ties of count are broken towards the lower id. Returns int64 ``[size]``.

    Raises:
        ValueError: ``size`` outside ``1..V`` or more ``always`` ids than ``size``.
    """
    vocab = counts.shape[0]
    always = sorted(set(int(i) for i in always))
    if not 1 <= size <= vocab or len(always) > size:
        raise ValueError(f"token map size {size} must be in 1..{vocab} and >= len(always)")
    score = counts.double().clone()
    score[always] = float("inf")
    # stable sort of -score: equal counts keep ascending id order
    order = torch.sort(-score, stable=True).indices
    return order[:size].sort().values.long()


def write_token_map(path: Path, ids: torch.Tensor) -> None:
    """Write ``ids`` (int ``[V']``) as a JSON list, atomically (a temporary file beside it,
    renamed over it, as the engine cache writes its files).

    Raises:
        OSError: the folder cannot be created or written (the temporary file is removed).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps([int(i) for i in ids.tolist()], separators=(",", ":")) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
