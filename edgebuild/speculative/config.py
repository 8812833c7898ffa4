"""The speculative-decoding config (`--speculative-config` JSON), shared by CLI and server.

Keys follow vLLM and TensorRT-Edge-LLM: `method`, `model`, `num_speculative_tokens`, plus
`draft_top_k` (top-k base candidates of the Markov walk; 0 = full vocabulary, or the whole
token map) and
`confidence_threshold` (static cutoff; 0 = off), `confidence_scheduling` (verification
lengths from measured step costs, :mod:`edgebuild.runtime.spec_schedule`; default true,
false = fixed lengths) and `token_map` (the draft's vocabulary cut to a file's token ids,
:mod:`edgebuild.speculative.token_map`; default: the draft's own ``token_map.json`` when it
ships one). The methods are the registry's
(:mod:`edgebuild.speculative.registry`, one declarative record per method).

When `draft_top_k` is not given, the draft's own recommendation is used: vLLM's hf_config key
`markov_topk` in the draft's `config.json` (top level, `dspark_config` or `dflash_config`; spec
draft-checkpoint-formats.md section 3, "Top-k pruning"), else 16 (the ORT / vLLM default).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from edgebuild.checkpoint.dspark_config import read_dspark_field  # the one draft-config reader
from edgebuild.checkpoint.hub import (
    ModelSource,
    hub_cache_dir,
    hub_offline,
    is_hub_id,
    resolve_model_ref,
)
from edgebuild.errors import ConfigError
from edgebuild.speculative.registry import METHODS, PLANNED_METHODS, get_method
from edgebuild.speculative.token_map import TOKEN_MAP_FILE

__all__ = [
    "DEFAULT_DRAFT_TOP_K",
    "PLANNED_METHODS",
    "SUPPORTED_METHODS",
    "SpeculativeConfig",
    "default_draft_top_k",
    "read_draft_config",
]

# method -> description, derived from the registry (one record per method)
SUPPORTED_METHODS: dict[str, str] = {m.name: m.description for m in METHODS.values()}
_KEYS = {
    "method",
    "model",
    "revision",
    "num_speculative_tokens",
    "draft_top_k",
    "confidence_threshold",
    "confidence_scheduling",
    "quantization",
    "token_map",
}
DEFAULT_DRAFT_TOP_K = 16
DRAFT_QUANTIZATIONS = ("int4", "int8", "none")  # the torch runtime's weight packing of the draft


def read_draft_config(draft_dir: Path) -> dict:
    """The draft's ``config.json`` as a dict (read for the defaults of the speculative keys).

    Raises:
        ConfigError: an unreadable file or one that is not a JSON object (names the file).
    """
    path = Path(draft_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the draft config ({exc})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: the draft config must be a JSON object")
    return cfg


def default_draft_top_k(draft_dir: Path, cfg: dict | None = None) -> int:
    """The draft's recommended Markov-walk candidate count (``markov_topk``), else 16.

    Reads ``markov_topk`` (vLLM's hf_config spelling) from ``config.json`` of ``draft_dir``
    (or from ``cfg``, that file already read by :func:`read_draft_config`) where
    :class:`~edgebuild.checkpoint.dspark_config.DSparkConfig` reads every DSpark field: the
    top level, ``dspark_config`` or ``dflash_config``; 0 means the full vocabulary.

    Raises:
        ConfigError: an unreadable config.json, a ``markov_topk`` that is not an integer
            >= 0, or two locations that disagree (names the file, the field and the fix).
    """
    path = Path(draft_dir) / "config.json"
    if cfg is None:
        cfg = read_draft_config(draft_dir)
    value, where = read_dspark_field(cfg, "markov_topk", int, str(path), DEFAULT_DRAFT_TOP_K)
    if value < 0:
        raise ConfigError(
            f"{path}: field '{where}' is {value!r}; use an integer >= 0 (0 = full "
            "vocabulary) or remove it (default 16)"
        )
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated speculative config.

    Attributes:
        method: one of SUPPORTED_METHODS.
        model: draft checkpoint directory (a Hub id in the JSON, ``"model": "org/name"`` with
            an optional ``"revision"`` or ``org/name@rev``, is resolved to its snapshot folder
            in the Hub cache: :mod:`edgebuild.checkpoint.hub`).
        num_speculative_tokens: drafts per step, 1..block_size (checked against the draft).
        draft_top_k: candidates per position for the Markov walk (0 = full vocab); default:
            the draft's ``markov_topk`` (:func:`default_draft_top_k`), else 16.
        confidence_threshold: static confidence cutoff in [0, 1) (0 = off).
        confidence_scheduling: load-aware confidence scheduling (DSpark Algorithm 1,
            :mod:`edgebuild.runtime.spec_schedule`): per step and request, verify only the
            drafts that pay for themselves under the current load and this backend's
            measured step costs (at batch 1 too: no draft at all when drafting loses); a
            seeded sampled request (or one asking for logprobs) is scheduled alone on the
            backend's reference costs, so its output is reproducible. The static cutoff,
            when set, still bounds each proposal first. Default true; false forces fixed
            lengths (every step verifies n).
        draft_top_k_given: `draft_top_k` was set by the user (not defaulted): a backend
            that cannot honour it must refuse it.
        quantization: how the torch (CPU) runtime packs the draft's linears and its borrowed
            ``lm_head``, apart from the target's ``--quant``: ``"int4"``, ``"int8"`` or
            ``"none"`` (vLLM's speculative ``quantization`` key; here a packing at load, as
            ``--quant``). None (not given): int4 on an fp32 runtime whose int4 kernels run,
            else the target's ``--quant`` (:func:`edgebuild.runtime.dspark_loader.draft_quant`).
            The output never depends on it (every token is the target's); only the draft's
            cost and acceptance do. Engine backends refuse it (their draft runs as built).
        token_map: a file of token ids (FR-Spec's / SGLang's ``--speculative-token-map``
            hot-token list: a JSON list, or a ``.pt`` 1-D integer tensor; a local path or a
            Hub repository's file ``org/name/file.pt``) to which the torch
            runtime cuts the draft's vocabulary: its ``lm_head`` computes those rows only and
            drafts only those tokens (:mod:`edgebuild.speculative.token_map`). Default: the
            draft directory's ``token_map.json`` when it has one; JSON ``null`` turns it off.
            The output never depends on it (q is zero outside the map, so verification stays
            exact); a token outside it is never drafted, only the target's bonus / resample.
        token_map_given: `token_map` was set by the user (not defaulted): engine backends,
            whose draft computes the vocabulary it was built with, refuse it.
    """

    method: str
    model: Path
    num_speculative_tokens: int
    draft_top_k: int = DEFAULT_DRAFT_TOP_K
    confidence_threshold: float = 0.0
    draft_top_k_given: bool = field(default=False, compare=False)
    confidence_scheduling: bool = True
    source: ModelSource | None = field(default=None, compare=False)  # the resolved reference
    quantization: str | None = None
    token_map: Path | None = None
    token_map_given: bool = field(default=False, compare=False)

    @classmethod
    def parse(cls, value: str | dict) -> SpeculativeConfig:
        """Parse the JSON text or dict.

        Raises:
            ConfigError: invalid JSON, unknown key or method (lists the supported), a
                missing draft directory, or an out-of-range number.
            CheckpointError: a draft Hub id that cannot be resolved (names the fix).
        """
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--speculative-config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ConfigError("--speculative-config must be a JSON object")
        unknown = set(value) - _KEYS
        if unknown:
            raise ConfigError(
                f"--speculative-config: unknown keys {sorted(unknown)}; allowed: {sorted(_KEYS)}"
            )
        method = get_method(value.get("method")).name  # the registry's record
        if "model" not in value or not isinstance(value["model"], str):
            raise ConfigError(
                "--speculative-config: 'model' (the draft checkpoint path or Hub id) is required"
            )
        revision = value.get("revision")
        if revision is not None and not isinstance(revision, str):
            raise ConfigError(
                f"--speculative-config: revision must be a string (branch, tag or commit), got "
                f"{revision!r}"
            )
        source = resolve_model_ref(value["model"], revision, what="draft model")
        model = source.path
        if not (model / "config.json").is_file():
            raise ConfigError(
                f"--speculative-config: draft model {model} has no config.json (expected a "
                "DSpark checkpoint directory)"
            )
        n = value.get("num_speculative_tokens")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(
                f"--speculative-config: num_speculative_tokens must be an integer >= 1, got {n!r}"
            )
        top_k = value["draft_top_k"] if "draft_top_k" in value else default_draft_top_k(model)
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
            raise ConfigError(
                f"--speculative-config: draft_top_k must be an integer >= 0, got {top_k!r}"
            )
        thr = value.get("confidence_threshold", 0.0)
        if not isinstance(thr, int | float) or isinstance(thr, bool) or not 0.0 <= thr < 1.0:
            raise ConfigError(
                f"--speculative-config: confidence_threshold must be in [0, 1), got {thr!r}"
            )
        sched = value.get("confidence_scheduling", True)
        if not isinstance(sched, bool):
            raise ConfigError(
                f"--speculative-config: confidence_scheduling must be true or false, got {sched!r}"
            )
        quant = value.get("quantization")
        if quant is not None and quant not in DRAFT_QUANTIZATIONS:
            raise ConfigError(
                f"--speculative-config: quantization must be one of {list(DRAFT_QUANTIZATIONS)} "
                f"(or omitted: int4 on fp32 CPU runtimes, else the target's --quant), got "
                f"{quant!r}"
            )
        token_map = _token_map(value, model)
        return cls(
            method, model, n, top_k, float(thr), "draft_top_k" in value, sched, source, quant,
            token_map, value.get("token_map") is not None,
        )  # fmt: skip

    def check_engine_backend(self, engines: str) -> None:
        """Refuse the keys only the torch (CPU) runtime honours, for a backend whose draft
        runs as ``engines`` were built (``quantization``, a given ``token_map``); the draft's
        own ``token_map.json`` is not asked for and is not refused.

        Raises:
            ConfigError: such a key (names it and the fix).
        """
        for key, given, value in (
            ("quantization", self.quantization is not None, self.quantization),
            ("token_map", self.token_map_given, str(self.token_map)),
        ):
            if given:
                raise ConfigError(
                    f"--speculative-config: {key} {value!r} applies to the torch (CPU) "
                    f"runtime; {engines} run their draft as built: omit {key}, or run with "
                    "--backend torch"
                )

    def check_block(self, block_size: int, source: str) -> None:
        """num_speculative_tokens must not exceed the draft's block_size (all-predicting)."""
        if self.num_speculative_tokens > block_size:
            raise ConfigError(
                f"--speculative-config: num_speculative_tokens {self.num_speculative_tokens} "
                f"exceeds the draft's block_size {block_size} ({source}); use 1..{block_size}"
            )


def _token_map(value: dict, draft_dir: Path) -> Path | None:
    """The `token_map` file: the given path (``null``: none), else the draft's own
    ``token_map.json`` when it ships one. Its contents are read at load, against the
    draft's vocabulary (:func:`edgebuild.speculative.token_map.read_token_map`).

    Raises:
        ConfigError: a value that is not a string or null, or a path that is not a file.
    """
    if "token_map" not in value:
        own = Path(draft_dir) / TOKEN_MAP_FILE
        return own if own.is_file() else None
    given = value["token_map"]
    if given is None:
        return None
    if not isinstance(given, str) or not given:
        raise ConfigError(
            f"--speculative-config: token_map must be the path of a token-id file (.json or "
            f".pt) or null, got {given!r}"
        )
    path = Path(given).expanduser()
    if path.is_file():
        return path
    parts = given.split("/")
    if len(parts) >= 3 and not path.exists() and is_hub_id("/".join(parts[:2])):
        return _hub_file("/".join(parts[:2]), "/".join(parts[2:]), given)
    raise ConfigError(
        f"--speculative-config: token_map {given!r} is not a file; give the path of a JSON "
        "list of token ids or a .pt tensor of them (tools/train_dspark/token_map.py "
        "writes one), a Hub repository's file (org/name/file.pt), or null for the draft's "
        "whole vocabulary"
    )


def _hub_file(repo_id: str, filename: str, given: str) -> Path:
    """A token map in a Hub repository (SGLang's ``--speculative-token-map`` accepts the
    same form), from the Hub cache or downloaded (``HF_HUB_OFFLINE``: the cache only).

    Raises:
        ConfigError: the file cannot be had (offline and not cached, no such repository or
            file, the Hub unreachable), naming it and the fix.
    """
    from huggingface_hub import hf_hub_download

    offline = hub_offline()
    try:
        return Path(
            hf_hub_download(
                repo_id, filename, cache_dir=str(hub_cache_dir()), local_files_only=offline
            )
        )
    except Exception as exc:  # noqa: BLE001 - every Hub failure is the same user error here
        why = "HF_HUB_OFFLINE is set and it is not in the Hub cache" if offline else str(exc)
        raise ConfigError(
            f"--speculative-config: token_map {given!r} is neither a local file nor a file "
            f"of Hub repository {repo_id!r} ({why}); download it with `hf download "
            f"{repo_id} {filename}`, or give a local path"
        ) from None
