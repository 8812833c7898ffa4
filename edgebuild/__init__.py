"""edgebuild: Hugging Face checkpoints -> TensorRT engine bundles for NVIDIA Jetson.

Layers (see DESIGN.md): checkpoint -> models -> export -> engine -> bundle -> runtime -> serve.
A layer never imports from a layer that stands after it in that list.
"""

__version__ = "0.1.0"
