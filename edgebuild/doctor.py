"""`edgebuild doctor`: what this machine has (torch, TensorRT, GPU/SM, nvcc, plugin library)."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import shutil
import subprocess
from pathlib import Path


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


PLUGIN_GLOB = "libedgebuild_plugins*.so"
PLUGIN_ENV = "EDGEBUILD_PLUGIN_LIB"


def source_checkout() -> Path | None:
    """The repository root when edgebuild runs from a checkout (it has ``plugins/``), else None.

    A wheel install puts the package in ``site-packages/`` with no ``plugins/`` beside it.
    """
    root = Path(__file__).resolve().parent.parent
    return root if (root / "plugins" / "CMakeLists.txt").is_file() else None


def plugin_search_paths() -> list[Path]:
    """Absolute paths where the plugin library is looked for, in order.

    ``$EDGEBUILD_PLUGIN_LIB`` when set; in a checkout also ``plugins/build/`` and
    ``build/plugins/`` (the two build folders the hints name). A wheel has no build folder.
    """
    paths = []
    env = os.environ.get(PLUGIN_ENV)
    if env:
        paths.append(Path(env).expanduser().resolve())
    root = source_checkout()
    if root is not None:
        paths += [root / "plugins" / "build", root / "build" / "plugins"]
    return paths


def plugin_library_path() -> Path | None:
    """The attention plugin library: ``$EDGEBUILD_PLUGIN_LIB`` (as given, even if missing),
    else the first ``libedgebuild_plugins*.so`` in a checkout's build folder, else None."""
    env = os.environ.get(PLUGIN_ENV)
    if env:
        return Path(env)
    for folder in plugin_search_paths():
        found = sorted(folder.glob(PLUGIN_GLOB)) if folder.is_dir() else []
        if found:
            return found[0]
    return None


def plugin_build_hint() -> str:
    """How to get the plugin library here, with the absolute paths that were searched."""
    searched = ", ".join(str(p) for p in plugin_search_paths()) or f"${PLUGIN_ENV} (not set)"
    root = source_checkout()
    if root is not None:
        src, out = root / "plugins", root / "plugins" / "build"
        how = (
            f"build it with `cmake -S {src} -B {out} -DTENSORRT_ROOT=... && cmake --build "
            f"{out}` (on the device, with its TensorRT headers) or set {PLUGIN_ENV}"
        )
    else:
        how = (
            f"this edgebuild is installed as a package ({Path(__file__).resolve().parent}), "
            "which ships no plugin sources: build plugins/ of the edgebuild source tree with "
            f"cmake on the device and set {PLUGIN_ENV} to the built .so"
        )
    return f"searched {searched}; {how}"


def run_checks() -> list[tuple[str, bool, str]]:
    """(name, ok, detail) rows; never raises."""
    rows: list[tuple[str, bool, str]] = [("python", True, platform.python_version())]
    import torch

    rows.append(("torch", True, f"{torch.__version__} (cuda build: {torch.version.cuda or 'no'})"))
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        rows.append(("gpu", True, f"{torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}"))
    else:
        rows.append(("gpu", False, "none: the torch CPU backend is used"))
    trt, rtx = _version("tensorrt"), _version("tensorrt-rtx-cu13") or _version("tensorrt_rtx")
    rows.append(
        ("tensorrt", bool(trt), trt or "not installed: engines cannot be built or run here")
    )
    rows.append(
        (
            "tensorrt-rtx",
            bool(rtx),
            rtx or "not installed (CPU parse/build checks of portable ONNX)",
        )
    )
    for dist in ("onnx", "onnxruntime", "nvidia-modelopt", "transformers"):
        v = _version(dist)
        rows.append((dist, bool(v), v or "not installed"))
    nvcc = shutil.which("nvcc") or (
        "/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists() else None
    )
    if nvcc:
        try:
            out = subprocess.run(
                [nvcc, "--version"], capture_output=True, text=True, timeout=20
            ).stdout
            rows.append(("nvcc", True, out.strip().splitlines()[-1]))
        except (OSError, subprocess.SubprocessError) as exc:
            rows.append(("nvcc", False, f"{nvcc}: {exc}"))
    else:
        rows.append(("nvcc", False, "not found: plugins cannot be compiled"))
    lib = plugin_library_path()
    rows.append(
        (
            "plugin library",
            bool(lib and lib.exists()),
            str(lib)
            if lib and lib.exists()
            else f"{'not found' if lib is None else f'{lib} does not exist'}: {plugin_build_hint()}",
        )
    )
    return rows
