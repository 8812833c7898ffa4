"""The engine cache: build a bundle once per (sources, settings, device, toolchain), reuse it.

``edgebuild build SRC --cache-dir DIR`` and ``edgellm-serve MODEL --cache-dir DIR`` keep their
bundles here (``--cache-dir``, else ``$EDGEBUILD_CACHE_DIR``, else
``$XDG_CACHE_HOME/edgebuild``, else ``~/.cache/edgebuild``)::

    DIR/bundles/<key>/        a finished bundle (manifest.json, base/, draft/, visual/)
    DIR/bundles/<key>.json    its entry record: what the key was made of, file stamps, last use
    DIR/locks/<key>.lock      held (flock) while a process builds or checks the entry

**The key** (:func:`cache_key`) is the sha256 of everything that decides the engines: each
source's identity (a Hub commit; for a local folder a cheap fingerprint of its files' names,
sizes, mtimes and safetensors headers, never the weight bytes), the recipe's ``build`` and
``speculative`` fields, the build options (ONNX only, graph kind, builder, dtype), the device
SM and the TensorRT / TensorRT-RTX version the engines are built with, the plugin library's
sha256 (plugin engines), the bundle format version and edgebuild's version.

**A hit** is checked before use without reading the engines or weights: the manifest (format,
version), every listed file's size and mtime against the stamps taken when the entry was
committed, the sha256 of every small file (configs, tokenizer, manifest), no unlisted file in
a role folder. A failed check is logged, the entry refused and rebuilt.
``edgebuild cache verify`` re-hashes every byte.

**A miss** builds into the bundle's staging folder (``.KEY.partial-PID``) and renames it into
place (:func:`edgebuild.bundle.build.build_bundle`); the entry record is written after it,
atomically. A process that starts while another builds the same key waits on the lock, then
finds the hit. A build that is killed or fails leaves at most a staging folder (removed by
the next build) or a bundle without a record, neither of which passes as a hit.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from edgebuild.bundle.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    checkpoint_files,
    read_manifest,
    sha256_file,
    stale_staging,
    unlisted_files,
    verify_bundle,
)
from edgebuild.checkpoint.hub import ModelSource
from edgebuild.checkpoint.source import read_safetensors_header_bytes
from edgebuild.errors import BundleError, ConfigError

log = logging.getLogger("edgebuild.cache")

ENV_VAR = "EDGEBUILD_CACHE_DIR"
SMALL_FILE = 1 << 20  # files up to this size are re-hashed on every hit
RECORD_VERSION = 1


KERNEL_ENV_VAR = "EDGEBUILD_CACHE"  # the CPU kernel cache alone (edgebuild.ops.cpu_build)
_WARNED_LOOKALIKE = False


def default_cache_dir() -> Path:
    """``$EDGEBUILD_CACHE_DIR``, else ``$XDG_CACHE_HOME/edgebuild``, else ``~/.cache/edgebuild``.

    ``$EDGEBUILD_CACHE`` (the CPU kernel cache's variable) does not move the engine cache; set
    alone it is likely meant for it, so that is logged once as a warning naming both.
    """
    global _WARNED_LOOKALIKE
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    root = Path(base).expanduser() / "edgebuild"
    if os.environ.get(KERNEL_ENV_VAR) and not _WARNED_LOOKALIKE:
        _WARNED_LOOKALIKE = True
        log.warning(
            "$%s is set but only moves the CPU kernel cache; the engine cache is %s (set $%s "
            "or --cache-dir to move it, and the kernels with it)", KERNEL_ENV_VAR, root, ENV_VAR,
        )  # fmt: skip
    return root


def local_fingerprint(folder: Path) -> str:
    """sha256 over a local checkpoint's defining files: each name, size and mtime, the whole
    content of small files (configs, tokenizer) and the header of each safetensors file.

    Cheap by design (a 15 GB checkpoint costs its headers, a few MB): it changes when a file
    is replaced, touched, added or removed. ``edgebuild cache verify`` does the full hash.
    """
    from edgebuild.bundle.build import TOKENIZER_FILES

    folder = Path(folder).resolve()
    names = set(checkpoint_files(folder))
    names |= {n for n in TOKENIZER_FILES if (folder / n).is_file()}
    digest = hashlib.sha256()
    for name in sorted(names):
        path = folder / name
        st = path.stat()
        digest.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        if name.endswith(".safetensors"):
            digest.update(read_safetensors_header_bytes(path))
        elif st.st_size <= SMALL_FILE:
            digest.update(path.read_bytes())
    return digest.hexdigest()


def source_identity(source: ModelSource) -> dict:
    """What a source contributes to the key: its Hub commit, or its local fingerprint."""
    if source.is_hub:
        return {"repo_id": source.repo_id, "commit": source.commit}
    return {
        "local": str(Path(source.path).resolve()),
        "fingerprint": local_fingerprint(source.path),
    }


@dataclass(frozen=True)
class Toolchain:
    """The machine facts that decide engines: the SM they run on, the builder's version and
    the plugin library they load (None where no engine is built)."""

    sm: str | None = None
    builder_version: str | None = None
    plugin_sha256: str | None = None

    def to_json(self) -> dict:
        return {
            "sm": self.sm,
            "builder_version": self.builder_version,
            "plugin": self.plugin_sha256,
        }


def cache_key(
    recipe, sources: dict[str, ModelSource], options, toolchain: Toolchain
) -> tuple[str, dict]:
    """``(key, material)``: the entry key (24 hex) and the JSON it hashes (module docstring).

    Args:
        recipe: the :class:`~edgebuild.recipe.Recipe` (its ``build`` / ``speculative``).
        sources: ``{"target": ..., "draft": ...}`` resolved references.
        options: the :class:`~edgebuild.bundle.build.BuildOptions`.
        toolchain: SM, builder version and plugin hash (:func:`probe_toolchain`).
    """
    from edgebuild import __version__

    material = {
        "format_version": FORMAT_VERSION,
        "edgebuild": __version__,
        "sources": {role: source_identity(src) for role, src in sorted(sources.items())},
        "build": recipe.build.model_dump(mode="json"),
        "speculative": recipe.speculative.model_dump(mode="json") if recipe.speculative else None,
        "options": {
            "onnx_only": options.onnx_only,
            "portable": options.portable,
            "builder": None if options.onnx_only else options.builder,
            "dtype": options.dtype,
        },
        "toolchain": toolchain.to_json(),
    }
    text = json.dumps(material, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24], material


def probe_toolchain(options) -> Toolchain:
    """The SM, builder version and plugin library hash a build with ``options`` would use.

    ONNX-only builds depend on none of them. Otherwise the builder module is imported (its
    version) and, for plugin graphs built by TensorRT, the plugin library is hashed.

    Raises:
        MissingDependencyError: the builder is not installed (names the install).
    """
    if options.onnx_only:
        return Toolchain()
    from edgebuild.engine import load_tensorrt, local_sm

    trt = load_tensorrt(options.builder)
    sm = local_sm() if options.builder == "tensorrt" else None
    plugin = None
    if not options.portable:
        from edgebuild.engine.plugin_library import plugin_library_path

        lib = options.plugin_library or plugin_library_path()
        plugin = sha256_file(Path(lib)) if lib is not None and Path(lib).is_file() else None
    return Toolchain(sm, str(trt.__version__), plugin)


def _atomic_write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


@dataclass(frozen=True)
class CacheResult:
    """A usable entry: the bundle path, its key, and whether this call built it."""

    path: Path
    key: str
    hit: bool
    build_s: float = 0.0


class EngineCache:
    """One cache directory (module docstring for the layout and the rules).

    Args:
        root: the cache directory (created on first build).
    """

    def __init__(self, root: Path | None = None):
        self.root = Path(root).expanduser() if root is not None else default_cache_dir()

    def ensure_writable(self) -> None:
        """Create the cache directory if needed and check it can be written.

        Raises:
            ConfigError: the path is a file, or cannot be created or written (names the fix).
        """
        fix = "give --cache-dir (or $EDGEBUILD_CACHE_DIR) a directory this user can write"
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"engine cache {self.root} is not a directory; {fix}")
        try:
            (self.root / "locks").mkdir(parents=True, exist_ok=True)
            probe = self.root / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"engine cache {self.root} is not writable ({exc}); {fix}") from None

    def bundle_path(self, key: str) -> Path:
        return self.root / "bundles" / key

    def record_path(self, key: str) -> Path:
        return self.root / "bundles" / f"{key}.json"

    @contextlib.contextmanager
    def lock(self, key: str, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
        """Hold the entry's file lock (blocking; the OS releases it when a process dies)."""
        locks = self.root / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{key}.lock", "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "another process"
                if on_wait is not None:
                    on_wait(holder)
                fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            f.truncate()
            f.write(f"process {os.getpid()}")
            f.flush()
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # ------------------------------------------------------------------ entries
    def check(self, key: str) -> list[str]:
        """Why the entry ``key`` cannot be used as is (empty: it is a good hit).

        Reads the record, the manifest and the small files only (module docstring).
        """
        path, record_path = self.bundle_path(key), self.record_path(key)
        if not path.is_dir():
            return ["no entry"]
        if not record_path.is_file():
            return [f"{path} has no entry record (a build that did not finish committing)"]
        try:
            record = json.loads(record_path.read_text(encoding="utf-8"))
            manifest = read_manifest(path)
        except (OSError, ValueError, BundleError) as exc:
            return [f"unreadable entry: {exc}"]
        if not isinstance(record, dict) or not isinstance(record.get("stamps"), dict):
            return [f"{record_path} is not an entry record (a JSON object with stamps)"]
        if record.get("key") != key:
            return [f"{record_path} belongs to key {record.get('key')!r}"]
        try:
            return _stamp_problems(path, manifest, record["stamps"])
        except (TypeError, ValueError) as exc:
            return [f"{record_path}: malformed stamps ({exc})"]

    def commit(self, key: str, material: dict, build_s: float) -> None:
        """Write the entry record of a freshly built bundle (stamps of every file)."""
        path = self.bundle_path(key)
        manifest = read_manifest(path)
        stamps = {rel: _stamp(path / rel) for rel in sorted(manifest["files"])}
        stamps[MANIFEST_NAME] = _stamp(path / MANIFEST_NAME)
        now = time.time()
        record = {
            "record_version": RECORD_VERSION,
            "key": key,
            "material": material,
            "name": manifest.get("name"),
            "created": now,
            "last_used": now,
            "build_s": round(build_s, 3),
            "size": _tree_size(path),
            "stamps": stamps,
        }
        _atomic_write_json(self.record_path(key), record)

    def touch(self, key: str) -> None:
        """Record a use of the entry (``last_used``, for ``cache prune``)."""
        path = self.record_path(key)
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        record["last_used"] = time.time()
        _atomic_write_json(path, record)

    def remove(self, key: str) -> None:
        """Delete an entry (record first: a half-removed entry is never a hit)."""
        with contextlib.suppress(FileNotFoundError):
            self.record_path(key).unlink()
        shutil.rmtree(self.bundle_path(key), ignore_errors=True)

    def entries(self) -> list[dict]:
        """Every entry's record (plus ``key``, ``path`` and ``status``: ok / incomplete)."""
        folder = self.root / "bundles"
        if not folder.is_dir():
            return []
        out = []
        for path in sorted(
            p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")
        ):
            try:
                record = json.loads(self.record_path(path.name).read_text(encoding="utf-8"))
                status = "ok"
            except (OSError, ValueError):
                record, status = {}, "incomplete (no record)"
            if not isinstance(record, dict):
                record, status = {}, "incomplete (malformed record)"
            for field in ("size", "last_used", "created", "build_s"):
                if not isinstance(record.get(field, 0), (int, float)):
                    record, status = {}, "incomplete (malformed record)"
            record.setdefault("size", _tree_size(path))
            out.append({**record, "key": path.name, "path": str(path), "status": status})
        return out

    # ------------------------------------------------------------------ get or build
    def get_or_build(
        self,
        key: str,
        material: dict,
        build: Callable[[Path], None],
        on_event: Callable[[str, dict], None] | None = None,
    ) -> CacheResult:
        """The bundle of ``key``: reused when its check passes, else built by ``build(out)``.

        ``build`` must create the bundle at ``out`` atomically (build_bundle does, with
        ``force`` to replace a refused entry). ``on_event(kind, info)`` is told ``hit``,
        ``refused`` (with ``problems``), ``waiting`` (with ``holder``) and ``built``.

        Raises:
            whatever ``build`` raises (the entry is then absent: nothing is left as a hit).
        """
        notify = on_event or (lambda kind, info: None)
        self.ensure_writable()
        with self.lock(key, on_wait=lambda holder: notify("waiting", {"holder": holder})):
            problems = self.check(key)
            if not problems:
                self.touch(key)
                notify("hit", {"path": str(self.bundle_path(key))})
                return CacheResult(self.bundle_path(key), key, hit=True)
            if problems != ["no entry"]:
                log.warning(
                    "engine cache: refusing entry %s: %s; rebuilding it", key, "; ".join(problems)
                )
                notify("refused", {"problems": problems})
                self.remove(key)
            self.record_path(key).parent.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            build(self.bundle_path(key))
            build_s = time.perf_counter() - t0
            self.commit(key, material, build_s)
            notify("built", {"path": str(self.bundle_path(key)), "build_s": build_s})
            return CacheResult(self.bundle_path(key), key, hit=False, build_s=build_s)

    def last_build_s(self) -> float | None:
        """The build time of the most recent entry (an ETA for the next build), or None."""
        times = [
            (e.get("created", 0), e.get("build_s")) for e in self.entries() if e.get("build_s")
        ]
        return max(times)[1] if times else None

    # ------------------------------------------------------------------ maintenance
    def verify(self, key: str) -> dict:
        """Full check of one entry: the stamps, then every byte of the bundle and its
        sources (:func:`~edgebuild.bundle.manifest.verify_bundle`). Returns the manifest.

        Raises:
            BundleError: listing every problem.
        """
        problems = self.check(key)
        if problems:
            raise BundleError(f"cache entry {key}: " + "; ".join(problems))
        return verify_bundle(self.bundle_path(key), check_sources=True)

    def prune(
        self, older_than_s: float | None = None, max_bytes: int | None = None, dry_run: bool = False
    ) -> list[dict]:
        """Remove entries unused for ``older_than_s``, then the least recently used until the
        cache holds at most ``max_bytes``; incomplete entries and stale staging folders always
        go. Entries another process holds the lock of are kept. Returns the removed entries.
        """
        now, removed = time.time(), []
        entries = sorted(self.entries(), key=lambda e: e.get("last_used", 0))
        total = sum(int(e.get("size") or 0) for e in entries)
        for entry in entries:
            old = older_than_s is not None and now - entry.get("last_used", 0) > older_than_s
            big = max_bytes is not None and total > max_bytes
            if entry["status"] != "ok" or old or big:
                if dry_run or self._try_remove(entry["key"]):
                    removed.append(entry)
                    total -= int(entry.get("size") or 0)
        if not dry_run:
            for path, _pid in stale_staging_all(self.root / "bundles"):
                shutil.rmtree(path, ignore_errors=True)
        return removed

    def _try_remove(self, key: str) -> bool:
        locks = self.root / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{key}.lock", "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            try:
                self.remove(key)
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        return True


def stale_staging_all(folder: Path) -> list[tuple[Path, int]]:
    """Staging folders of killed builds anywhere in ``folder`` (:func:`stale_staging`)."""
    if not folder.is_dir():
        return []
    keys = {p.name.split(".")[1] for p in folder.glob(".*.partial-*")}
    keys |= {p.name.split(".")[1] for p in folder.glob(".*.old-*")}
    return [found for key in sorted(keys) for found in stale_staging(folder / key)]


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _stamp_problems(path: Path, manifest: dict, stamps: dict) -> list[str]:
    """The start-up check of an entry (module docstring): stamps, small-file hashes, no
    unlisted files."""
    problems = []
    files = manifest.get("files") or {}
    for rel in sorted({*files, MANIFEST_NAME}):
        file = path / rel
        if not file.is_file():
            problems.append(f"{rel} is missing")
            continue
        if rel not in stamps or _stamp(file) != list(stamps[rel]):
            problems.append(f"{rel} changed after the entry was built (size or mtime)")
            continue
        record = files.get(rel)
        if (
            record
            and record.get("size", 0) <= SMALL_FILE
            and sha256_file(file) != record.get("sha256")
        ):
            problems.append(f"{rel}: sha256 differs from the manifest")
    problems += unlisted_files(path, manifest, files)
    return problems


def _with_unit(text: str, t: str, units: dict, default: str, what: str) -> float:
    """``t`` (normalised ``text``) as a number times its unit suffix; finite and >= 0."""
    num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, default)
    try:
        value = float(num) * units[unit]
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{text!r} is not a {what}")
    return value


def parse_size(text: str) -> int:
    """``"50G"`` / ``"512M"`` / ``"1024"`` -> bytes (binary units).

    Raises:
        ConfigError: not a finite size >= 0.
    """
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(_with_unit(text, t, units, "", "size (e.g. 50G, 512M)"))


def parse_age(text: str) -> float:
    """``"30d"`` / ``"12h"`` / ``"90m"`` / ``"3600"`` -> seconds.

    Raises:
        ConfigError: not a finite duration >= 0.
    """
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    return _with_unit(text, text.strip().lower(), units, "s", "duration (e.g. 30d, 12h)")


def build_cached(
    recipe,
    options,
    cache: EngineCache,
    sources: dict[str, ModelSource] | None = None,
    on_event: Callable[[str, dict], None] | None = None,
) -> CacheResult:
    """The bundle of ``recipe`` built with ``options``, from ``cache`` or built into it.

    Args:
        recipe: a :class:`~edgebuild.recipe.Recipe` (Hub ids resolved here when ``sources``
            is None).
        options: :class:`~edgebuild.bundle.build.BuildOptions` (``force`` is implied: a
            refused entry is replaced).
        cache: the cache.
        sources: the recipe's references already resolved (:meth:`Recipe.resolved`).
        on_event: see :meth:`EngineCache.get_or_build`.

    Raises:
        CheckpointError / PairingError / ConfigError / EngineError / MissingDependencyError:
            as :func:`~edgebuild.bundle.build.build_bundle` (nothing is cached then).
    """
    from dataclasses import replace

    from edgebuild.bundle.build import build_bundle

    if sources is None:
        recipe, sources = recipe.resolved()
    key, material = cache_key(recipe, sources, options, probe_toolchain(options))

    def build(out: Path) -> None:
        build_bundle(recipe, out, replace(options, force=True), sources)

    return cache.get_or_build(key, material, build, on_event)
