"""Builds of the TensorRT plugin library for the tests (cached by source content under build/).

Owns where the tests find their toolchain and the third-party TensorRT headers, and the three
builds they use:

* :func:`plugin_library`: the real ``libedgebuild_plugins.so`` (``attention_plugin.cpp`` with
  g++ against a TensorRT header version, ``attention_kernels.cu`` with nvcc for one SM, linked
  against libcudart): what TensorRT(-RTX) loads. Needs nvcc and the headers.
* :func:`emulated_plugin_library`: the same sources built with g++ only, under
  ``-DEB_KERNEL_EMULATION`` (``plugins/tests/cuda_emulation.h``), so that ``enqueue`` runs the
  real kernels on host memory. Needs only g++ and the headers. ``plugin_source`` builds a
  modified copy of the plugin source (the tests' deliberately broken variants).
* :func:`harness_executable`: ``plugins/tests/plugin_harness.cpp`` against the headers.

The headers are NVIDIA's open-source ``include/`` folders, one per TensorRT release
(:data:`TENSORRT_VERSIONS`), in ``shared/third_party/tensorrt/<version>/include`` next to the
repository or above it (or ``$EDGEBUILD_TENSORRT_HEADERS``). Every function skips the calling
test, with the reason, when a tool or the headers are missing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "plugins"
BUILD_DIR = ROOT / "build" / "plugin_tests"
TENSORRT_VERSIONS = ("10.3", "10.13", "11.1")
DEFAULT_VERSION = "10.13"  # JetPack 7 (Thor)

EMULATION_FLAGS = [
    "-std=c++20",
    "-O1",
    "-fPIC",
    "-U_FORTIFY_SOURCE",  # the fortified longjmp refuses the emulator's stack switches
    "-ffp-contract=off",
    "-DEB_KERNEL_EMULATION",
    f"-I{PLUGINS / 'include'}",
    f"-I{PLUGINS / 'tests' / 'emulation_include'}",  # <cuda_runtime_api.h> -> the emulation
    "-include",
    str(PLUGINS / "tests" / "cuda_emulation.h"),
]


def tensorrt_headers_root() -> Path | None:
    """The folder holding ``<version>/include`` (None if not found).

    ``$EDGEBUILD_TENSORRT_HEADERS``, else the first ``shared/third_party/tensorrt`` in the
    repository's parent folders (the repository may be a worktree deeper down).
    """
    env = os.environ.get("EDGEBUILD_TENSORRT_HEADERS")
    if env:
        return Path(env) if Path(env).is_dir() else None
    for parent in ROOT.parents:
        candidate = parent / "shared" / "third_party" / "tensorrt"
        if candidate.is_dir():
            return candidate
    return None


def tensorrt_include(version: str = DEFAULT_VERSION) -> Path:
    """``.../tensorrt/<version>/include``; skips the test when it is missing."""
    root = tensorrt_headers_root()
    include = root / version / "include" if root is not None else None
    if include is None or not (include / "NvInferRuntime.h").is_file():
        pytest.skip(
            f"TensorRT {version} headers not found (looked for shared/third_party/tensorrt/"
            f"{version}/include above {ROOT} and $EDGEBUILD_TENSORRT_HEADERS)"
        )
    return include


def find_gxx() -> str:
    """g++ on PATH; skips the test without it."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found on PATH: cannot build the plugin library")
    return gxx


def find_nvcc() -> str | None:
    """nvcc on PATH or in /usr/local/cuda/bin, else None."""
    nvcc = shutil.which("nvcc")
    if nvcc is None and Path("/usr/local/cuda/bin/nvcc").exists():
        nvcc = "/usr/local/cuda/bin/nvcc"
    return nvcc


def _cuda_home(nvcc: str) -> Path:
    home = Path(nvcc).resolve().parent.parent
    if (home / "include" / "cuda_runtime_api.h").is_file():
        return home
    return Path("/usr/local/cuda")


def _digest(parts: Sequence[str | Path]) -> str:
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, Path):
            h.update(str(part).encode() + b"\0" + part.read_bytes())
        else:
            h.update(str(part).encode() + b"\0")
    return h.hexdigest()[:16]


def _run(cmd: list[str], what: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        pytest.fail(f"{what} failed: {' '.join(cmd)}\n{result.stdout}\n{result.stderr[-6000:]}")


def _header_files() -> list[Path]:
    return sorted((PLUGINS / "include").rglob("*.h")) + [
        PLUGINS / "tests" / "cuda_emulation.h",
        PLUGINS / "tests" / "emulation_include" / "cuda_runtime_api.h",
    ]


def _cached(stem: str, suffix: str, inputs: Sequence[str | Path], build) -> Path:
    """``build(tmp_path)`` once per content of ``inputs``; returns ``<stem>-<digest><suffix>``."""
    out = BUILD_DIR / f"{stem}-{_digest(inputs)}{suffix}"
    if out.exists():
        return out
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    build(tmp)
    os.replace(tmp, out)
    return out


def plugin_library(version: str = DEFAULT_VERSION, arch: str = "90") -> Path:
    """The real plugin library for TensorRT ``version`` and ``sm_<arch>`` (cached).

    Skips the test when nvcc, g++ or the headers are missing.
    """
    include = tensorrt_include(version)
    gxx = find_gxx()
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, /usr/local/cuda/bin): cannot build the plugin library")
    cuda = _cuda_home(nvcc)
    kernels, plugin = (
        PLUGINS / "src" / "attention_kernels.cu",
        PLUGINS / "src" / "attention_plugin.cpp",
    )
    inputs = [version, arch, nvcc, kernels, plugin, *_header_files(), *sorted(include.glob("*.h"))]

    def build(tmp: Path) -> None:
        objs = tmp.parent / f".{tmp.name}.objs"
        objs.mkdir(exist_ok=True)
        _run(
            [
                nvcc,
                "-std=c++17",
                "-O1",
                "-Xcompiler=-fPIC,-fvisibility=hidden",
                f"-I{PLUGINS / 'include'}",
                "-gencode",
                f"arch=compute_{arch},code=sm_{arch}",
                "-c",
                str(kernels),
                "-o",
                str(objs / "kernels.o"),
            ],
            "nvcc attention_kernels.cu",
        )
        _run(
            [
                gxx,
                "-std=c++17",
                "-O1",
                "-fPIC",
                "-fvisibility=hidden",
                "-Wall",
                "-Wextra",
                f"-I{PLUGINS / 'include'}",
                f"-I{include}",
                f"-I{cuda / 'include'}",
                "-c",
                str(plugin),
                "-o",
                str(objs / "plugin.o"),
            ],
            "g++ attention_plugin.cpp",
        )
        _run(
            [
                gxx,
                "-shared",
                "-Wl,--no-undefined",
                str(objs / "plugin.o"),
                str(objs / "kernels.o"),
                f"-L{cuda / 'lib64'}",
                f"-Wl,-rpath,{cuda / 'lib64'}",
                "-lcudart",
                "-o",
                str(tmp),
            ],
            "link libedgebuild_plugins.so",
        )
        shutil.rmtree(objs, ignore_errors=True)

    return _cached(f"libedgebuild_plugins-trt{version}-sm{arch}", ".so", inputs, build)


def _emulated_kernels_object(gxx: str) -> Path:
    kernels = PLUGINS / "src" / "attention_kernels.cu"

    def build(tmp: Path) -> None:
        _run(
            [gxx, *EMULATION_FLAGS, "-x", "c++", "-c", str(kernels), "-o", str(tmp)],
            "g++ emulated attention_kernels.cu",
        )

    inputs = [*EMULATION_FLAGS, kernels, *_header_files()]
    return _cached("attention_kernels-emu", ".o", inputs, build)


def emulated_plugin_library(
    version: str = DEFAULT_VERSION, plugin_source: str | None = None, tag: str = ""
) -> Path:
    """The plugin library with the kernels under the CPU emulation (cached).

    Args:
        version: TensorRT header version.
        plugin_source: the text of a modified ``attention_plugin.cpp`` (default: the real one).
        tag: a name part for the cached file (e.g. the modification).

    Skips the test when g++ or the headers are missing.
    """
    include = tensorrt_include(version)
    gxx = find_gxx()
    real = PLUGINS / "src" / "attention_plugin.cpp"
    text = plugin_source if plugin_source is not None else real.read_text()
    kernels = _emulated_kernels_object(gxx)

    def build(tmp: Path) -> None:
        src = tmp.parent / f".{tmp.name}.cpp"
        src.write_text(text)
        obj = tmp.parent / f".{tmp.name}.o"
        flags = [*EMULATION_FLAGS, "-Wall", "-Wextra", f"-I{include}"]
        _run([gxx, *flags, "-c", str(src), "-o", str(obj)], "g++ emulated attention_plugin.cpp")
        _run(
            [gxx, "-shared", "-Wl,--no-undefined", str(obj), str(kernels), "-o", str(tmp)],
            "link emulated libedgebuild_plugins.so",
        )
        src.unlink()
        obj.unlink()

    stem = f"libedgebuild_plugins-emu-trt{version}{'-' + tag if tag else ''}"
    return _cached(stem, ".so", [version, text, kernels, *_header_files()], build)


def harness_executable(version: str = DEFAULT_VERSION) -> Path:
    """``plugins/tests/plugin_harness.cpp`` built against TensorRT ``version``'s headers."""
    include = tensorrt_include(version)
    gxx = find_gxx()
    source = PLUGINS / "tests" / "plugin_harness.cpp"
    flags = [*EMULATION_FLAGS, "-Wall", "-Wextra", f"-I{include}"]

    def build(tmp: Path) -> None:
        _run([gxx, *flags, str(source), "-ldl", "-o", str(tmp)], "g++ plugin_harness.cpp")

    return _cached(f"plugin_harness-trt{version}", "", [*flags, source, *_header_files()], build)
