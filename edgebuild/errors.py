"""The project's error types: every user-facing failure is one of these.

Each message names the file / tensor / field at fault and says how to fix it. The CLI and the
server print the message (never a torch or safetensors traceback).
"""

from __future__ import annotations

import os
from pathlib import Path


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


def _blocked(path: Path) -> Path:
    """The outermost folder of ``path`` this process may not enter (or list, for the nearest
    one), else ``path`` itself: what the user has to fix."""
    for parent in reversed(path.parents):
        if not os.access(parent, os.X_OK):
            return parent
    if path.parent != path and not os.access(path.parent, os.R_OK | os.X_OK):
        return path.parent
    return path


def unreadable(exc: OSError, path: str | Path | None = None) -> CheckpointError:
    """The CheckpointError for an OSError met while reading a model's files.

    The message names the path at fault (for a permission error: the folder that cannot be
    entered, else the file) and the fix, in one line, instead of the raw ``[Errno 13]``.

    Args:
        exc: the error ``open`` / ``stat`` / a directory listing raised.
        path: the path read, when ``exc`` does not carry it (``exc.filename``).
    """
    name = exc.filename if exc.filename is not None else path
    where = Path(os.fsdecode(name)) if name is not None else None
    if isinstance(exc, PermissionError) and where is not None:
        where = _blocked(where.absolute())
        return CheckpointError(
            f"{where}: permission denied (cannot read it as this user); give this user read "
            f"access (e.g. `chmod -R a+rX {where}`) or run as a user who can read it"
        )
    reason = exc.strerror or str(exc)
    return CheckpointError(f"{where or 'model file'}: cannot read it ({reason}); check the path")
