"""Build and load edgebuild's C++ CPU kernels (``ops/kernels/*.cpp``) at first use.

Each source is compiled once with ``torch.utils.cpp_extension`` (g++ and ninja) into
``$EDGEBUILD_CACHE/kernels`` (else ``$XDG_CACHE_HOME/edgebuild/kernels``, else
``~/.cache/edgebuild/kernels``), in a folder named by the hash of the source, the flags, the
torch version and the CPU's flags (a ``-march=native`` build never runs on another CPU), then
loaded into the process as torch operators. A build takes ~10 s; later loads take
milliseconds. An flock per kernel keeps concurrent processes from building it twice (and a
build killed half-way from blocking later loads).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import sys
from pathlib import Path

import torch


def cache_dir() -> Path:
    """Where compiled kernels live (module docstring)."""
    root = os.environ.get("EDGEBUILD_CACHE")
    if root:
        return Path(root) / "kernels"
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


def build_and_load(source: Path, flags: list[str]) -> None:
    """Compile ``source`` with ``-O3 -fopenmp`` + ``flags`` (cached) and load its operators.

    ``-fopenmp``: ``at::parallel_for`` is an inline OpenMP region in torch's headers; without
    the flag it runs on one thread (measured: an int4 step's linears took the same 11 ms at 1
    and 2 threads). The library then shares torch's OpenMP runtime and thread count.

    Raises:
        Exception: whatever the compiler or ``torch.utils.cpp_extension`` raises; callers
            fall back to their torch path and say why in one line (:func:`first_error`).
    """
    from torch.utils import cpp_extension

    ident = b"\0".join(
        [source.read_bytes(), " ".join(["-fopenmp", *flags]).encode(), torch.__version__.encode(),
         platform.machine().encode(), " ".join(sorted(cpu_flags())).encode()]
    )  # fmt: skip
    name = f"edgebuild_{source.stem}_{hashlib.sha256(ident).hexdigest()[:16]}"
    out = cache_dir() / name
    out.mkdir(parents=True, exist_ok=True)
    path = os.environ.get("PATH", "")
    bindir = str(Path(sys.executable).parent)  # the venv's ninja, when the venv is not active
    if bindir not in path.split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + path
    # torch's own lock is a file that a killed build leaves behind, and every later load then
    # waits for it forever; an flock dies with its holder, so under ours a leftover is stale
    with open(out.parent / f"{name}.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (out / "lock").unlink(missing_ok=True)
        try:
            cpp_extension.load(
                name=name, sources=[str(source)], extra_cflags=["-O3", "-fopenmp", *flags],
                extra_ldflags=["-fopenmp"], build_directory=str(out), is_python_module=False,
                verbose=False,
            )  # fmt: skip
        finally:
            os.environ["PATH"] = path
            fcntl.flock(held, fcntl.LOCK_UN)


def first_error(exc: BaseException) -> str:
    """The first line of a build failure that names an error (for a one-line log)."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return next((ln for ln in lines if "error" in ln.lower()), lines[-1]).strip()[:300]
