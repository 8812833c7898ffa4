"""Which runtime backend runs a model: ``torch`` (CPU) or ``tensorrt`` (engines), and why.

:func:`select_backend` is the one place that decides. ``auto`` takes TensorRT only when
everything it needs is here: a bundle (``manifest.json``) whose engines were built, with the
plugin graphs, for this GPU's SM and with the installed TensorRT version, a CUDA GPU visible to
torch (the TensorRT backend's device memory, streams and CUDA graphs are torch's) and the
``tensorrt`` module. Otherwise it falls back to torch and says why (every reason, not the
first one). ``tensorrt`` asked for explicitly refuses with the same reasons.

The machine facts come from :class:`HostProbe` (:func:`probe_host`), which tests replace.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from edgebuild.errors import ConfigError

BACKENDS = ("auto", "torch", "tensorrt", "onnxruntime")
MANIFEST_NAME = "manifest.json"  # edgebuild.bundle.manifest.MANIFEST_NAME (light import here)


@dataclass(frozen=True)
class BackendChoice:
    """The backend that will run the model (``torch`` or ``tensorrt``), and why."""

    name: str
    reason: str


@dataclass(frozen=True)
class HostProbe:
    """What this machine offers the TensorRT backend.

    Attributes:
        gpu: a CUDA GPU is visible to torch.
        gpu_sm: its compute capability as ``sm_XY`` (None: no GPU, or unknown).
        gpu_name: its name, for messages.
        tensorrt_version: the importable ``tensorrt`` module's version (None: not installed).
    """

    gpu: bool
    gpu_sm: str | None = None
    gpu_name: str | None = None
    tensorrt_version: str | None = None

    @classmethod
    def from_mapping(cls, probe: Mapping) -> HostProbe:
        """A probe from ``{"gpu": bool|"sm_XY", "tensorrt": bool|"X.Y.Z", "gpu_name": ...}``.

        Booleans say present/absent without details (an unknown SM or version then never
        matches a bundle's engines).
        """
        gpu, trt = probe.get("gpu", False), probe.get("tensorrt", False)
        return cls(
            gpu=bool(gpu),
            gpu_sm=gpu if isinstance(gpu, str) else None,
            gpu_name=probe.get("gpu_name"),
            tensorrt_version=trt if isinstance(trt, str) else ("unknown" if trt else None),
        )


def probe_host() -> HostProbe:
    """Probe torch's CUDA device and the ``tensorrt`` module (imported only if present)."""
    import torch

    gpu = torch.cuda.is_available()
    sm = name = None
    if gpu:
        major, minor = torch.cuda.get_device_capability()
        sm, name = f"sm_{major}{minor}", torch.cuda.get_device_name()
    version = None
    if importlib.util.find_spec("tensorrt") is not None:
        try:
            import tensorrt

            version = str(tensorrt.__version__)
        except Exception as exc:  # noqa: BLE001 - a broken install is reported, not raised
            version = f"unusable ({type(exc).__name__}: {exc})"
    return HostProbe(gpu=gpu, gpu_sm=sm, gpu_name=name, tensorrt_version=version)


def same_tensorrt_version(built: str, installed: str) -> bool:
    """Engines are only valid on the TensorRT they were built with: major.minor.patch equal."""
    return built.split(".")[:3] == installed.split(".")[:3]


def engines_sm(manifest: dict) -> tuple[str | None, str]:
    """(SM the bundle's engines were built for, where that came from).

    ``engines.sm`` when the build recorded the GPU it ran on; else the SM of ``build.device``
    (TensorRT builds for the GPU it runs on and the builder checks it is the recipe's device).
    """
    engines = manifest.get("engines") or {}
    if engines.get("sm"):
        return str(engines["sm"]), "engines.sm"
    from edgebuild.recipe import DEVICE_SUPPORT, Device

    device = (manifest.get("build") or {}).get("device")
    try:
        return DEVICE_SUPPORT[Device(device)][0], f"build.device {device!r}"
    except ValueError:
        return None, f"build.device {device!r}"


def _manifest(model: Path) -> tuple[dict | None, str | None]:
    path = model / MANIFEST_NAME
    if not path.is_file():
        return None, (
            f"{model} is a checkpoint, not a bundle (no {MANIFEST_NAME}), so there are no built "
            "*.engine files; build a bundle with `edgebuild build`"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"{path} is unreadable ({exc}), so no built *.engine files can be used"
    if not isinstance(manifest, dict):
        return None, f"{path} is not a manifest object"
    return manifest, None


def bundle_blockers(model: Path, manifest: dict, probe: HostProbe) -> list[str]:
    """Why this bundle's engines cannot run on this machine (empty: they can)."""
    out = []
    engines = manifest.get("engines") or {}
    roles = manifest.get("roles") or {}
    if engines.get("status") != "built" or not all(r.get("engine") for r in roles.values()):
        status = engines.get("status", "no engines entry")
        out.append(f"the bundle {model} has no built *.engine files ({status})")
        return out
    if engines.get("builder", "tensorrt") != "tensorrt" or manifest.get("graph_kind") != "plugin":
        out.append(
            f"the bundle's engines were built by {engines.get('builder')} from "
            f"{manifest.get('graph_kind')} graphs (TensorRT-RTX check builds), not by TensorRT "
            "from plugin graphs; rebuild on the device with `edgebuild build`"
        )
    built_sm, origin = engines_sm(manifest)
    if probe.gpu and probe.gpu_sm != built_sm:
        gpu = f"{probe.gpu_sm or 'of unknown SM'}" + (
            f" ({probe.gpu_name})" if probe.gpu_name else ""
        )
        out.append(
            f"the engines were built for {built_sm} ({origin}) but this GPU is {gpu}; "
            "engines run only on the SM they were built for: rebuild the bundle on this device"
        )
    built_trt = str(engines.get("builder_version") or "unknown")
    if probe.tensorrt_version and not same_tensorrt_version(built_trt, probe.tensorrt_version):
        out.append(
            f"TensorRT version mismatch: the engines were built with TensorRT {built_trt} but "
            f"TensorRT {probe.tensorrt_version} is installed; rebuild the engines with this "
            "TensorRT (`edgebuild build`) or install the one they were built with"
        )
    return out


def tensorrt_blockers(model: Path, probe: HostProbe) -> list[str]:
    """Every reason the TensorRT backend cannot run ``model`` here (empty: it can)."""
    model = Path(model)
    manifest, problem = (
        _manifest(model) if model.is_dir() else (None, f"{model} is not a directory")
    )
    out = [problem] if problem else bundle_blockers(model, manifest, probe)
    if not probe.gpu:
        out.append("no CUDA GPU visible (torch.cuda.is_available() is False)")
    if probe.tensorrt_version is None:
        out.append("the tensorrt Python module is not installed (JetPack / NGC TensorRT)")
    return out


def select_backend(
    requested: str, model_path: str | Path, probe: HostProbe | Mapping | None = None
) -> BackendChoice:
    """Pick the backend for ``model_path`` (module docstring).

    Args:
        requested: ``auto``, ``torch``, ``tensorrt`` or ``onnxruntime`` (a bundle's ONNX
            graphs on the CPU through the TensorRT backend's code; never chosen by ``auto``).
        model_path: a checkpoint or bundle directory.
        probe: the machine facts (default: :func:`probe_host`); a mapping is read by
            :meth:`HostProbe.from_mapping`.

    Raises:
        ConfigError: an unknown backend, ``tensorrt`` requested but not usable (the
            message lists every reason and the fix), or ``onnxruntime`` for a non-bundle.
    """
    if requested not in BACKENDS:
        raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    if requested == "torch":
        return BackendChoice("torch", "requested with --backend torch")
    if requested == "onnxruntime":
        if not (Path(model_path) / "manifest.json").is_file():
            raise ConfigError(
                f"--backend onnxruntime runs a bundle's ONNX graphs, and {model_path} is not a "
                "bundle; build one with `edgebuild build --onnx-only --dtype float32`"
            )
        return BackendChoice("onnxruntime", "requested: the bundle's ONNX graphs on the CPU")
    if probe is None:
        probe = probe_host()
    elif isinstance(probe, Mapping):
        probe = HostProbe.from_mapping(probe)
    blockers = tensorrt_blockers(Path(model_path), probe)
    if requested == "tensorrt":
        if blockers:
            raise ConfigError(
                f"--backend tensorrt cannot run {model_path}: {'; '.join(blockers)}. "
                "Use --backend torch (CPU) or build the engines on the device."
            )
        return BackendChoice("tensorrt", f"requested; {_found(probe)}")
    if blockers:
        return BackendChoice("torch", "TensorRT not usable: " + "; ".join(blockers))
    return BackendChoice("tensorrt", _found(probe))


def _found(probe: HostProbe) -> str:
    return (
        f"engines built for this GPU ({probe.gpu_sm}"
        + (f", {probe.gpu_name}" if probe.gpu_name else "")
        + f") with the installed TensorRT {probe.tensorrt_version}"
    )
