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
PLUGIN_BUILD_DIR = Path(__file__).resolve().parents[2] / "plugins" / "build"
PLUGIN_BUILD_HINT = (
    "cmake -S plugins -B plugins/build -DTENSORRT_ROOT=<TensorRT or its headers> && "
    "cmake --build plugins/build -j"
)
TENSORRT_RTX_PLUGIN_LIMIT = (
    "TensorRT-RTX loads the plugin library and its ONNX parser creates the plugin from the "
    "node attributes (tests/test_engine_rtx_plugin.py checks that), but it cannot add plugin "
    "layers to a network, so it cannot build an engine from a plugin graph"
)


def plugin_library_path() -> Path | None:
    """The attention plugin library: ``$EDGEBUILD_PLUGIN_LIB``, else ``plugins/build/*.so``.

    Returns:
        The path (``$EDGEBUILD_PLUGIN_LIB`` as given, even if it does not exist, so that the
        caller's message names it), the first ``libedgebuild_plugins*.so`` in
        :data:`PLUGIN_BUILD_DIR`, or None when neither exists.
    """
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    found = (
        sorted(PLUGIN_BUILD_DIR.glob("libedgebuild_plugins*.so"))
        if PLUGIN_BUILD_DIR.is_dir()
        else []
    )
    return found[0] if found else None


def build_instructions() -> str:
    """How to get the library: the build command and the two ways to point edgebuild at it."""
    return (
        f"build it from this checkout with `{PLUGIN_BUILD_HINT}` (on the device, or anywhere "
        f"with nvcc and the TensorRT headers) and pass --plugin-library or set {ENV_VAR}"
    )
