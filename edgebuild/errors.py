"""The project's error types: every user-facing failure is one of these.

Each message names the file / tensor / field at fault and says how to fix it. The CLI and the
server print the message (never a torch or safetensors traceback).
"""

from __future__ import annotations


class EdgebuildError(Exception):
    """Base class of every error edgebuild raises on purpose (bad input, missing tool)."""


class CheckpointError(EdgebuildError):
    """A checkpoint directory, file, tensor or config field is missing, corrupt or inconsistent."""


class ConfigError(EdgebuildError):
    """A config value (model config, recipe, speculative config) is invalid."""


class PairingError(CheckpointError):
    """A draft checkpoint does not fit its target checkpoint (hidden size, vocab, taps...)."""


class QuantFormatError(CheckpointError):
    """A quantization config or quantized tensor set is unsupported or malformed."""


class MissingDependencyError(EdgebuildError):
    """An optional dependency (TensorRT, ModelOpt, onnx...) is needed but not installed."""


class EngineError(EdgebuildError):
    """TensorRT could not parse a graph or build an engine (the message carries its errors)."""


class BundleError(EdgebuildError):
    """A bundle directory is missing files, has a changed hash or an unknown format version."""


class RequestError(EdgebuildError):
    """A generation request is invalid (empty prompt, too long, bad sampling params)."""
