"""The bundle format: layout, ``manifest.json``, hashing, verification, and model resolution.

A bundle is a directory::

    BUNDLE/
      manifest.json              written last; its presence marks a complete bundle
      base/model.onnx            target graph (+ model.onnx.data, config.json, model.engine)
      base/shared.onnx.data      the target tensors the draft borrows (embedding, lm_head),
                                 stored once: base/model.onnx and base/draft.onnx both read it
      base/draft.onnx            DSpark draft graph (+ draft.onnx.data; draft/ holds its
                                 config.json and model.engine)
      visual/model.onnx          vision tower graph (when the target is a VLM; + model.onnx.data,
                                 config.json, preprocessor_config.json, model.engine)
      tokenizer.json ...         the target's tokenizer files and chat template

``manifest.json`` (format ``edgebuild-bundle``, version :data:`FORMAT_VERSION`) records the
roles (``base``, ``draft``, ``visual``) with their files and I/O, the build settings, the
plugin (name, version, library), the source checkpoints with the sha256 and size of every file
that defines them (weights, configs), the DSpark fields, the vision fields
(``roles.visual.vision``), the tokenizer files, and the sha256 and size of every file of the
bundle.
It holds no timestamps and no temporary paths and is written with sorted keys, so building
twice from the same inputs gives the same bytes.

This module is what the runtime imports (:func:`resolve_model_path`): it never imports the
exporter or TensorRT.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from edgebuild.errors import BundleError, unreadable

FORMAT = "edgebuild-bundle"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
# files that define a checkpoint (hashed into the manifest), besides the weight files
CHECKPOINT_FILES = (
    "config.json",
    "hf_quant_config.json",
    "preprocessor_config.json",  # a VLM's image preprocessing (the visual role copies it)
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin")
ROLES = ("base", "draft", "visual")  # the role folders of a bundle
_CHUNK = 8 << 20


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 8 MiB chunks (constant memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_record(path: Path) -> dict:
    """``{"sha256": ..., "size": ...}`` of one file."""
    return {"sha256": sha256_file(path), "size": path.stat().st_size}


def checkpoint_files(ckpt_dir: Path) -> list[str]:
    """The files that define a checkpoint directory (configs and weights), sorted."""
    ckpt_dir = Path(ckpt_dir)
    names = [n for n in CHECKPOINT_FILES if (ckpt_dir / n).is_file()]
    names += [p.name for p in ckpt_dir.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES]
    return sorted(set(names))


def source_record(ckpt_dir: Path, hub: dict | None = None) -> dict:
    """Manifest entry of a source checkpoint: absolute path and every defining file's hash,
    and for a Hub id its ``hub`` entry (``repo_id``, the ``revision`` asked for and the
    ``commit`` it resolved to; the path is then the Hub cache's snapshot folder)."""
    ckpt_dir = Path(ckpt_dir)
    if hub is None:
        ckpt_dir = ckpt_dir.resolve()  # a Hub snapshot keeps its path (its files are links)
    record = {
        "path": str(ckpt_dir.absolute()),
        "files": {name: file_record(ckpt_dir / name) for name in checkpoint_files(ckpt_dir)},
    }
    if hub is not None:
        record["hub"] = dict(hub)
    return record


def dumps(manifest: dict) -> str:
    """The canonical text of a manifest (sorted keys, 2-space indent, final newline)."""
    return json.dumps(manifest, indent=2, sort_keys=True) + "\n"


def read_manifest(bundle: Path) -> dict:
    """Parse ``BUNDLE/manifest.json`` and check its format and version.

    Raises:
        BundleError: not a directory, no manifest (an unfinished or interrupted build), bad
            JSON, another format, or a format version this edgebuild does not read.
    """
    bundle = Path(bundle)
    path = bundle / MANIFEST_NAME
    if not bundle.is_dir():
        raise BundleError(f"{bundle}: not a directory")
    if not path.is_file():
        raise BundleError(
            f"{bundle}: no {MANIFEST_NAME}; this is not a finished bundle (an interrupted build "
            "leaves none) - rebuild it with `edgebuild build`"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{path}: unreadable manifest ({exc}); rebuild the bundle") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise BundleError(f"{path}: format is {got!r}, not {FORMAT!r}; this is not a bundle")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise BundleError(
            f"{path}: format_version is {version!r} but this edgebuild reads version "
            f"{FORMAT_VERSION}; rebuild the bundle with this edgebuild (or use the edgebuild "
            "that wrote it)"
        )
    return manifest


def _check_files(bundle: Path, manifest: dict) -> list[str]:
    problems = []
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return [f"{bundle / MANIFEST_NAME}: has no 'files' table"]
    for rel, record in sorted(files.items()):
        path = bundle / rel
        if not path.is_file():
            problems.append(f"{rel}: missing from the bundle (listed in {MANIFEST_NAME})")
            continue
        size = path.stat().st_size
        if size != record.get("size"):
            problems.append(
                f"{rel}: size {size} bytes, the manifest says {record.get('size')}: the file "
                "was truncated or replaced after the build"
            )
            continue
        digest = sha256_file(path)
        if digest != record.get("sha256"):
            problems.append(
                f"{rel}: sha256 {digest[:16]}... but the manifest says "
                f"{str(record.get('sha256'))[:16]}...: the file changed after the build"
            )
    for role, entry in sorted((manifest.get("roles") or {}).items()):
        keys = ("onnx", "onnx_data", "onnx_shared_data", "config", "preprocessor_config", "engine")
        for key in keys:
            rel = entry.get(key)
            if rel and rel not in files:
                problems.append(f"roles.{role}.{key} = {rel!r} is not in the manifest's files")
    problems += unlisted_files(bundle, manifest, files)
    return problems


def unlisted_files(bundle: Path, manifest: dict, files: dict) -> list[str]:
    """Files the manifest does not list: in a role folder (``base/``, ``draft/``, ``visual/``)
    or at the top level (where the tokenizer files are; hidden files aside).

    Nothing writes into a bundle after its manifest, so such a file was added by hand (e.g. an
    engine copied from another build, an ``added_tokens.json``) and would be loaded unchecked.
    """
    problems = []
    found = [p for p in bundle.iterdir() if p.is_file() and not p.name.startswith(".")]
    for role in sorted({*ROLES, *(manifest.get("roles") or {})}):
        folder = bundle / role
        if folder.is_dir():
            found += [p for p in folder.rglob("*") if not p.is_dir()]
    for path in sorted(found):
        rel = path.relative_to(bundle).as_posix()
        if rel != MANIFEST_NAME and rel not in files:
            problems.append(
                f"{rel}: not listed in {MANIFEST_NAME} (added after the build); remove it "
                "or rebuild the bundle"
            )
    return problems


def _check_sources(manifest: dict) -> list[str]:
    problems = []
    for role, source in sorted((manifest.get("sources") or {}).items()):
        root = Path(source.get("path", ""))
        hub = source.get("hub")
        if hub and root.name != hub.get("commit"):
            problems.append(
                f"sources.{role}: {hub.get('repo_id')} was built from commit {hub.get('commit')} "
                f"but its path {root} is not that commit's snapshot; rebuild the bundle"
            )
            continue
        if hub and not root.is_dir():
            problems.append(
                f"sources.{role}: {hub.get('repo_id')}@{hub.get('commit')} is no longer in the Hub "
                f"cache ({root} is missing); restore it with `hf download {hub.get('repo_id')} "
                f"--revision {hub.get('commit')}` or rebuild the bundle"
            )
            continue
        if not root.is_dir():
            problems.append(
                f"sources.{role}: checkpoint directory {root} is missing (moved or deleted after "
                "the build); restore it or rebuild the bundle"
            )
            continue
        for name, record in sorted((source.get("files") or {}).items()):
            path = root / name
            if not path.is_file():
                problems.append(f"sources.{role}: {path} is missing; rebuild the bundle")
            elif path.stat().st_size != record.get("size") or sha256_file(path) != record.get(
                "sha256"
            ):
                problems.append(
                    f"sources.{role}: {path} changed since the bundle was built (sha256/size "
                    "differ from the manifest); rebuild the bundle from the new checkpoint"
                )
    return problems


def verify_bundle(bundle: Path, check_sources: bool = True) -> dict:
    """Re-check a bundle: manifest format and version, every file's size and sha256, the
    roles' files, no unlisted file in a role folder, and (``check_sources``) the source
    checkpoints' hashes.

    Returns:
        The manifest.

    Raises:
        BundleError: listing every problem found, one per line, each naming the file and
            saying what to do.
    """
    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    problems = _check_files(bundle, manifest)
    if check_sources:
        problems += _check_sources(manifest)
    if problems:
        raise BundleError(
            f"{bundle}: the bundle does not verify ({len(problems)} problem"
            f"{'s' if len(problems) > 1 else ''}):\n  " + "\n  ".join(problems)
        )
    return manifest


def _pid_alive(pid: int) -> bool:
    """True when a process ``pid`` runs on this machine (or exists but is not ours)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_staging(out: Path) -> list[tuple[Path, int]]:
    """``(folder, pid)`` of the staging folders that killed builds of ``out`` left behind.

    A build of ``NAME`` writes ``.NAME.partial-PID`` (and, while replacing, ``.NAME.old-PID``)
    next to it; a folder whose process no longer runs on this machine is stale.
    """
    out = Path(out).resolve()
    found = []
    if not out.parent.is_dir():
        return found
    for kind in ("partial", "old"):
        for path in sorted(out.parent.glob(f".{out.name}.{kind}-*")):
            pid = path.name.rpartition("-")[2]
            if path.is_dir() and pid.isdigit() and not _pid_alive(int(pid)):
                found.append((path, int(pid)))
    return found


def engine_profiles(manifest: dict, role: str) -> list[tuple[str, dict[str, tuple]]]:
    """The optimization profiles ``role``'s engine was built with, from ``roles.<role>.profiles``.

    Written at build time by :func:`edgebuild.engine.builder.record_profiles`; returns
    ``[(name, {input: (min_shape, opt_shape, max_shape)})]`` in engine order, shapes as
    tuples of ints.

    Raises:
        BundleError: the role records no profiles (a bundle built before they were recorded:
            rebuild it with `edgebuild build`) or a malformed entry.
    """
    entry = (manifest.get("roles") or {}).get(role) or {}
    records = entry.get("profiles")
    if not isinstance(records, list) or not records:
        raise BundleError(
            f"manifest.json: roles.{role} records no engine optimization profiles (a bundle "
            "built by an older edgebuild); rebuild it with `edgebuild build`"
        )
    out = []
    for record in records:
        try:
            shapes = {
                name: tuple(tuple(int(d) for d in shape) for shape in triple)
                for name, triple in record["shapes"].items()
            }
            if any(len(triple) != 3 for triple in shapes.values()):
                raise ValueError("not (min, opt, max)")
            out.append((str(record["name"]), shapes))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise BundleError(
                f"manifest.json: roles.{role}.profiles has a malformed entry {record!r} ({exc}); "
                "rebuild the bundle with `edgebuild build`"
            ) from None
    return out


def is_bundle(path: Path) -> bool:
    """True when ``path`` is a directory with a ``manifest.json`` (complete or corrupt).

    Raises:
        CheckpointError: ``path`` cannot be searched by this user (the message names it and
            the permission fix).
    """
    try:
        return (Path(path) / MANIFEST_NAME).is_file()
    except OSError as exc:
        raise unreadable(exc) from None


@dataclass(frozen=True)
class ResolvedModel:
    """What the runtime loads for a model path.

    Attributes:
        target: the target checkpoint directory.
        draft: the DSpark draft checkpoint directory, or None.
        speculative: the bundle's speculative settings (``--speculative-config`` keys, draft
            path included), or None.
        bundle: the bundle directory when ``path`` was a bundle.
        manifest: its manifest (empty for a plain checkpoint).
    """

    target: Path
    draft: Path | None = None
    speculative: dict | None = None
    bundle: Path | None = None
    manifest: dict | None = None


def resolve_model_path(path: str | Path, verify: bool = True) -> ResolvedModel:
    """A checkpoint directory as is; a bundle after :func:`verify_bundle`, as its sources.

    Args:
        path: a checkpoint or bundle directory.
        verify: re-hash the bundle and its sources (:func:`verify_bundle`); False when the
            caller has just checked it (the engine cache's start-up check,
            :mod:`edgebuild.bundle.cache`), so a start reads no weights: only the manifest.

    Raises:
        BundleError: a bundle that does not verify (changed byte, missing file, wrong format
            version, a source checkpoint whose hash changed).
    """
    path = Path(path)
    if not is_bundle(path):
        return ResolvedModel(target=path)
    manifest = verify_bundle(path, check_sources=True) if verify else read_manifest(path)
    sources = manifest.get("sources") or {}
    if "target" not in sources:
        raise BundleError(f"{path / MANIFEST_NAME}: no sources.target; rebuild the bundle")
    target = Path(sources["target"]["path"])
    draft = Path(sources["draft"]["path"]) if "draft" in sources else None
    speculative = None
    spec = manifest.get("speculative")
    if draft is not None and spec:
        speculative = {**spec, "model": str(draft)}
    return ResolvedModel(target, draft, speculative, path, manifest)
