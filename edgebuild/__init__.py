"""edgebuild: Hugging Face checkpoints -> TensorRT engine bundles for NVIDIA Jetson.

Layers (see docs/ARCHITECTURE.md): ops -> checkpoint -> models -> export -> engine -> bundle -> runtime ->
serve, with ``speculative`` (config + method registry) and ``recipe`` beside them above
``checkpoint``. A layer never imports from a layer that stands after it; the runtime reads
bundles (``bundle.manifest``) but never imports export, engine (but for
``engine.plugin_library``) or ``bundle.build``. tests/test_layering.py holds the rules as data.
"""

__version__ = "0.1.0"
