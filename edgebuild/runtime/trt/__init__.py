"""The TensorRT backend in parts: ``buffers``, ``target``, ``draft``, ``visual``, ``runtime``
(loading). :mod:`edgebuild.runtime.trt_backend` re-exports the public names and describes the
backend as a whole."""
