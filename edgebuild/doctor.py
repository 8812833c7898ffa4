"""`edgebuild doctor`: what this machine has (torch, TensorRT, GPU/SM, nvcc, plugin library)."""

from __future__ import annotations

import importlib.metadata as md
import platform
import shutil
import subprocess
from pathlib import Path

from edgebuild.engine.plugin_library import (
    plugin_build_hint,
    plugin_library_path,
    plugin_search_paths,
)

# the plugin path and hint are owned by edgebuild.engine.plugin_library; re-exported here
__all__ = ["plugin_build_hint", "plugin_library_path", "plugin_search_paths", "run_checks"]


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def run_checks() -> list[tuple[str, bool, str]]:
    """(name, ok, detail) rows; never raises."""
    rows: list[tuple[str, bool, str]] = [("python", True, platform.python_version())]
    import torch

    rows.append(("torch", True, f"{torch.__version__} (cuda build: {torch.version.cuda or 'no'})"))
    from edgebuild.runtime.cpu import cpu_bf16_support, default_cpu_threads, describe_cpu

    rows.append(("cpu", cpu_bf16_support().native, describe_cpu()))
    rows.append(("cpu threads", True, f"{default_cpu_threads()} intra-op (default: cores - 1)"))
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
