"""Build and load edgebuild's C++ CPU kernels (``ops/kernels/*.cpp``) at first use.

Each source is compiled once with ``torch.utils.cpp_extension`` (g++ and ninja) into
``$EDGEBUILD_CACHE/kernels`` (the kernel cache alone), else ``$EDGEBUILD_CACHE_DIR/kernels``
(under the engine cache, which that variable moves), else ``$XDG_CACHE_HOME/edgebuild/kernels``,
else ``~/.cache/edgebuild/kernels``, in a folder named by the hash of the source, the flags, the
torch version and the CPU's flags (a ``-march=native`` build never runs on another CPU), then
loaded into the process as torch operators. A build takes ~10 s; later loads take
milliseconds. An flock per kernel keeps concurrent processes from building it twice (and a
build killed half-way from blocking later loads).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("edgebuild.runtime")


def cache_dir() -> Path:
    """Where compiled kernels live: ``kernels/`` under ``$EDGEBUILD_CACHE``, else under the
    engine cache's root (``$EDGEBUILD_CACHE_DIR``, :mod:`edgebuild.bundle.cache`, whose
    default is the same ``~/.cache/edgebuild``), so one variable moves both caches."""
    root = os.environ.get("EDGEBUILD_CACHE") or os.environ.get("EDGEBUILD_CACHE_DIR")
    if root:
        return Path(root).expanduser() / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "edgebuild" / "kernels"


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def why_not_x86(source: Path, flags: list[str], needs: set[str]) -> str | None:
    """None when a kernel library (``source`` built with ``flags``) that needs the CPU flags
    ``needs`` (as /proc/cpuinfo names them) can be tried on this host, else why not, in one
    line: not x86-64 Linux, the missing flags, or no compiler and no built copy in the cache."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"not an x86-64 Linux host ({platform.system()} {platform.machine()})"
    missing = set(needs) - cpu_flags()
    if missing:
        return f"the CPU lacks {', '.join(sorted(missing))}"
    if (
        shutil.which("g++") is None
        and shutil.which("c++") is None
        and prebuilt(source, flags) is None
    ):
        return "no C++ compiler (g++) on PATH to build it"
    return None


def try_library(
    source: Path, flags: list[str], needs: set[str], probe: Callable[[], str | None]
) -> tuple[str | None, bool]:
    """Build (once, cached) and load a kernel library that needs the CPU flags ``needs``, then
    ask ``probe`` (a call into the loaded library: None when it runs, else why not).

    Returns:
        (None, False) when the library runs here, else (why not in one line, whether the user
        can fix it: a missing compiler or a failed build, logged louder than a CPU that lacks
        the instructions).

    Raises:
        KeyboardInterrupt: the build was interrupted (:func:`build_and_load`).
    """
    why = why_not_x86(source, flags, needs)
    fixable = why is not None and "compiler" in why  # the CPU could run it: say so louder
    if why is None:
        try:
            build_and_load(source, flags)
            why = probe()
        except Exception as exc:  # a compiler or torch extension failure: fall back
            why = f"it could not be built or loaded ({first_error(exc)})"
            fixable = True
    return why, fixable


def library_name(source: Path, flags: list[str]) -> str:
    """The cache folder / library name of ``source`` built with ``flags`` here (the headers
    beside it, which the sources include, are part of the hash)."""
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    ident = b"\0".join(
        [source.read_bytes(), headers, " ".join(["-fopenmp", *flags]).encode(), torch.__version__.encode(),
         platform.machine().encode(), " ".join(sorted(cpu_flags())).encode()]
    )  # fmt: skip
    return f"edgebuild_{source.stem}_{hashlib.sha256(ident).hexdigest()[:16]}"


def prebuilt(source: Path, flags: list[str]) -> Path | None:
    """The cached library of ``source`` when it is there and intact (its sha256 equals the
    stamp written after the build that made it), else None."""
    name = library_name(source, flags)
    lib, stamp = cache_dir() / name / f"{name}.so", cache_dir() / name / f"{name}.so.sha256"
    try:
        return lib if stamp.read_text().strip() == _sha256(lib) else None
    except OSError:
        return None


def build_and_load(source: Path, flags: list[str]) -> None:
    """Load the cached library of ``source`` (checked against its stamp), else compile it with
    ``-O3 -fopenmp`` + ``flags``, stamp it and load its operators.

    ``-fopenmp``: ``at::parallel_for`` is an inline OpenMP region in torch's headers; without
    the flag it runs on one thread (measured: an int4 step's linears took the same 11 ms at 1
    and 2 threads). The library then shares torch's OpenMP runtime and thread count.

    A library that is intact loads without a compiler or ninja. One that does not match its
    stamp (a truncated file crashed the process with SIGBUS when loaded) is deleted and
    rebuilt. A process that finds another one building waits for it and says so.

    Ctrl-C during the build aborts it: SIGINT reaches ninja too, and its "interrupted by
    user" failure is raised as KeyboardInterrupt (not a build error the callers fall back
    from), also where the build runs off the main thread. No stamp is written, so the next
    run rebuilds; the flock is released.

    Raises:
        KeyboardInterrupt: the build was interrupted (:func:`interrupted`).
        Exception: whatever the compiler or ``torch.utils.cpp_extension`` raises; callers
            fall back to their torch path and say why in one line (:func:`first_error`).
    """
    lib = prebuilt(source, flags)
    if lib is not None:
        torch.ops.load_library(str(lib))
        return
    from torch.utils import cpp_extension

    name = library_name(source, flags)
    out = cache_dir() / name
    out.mkdir(parents=True, exist_ok=True)
    path = os.environ.get("PATH", "")
    bindir = str(Path(sys.executable).parent)  # the venv's ninja, when the venv is not active
    if bindir not in path.split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + path
    # torch's own lock is a file that a killed build leaves behind, and every later load then
    # waits for it forever; an flock dies with its holder, so under ours a leftover is stale
    with open(out.parent / f"{name}.lock", "a+") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process building %s (%s)", source.name, out)
            fcntl.flock(held, fcntl.LOCK_EX)
        try:
            lib = prebuilt(source, flags)  # the other process may have built it meanwhile
            if lib is not None:
                torch.ops.load_library(str(lib))
                return
            (out / "lock").unlink(missing_ok=True)
            (out / f"{name}.so").unlink(missing_ok=True)  # unstamped: maybe damaged, relink
            try:
                cpp_extension.load(
                    name=name, sources=[str(source)], extra_cflags=["-O3", "-fopenmp", *flags],
                    extra_ldflags=["-fopenmp"], build_directory=str(out), is_python_module=False,
                    verbose=False,
                )  # fmt: skip
            except Exception as exc:
                if interrupted(exc):  # Ctrl-C reached ninja: abort, as on the main thread
                    raise KeyboardInterrupt(f"building {source.name} was interrupted") from exc
                raise
            lib = out / f"{name}.so"
            tmp = out / f"{name}.so.sha256.tmp"
            tmp.write_text(_sha256(lib) + "\n")
            os.replace(tmp, out / f"{name}.so.sha256")  # atomic: a stamp is whole or absent
        finally:
            os.environ["PATH"] = path
            fcntl.flock(held, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def interrupted(exc: BaseException) -> bool:
    """Whether a ``cpp_extension`` build failure is ninja stopped by SIGINT (Ctrl-C), not a
    compiler error: ninja killed by the signal, or its "interrupted by user" message."""
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, subprocess.CalledProcessError) and cause.returncode == -signal.SIGINT:
        return True
    return "build stopped: interrupted by user" in str(exc)


def first_error(exc: BaseException) -> str:
    """The first line of a build failure that names an error (for a one-line log)."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return next((ln for ln in lines if "error" in ln.lower()), lines[-1]).strip()[:300]
