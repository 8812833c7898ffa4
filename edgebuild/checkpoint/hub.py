"""Model references: a local checkpoint folder or a Hugging Face Hub id, resolved to a folder.

Everywhere edgebuild takes a checkpoint (``run``, ``inspect``, ``build``, ``quantize``,
``edgellm-serve``, the draft's ``"model"`` in ``--speculative-config``, a recipe's
``target`` / ``draft``) it takes a *reference*:

- an existing local directory (always wins, as in transformers and vLLM), or
- a Hub id ``org/name``, with a revision from ``--revision`` or the ``org/name@rev`` suffix
  (a branch, tag or commit; default ``main``).

Ids are resolved by ``huggingface_hub`` (:func:`huggingface_hub.snapshot_download`) into the
Hub's own cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``),
so a cache another tool already filled is used as is, offline too (``HF_HUB_OFFLINE=1``);
``HF_TOKEN`` is the token. Only the files edgebuild reads are fetched: the configs, the
tokenizer and chat template, a VLM's ``preprocessor_config.json``, and the safetensors weights
the checkpoint's layout names (the index's shards, else ``model.safetensors``, else the
top-level ``*.safetensors``), never ``*.bin`` / GGUF / subfolders. Downloads show the Hub's
own progress bars.

Every failure is a :class:`~edgebuild.errors.CheckpointError` that names the id and the fix
(offline and not cached, gated, unauthorised, unknown id or revision, no safetensors weights,
not a checkpoint).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from edgebuild.errors import CheckpointError

# the Hub's repo id rule (huggingface_hub.utils.validate_repo_id): org/name, no "--" or ".."
log = logging.getLogger("edgebuild.checkpoint")
# huggingface_hub's validate_repo_id: ASCII letters, digits, "-", "_", "."; no leading or
# trailing "-" / "."; no "--" or ".."; not ending in ".git"
_REPO_ID = re.compile(
    r"^[A-Za-z0-9](?:[A-Za-z0-9_.\-]{0,94}[A-Za-z0-9_])?/[A-Za-z0-9_](?:[A-Za-z0-9_.\-]{0,94}[A-Za-z0-9_])?$"
)
_COMMIT = re.compile(r"^[0-9a-f]{40}$")

#: small files edgebuild reads from a checkpoint (exact top-level names)
CHECKPOINT_META_FILES = (
    "config.json",
    "generation_config.json",
    "hf_quant_config.json",
    "model.safetensors.index.json",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "token_map.json",  # a draft's frequent-token vocabulary (speculative/token_map.py)
)
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx")


@dataclass(frozen=True)
class ModelSource:
    """A resolved model reference.

    Attributes:
        path: the local checkpoint directory (for a Hub id: its snapshot folder in the Hub
            cache, ``.../models--ORG--NAME/snapshots/<commit>``).
        ref: the reference as given (``org/name``, ``org/name@rev`` or a path), for messages
            and for ``/v1/models``.
        repo_id: the Hub id, None for a local folder.
        revision: the revision asked for (branch, tag or commit), None for a local folder.
        commit: the 40-hex commit the revision resolved to, None for a local folder.
    """

    path: Path
    ref: str
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None

    @property
    def is_hub(self) -> bool:
        return self.repo_id is not None

    @property
    def display_name(self) -> str:
        """What users call the model: the Hub id, else the folder's name."""
        return self.repo_id or self.path.resolve().name

    def to_manifest(self) -> dict | None:
        """The ``hub`` entry of a bundle manifest's source (None for a local folder)."""
        if self.repo_id is None:
            return None
        return {"repo_id": self.repo_id, "revision": self.revision, "commit": self.commit}


def split_ref(ref: str | Path, revision: str | None = None) -> tuple[str, str | None]:
    """``(name, revision)`` of ``org/name@rev`` (an ``@rev`` suffix and ``revision`` must
    not both be given).

    Raises:
        CheckpointError: two different revisions, or an empty one (``org/name@``).
    """
    text = str(ref)
    name, at, rev = text.rpartition("@") if "@" in text and "/" in text else (text, "", "")
    if not at:
        return text, revision
    if not rev:
        raise CheckpointError(
            f"{text}: empty revision after '@' (write {name}@main, or drop the '@')"
        )
    if revision is not None and revision != rev:
        raise CheckpointError(
            f"{text}: the reference names revision {rev!r} but --revision is {revision!r}; "
            "give one of them"
        )
    return name, rev


def is_hub_id(text: str) -> bool:
    """True when ``text`` has the form of a Hub model id (``org/name``)."""
    return (
        bool(_REPO_ID.match(text))
        and "--" not in text
        and ".." not in text
        and not text.endswith(".git")
    )


def hub_cache_dir() -> Path:
    """The Hub cache folder, read from the environment now (``HF_HUB_CACHE``, else
    ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), as huggingface_hub reads it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expandvars(os.path.expanduser(os.environ["HF_HUB_CACHE"])))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(os.path.expandvars(os.path.expanduser(home))) / "hub"


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set to a true value, read now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def resolve_model_ref(
    ref: str | Path, revision: str | None = None, *, what: str = "model"
) -> ModelSource:
    """A local folder as is, or a Hub id resolved (downloaded if needed) into the Hub cache.

    Args:
        ref: a directory, ``org/name`` or ``org/name@rev``.
        revision: branch, tag or commit (default ``main``); ``--revision``.
        what: what the reference is for, in messages (``model``, ``draft model``, ...).

    Returns:
        The :class:`ModelSource` (for an id, ``path`` is the snapshot folder).

    Raises:
        CheckpointError: a path that does not exist and is not an id; for an id: offline and
            not cached (names the cache folder and the download command), gated or
            unauthorised (``HF_TOKEN``), unknown id or revision, no safetensors weights, not
            a checkpoint (no ``config.json``).
    """
    text = str(ref)
    if Path(text).expanduser().is_dir():
        if revision is not None:
            raise CheckpointError(
                f"{text}: --revision {revision!r} applies to Hub ids, but this is a local folder"
            )
        return ModelSource(Path(text).expanduser(), text)
    name, rev = split_ref(text, revision)
    if not is_hub_id(name):
        raise CheckpointError(
            f"{text}: {what} not found: no such directory, and not a Hugging Face Hub id "
            "(org/name[@revision])"
        )
    return _resolve_hub(name, rev or "main", text, what)


def _resolve_hub(repo_id: str, revision: str, ref: str, what: str) -> ModelSource:
    """Resolve ``repo_id@revision`` through huggingface_hub (module docstring)."""
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    offline = hub_offline()
    meta = list(CHECKPOINT_META_FILES)
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=str(cache),
                allow_patterns=meta,
                local_files_only=offline,
            )
        )
        weights = _weight_files(folder, repo_id, revision, offline, cache)
        if weights and not offline:
            folder = Path(
                snapshot_download(
                    repo_id, revision=folder.name, cache_dir=str(cache), allow_patterns=weights
                )
            )
    except Exception as exc:  # noqa: BLE001 - mapped to a message naming the fix, or re-raised
        folder = None if offline or not _unreachable(exc) else _cached_snapshot(repo_id, revision)
        if folder is None:
            raise _hub_error(exc, repo_id, revision, cache, offline, what) from None
        log.warning(
            "the Hub cannot be reached (%s: %s); using the cached snapshot %s of %s@%s",
            type(exc).__name__, exc, folder.name, repo_id, revision,
        )  # fmt: skip
    source = ModelSource(folder, ref, repo_id, revision, folder.name)
    _check_snapshot(source, cache)
    return source


def _unreachable(exc: BaseException) -> bool:
    """A network failure (no route, DNS, timeout), not an answer of the Hub."""
    import httpx

    if isinstance(exc, (httpx.TransportError, ConnectionError, TimeoutError)):
        return True
    try:
        import requests

        return isinstance(exc, (requests.ConnectionError, requests.Timeout))
    except ImportError:
        return False


def _cached_snapshot(repo_id: str, revision: str) -> Path | None:
    """The snapshot of ``repo_id@revision`` already in the Hub cache (as huggingface_hub
    resolves it offline), or None."""
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id, revision=revision, cache_dir=str(hub_cache_dir()), local_files_only=True
            )
        )
    except Exception:  # noqa: BLE001 - not cached: the caller reports the network error
        return None


def _weight_files(
    folder: Path, repo_id: str, revision: str, offline: bool, cache: Path
) -> list[str]:
    """The safetensors files the checkpoint's layout names (WeightSource's order: the index's
    shards, ``model.safetensors``, the top-level ``*.safetensors``).

    Offline the snapshot holds what it holds (checked by :func:`_check_snapshot`); online the
    repo's file list decides.

    Raises:
        CheckpointError: the repo has no config.json, or no safetensors weights.
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
        except (OSError, ValueError, AttributeError):
            weight_map = {}  # WeightSource names the corrupt index later
        return sorted({str(v) for v in weight_map.values() if isinstance(v, str)})
    if offline:
        return []
    from huggingface_hub import HfApi

    files = HfApi().list_repo_files(repo_id, revision=folder.name)
    top = [f for f in files if "/" not in f]
    if "config.json" not in top:
        raise CheckpointError(_not_checkpoint(repo_id, revision, top))
    if "model.safetensors" in top:
        return ["model.safetensors"]
    shards = sorted(f for f in top if f.endswith(".safetensors"))
    if not shards:
        raise CheckpointError(_no_safetensors(repo_id, revision, top))
    return shards


def _not_checkpoint(repo_id: str, revision: str, files: list[str]) -> str:
    listed = ", ".join(sorted(files)[:8]) or "no files"
    return (
        f"{repo_id}@{revision} is not a model checkpoint: it has no config.json at its top level "
        f"(it has {listed}); use the id of a Transformers checkpoint repo"
    )


def _no_safetensors(repo_id: str, revision: str, files: list[str]) -> str:
    other = sorted(f for f in files if f.endswith(_OTHER_WEIGHTS)) or ["no weight files"]
    return (
        f"{repo_id}@{revision} has no safetensors weights (it has {', '.join(other[:6])}): "
        "edgebuild loads Hub checkpoints as safetensors only (PyTorch .bin is pickle, GGUF is "
        "llama.cpp's format); use a repo that ships *.safetensors, or convert the weights "
        "yourself and pass the local folder"
    )


def _check_snapshot(source: ModelSource, cache: Path) -> None:
    """A resolved snapshot holds a config and safetensors weights, else a clear error."""
    folder = source.path
    files = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if "config.json" not in files:
        raise CheckpointError(_not_checkpoint(source.repo_id, source.revision, files))
    if not any(f.endswith(".safetensors") for f in files):
        if any(f.endswith(_OTHER_WEIGHTS) for f in files):
            raise CheckpointError(_no_safetensors(source.repo_id, source.revision, files))
        raise CheckpointError(
            f"{source.repo_id}@{source.revision}: the cached snapshot {folder} (in {cache}) has "
            "a config but no weights; download them with "
            f"`{download_command(source.repo_id, source.revision)}`"
        )


def download_command(repo_id: str, revision: str | None) -> str:
    """The shell command that fills the Hub cache with what edgebuild reads of ``repo_id``."""
    rev = "" if revision in (None, "main") else f" --revision {revision}"
    return (
        f"hf download {repo_id}{rev} --include '*.safetensors' '*.json' '*.jinja' '*.txt' '*.model'"
    )


def _hub_error(
    exc: Exception, repo_id: str, revision: str, cache: Path, offline: bool, what: str
) -> Exception:
    """The CheckpointError for a huggingface_hub exception (naming the fix), or ``exc``."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    ident = f"{what} {repo_id}@{revision}"
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, GatedRepoError):
        return CheckpointError(
            f"{ident}: the repo is gated: accept its licence at https://huggingface.co/{repo_id} "
            "with your account, then set HF_TOKEN to a token of that account (or `hf auth login`)"
        )
    if isinstance(exc, RevisionNotFoundError):
        return CheckpointError(
            f"{ident}: the repo has no revision {revision!r}; use a branch, tag or commit "
            f"that exists (see https://huggingface.co/{repo_id}/tree/main)"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return CheckpointError(
            f"{ident}: no such repo on the Hub, or it is private and no valid token was sent; "
            "check the id, and for a private repo set HF_TOKEN"
        )
    if isinstance(exc, HfHubHTTPError) and getattr(exc.response, "status_code", None) == 401:
        return CheckpointError(f"{ident}: unauthorised (401); set HF_TOKEN to a valid token")
    if isinstance(exc, LocalEntryNotFoundError):
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached"
        return CheckpointError(
            f"{ident} is not in the Hub cache {cache} and {why}; download it first with "
            f"`{download_command(repo_id, revision)}` (on a machine with access, then copy "
            "the cache), or point HF_HUB_CACHE / HF_HOME at a cache that has it"
        )
    if type(exc).__name__ == "IncompleteSnapshotError":
        return CheckpointError(
            f"{ident}: the cached snapshot in {cache} is incomplete ({exc}); complete it with "
            f"`{download_command(repo_id, revision)}`"
        )
    if isinstance(exc, HfHubHTTPError | OSError):
        return CheckpointError(f"{ident}: the Hub request failed ({exc}); retry, or go offline")
    return exc


def is_commit(revision: str | None) -> bool:
    """True for a full 40-hex commit id (immutable: a cache key needs no Hub call)."""
    return bool(revision and _COMMIT.match(revision))
