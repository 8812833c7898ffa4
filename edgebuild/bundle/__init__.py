"""Bundles: a directory of exported graphs (+ engines), configs, tokenizer and ``manifest.json``.

Light on purpose (the runtime imports it): :mod:`edgebuild.bundle.manifest` reads, verifies
and resolves bundles without importing the exporter or TensorRT; the build pipeline is
:mod:`edgebuild.bundle.build` (imported lazily by the CLI).
"""

from edgebuild.bundle.manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    ResolvedModel,
    is_bundle,
    read_manifest,
    resolve_model_path,
    sha256_file,
    verify_bundle,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ResolvedModel",
    "is_bundle",
    "read_manifest",
    "resolve_model_path",
    "sha256_file",
    "verify_bundle",
]
