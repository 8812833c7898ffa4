"""The attention plugin library's file: where it is looked for, how it is built, what can load it.

The one owner of these facts (the engine builder, the TensorRT runtime backend, ``edgebuild
doctor`` and ``scripts/gpu_check_engines.py`` all use it):

* :func:`plugin_library_path`: ``$EDGEBUILD_PLUGIN_LIB``, else ``libedgebuild_plugins*.so`` in
  :data:`PLUGIN_BUILD_DIR` (``plugins/build`` of this checkout, where :data:`PLUGIN_BUILD_HINT`
  builds it).
* :data:`TENSORRT_RTX_PLUGIN_LIMIT`: what TensorRT-RTX (the CPU-only builder of the tests)
  can and cannot do with the plugin. It loads the library into its plugin registry and its ONNX
  parser creates the plugin from each node's attributes, so it checks the library, the creator
  and the attribute mapping; it cannot add a plugin layer to a network, so it cannot build an
  engine from a plugin graph (that needs TensorRT on the Jetson).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "EDGEBUILD_PLUGIN_LIB"
PLUGIN_GLOB = "libedgebuild_plugins*.so"
_ROOT = Path(__file__).resolve().parents[2]
PLUGIN_BUILD_DIR = _ROOT / "plugins" / "build"
PLUGIN_BUILD_HINT = (
    f"cmake -S {_ROOT / 'plugins'} -B {PLUGIN_BUILD_DIR} -DTENSORRT_ROOT=<TensorRT or its "
    f"headers> && cmake --build {PLUGIN_BUILD_DIR} -j"
)
TENSORRT_RTX_PLUGIN_LIMIT = (
    "TensorRT-RTX loads the plugin library and its ONNX parser creates the plugin from the "
    "node attributes (tests/test_engine_rtx_plugin.py checks that), but it cannot add plugin "
    "layers to a network, so it cannot build an engine from a plugin graph"
)


def source_checkout() -> Path | None:
    """The repository root when edgebuild runs from a checkout (it has ``plugins/``), else None.

    A wheel install puts the package in ``site-packages/`` with no ``plugins/`` beside it.
    """
    return _ROOT if (_ROOT / "plugins" / "CMakeLists.txt").is_file() else None


def plugin_search_paths() -> list[Path]:
    """Absolute paths where the plugin library is looked for, in order.

    ``$EDGEBUILD_PLUGIN_LIB`` when set; in a checkout also :data:`PLUGIN_BUILD_DIR` (where
    :data:`PLUGIN_BUILD_HINT` builds it). A wheel has no build folder.
    """
    paths = []
    env = os.environ.get(ENV_VAR)
    if env:
        paths.append(Path(env).expanduser().resolve())
    if source_checkout() is not None:
        paths.append(PLUGIN_BUILD_DIR)
    return paths


def plugin_library_path() -> Path | None:
    """The attention plugin library.

    Returns:
        ``$EDGEBUILD_PLUGIN_LIB`` as given (even if it does not exist, so that the caller's
        message names it), else the first ``libedgebuild_plugins*.so`` in a checkout's
        :data:`PLUGIN_BUILD_DIR`, else None.
    """
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    if source_checkout() is None:
        return None
    found = sorted(PLUGIN_BUILD_DIR.glob(PLUGIN_GLOB)) if PLUGIN_BUILD_DIR.is_dir() else []
    return found[0] if found else None


def plugin_build_hint() -> str:
    """How to get the plugin library here, with the absolute paths that were searched."""
    searched = ", ".join(str(p) for p in plugin_search_paths()) or f"${ENV_VAR} (not set)"
    if source_checkout() is not None:
        how = (
            f"build it with `{PLUGIN_BUILD_HINT}` (on the device, or anywhere with nvcc and "
            f"the TensorRT headers) or set {ENV_VAR}"
        )
    else:
        how = (
            f"this edgebuild is installed as a package ({Path(__file__).resolve().parents[1]}), "
            "which ships no plugin sources: build plugins/ of the edgebuild source tree with "
            f"cmake on the device and set {ENV_VAR} to the built .so"
        )
    return f"searched {searched}; {how}"


def build_instructions() -> str:
    """:func:`plugin_build_hint`, plus the builder's own way to name the library."""
    return f"{plugin_build_hint()}; the builder also takes --plugin-library"
