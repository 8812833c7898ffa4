"""The speculative-decoding methods: one declarative record per method (STYLE.md habit 3).

Everything that lists or dispatches on a method derives from :data:`METHODS`: the
``--speculative-config`` parser and its error messages
(:class:`~edgebuild.speculative.config.SpeculativeConfig`), the CLI help, recipe validation
(:mod:`edgebuild.recipe`), the bundle role the draft engine gets (``edgebuild build``) and the
runtime's draft loader and decoder. The loaders and the decoder are named by import path
(``"package.module:attribute"``) and resolved only when used (:meth:`SpeculativeMethod.resolve`),
so this module imports neither the runtime nor the build (tests/test_layering.py).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from edgebuild.errors import ConfigError

__all__ = [
    "METHODS",
    "PLANNED_METHODS",
    "SpeculativeMethod",
    "get_method",
    "method_names",
    "speculative_help",
]


@dataclass(frozen=True)
class SpeculativeMethod:
    """One speculative-decoding method.

    Attributes:
        name: the ``method`` value of ``--speculative-config`` and of recipes.
        description: one line for help texts.
        config_parser: the draft checkpoint's config class (``from_dict(draft_cfg, target)``).
        torch_loader: ``(spec, target_source) -> loader(options) -> DraftBackend`` for the
            torch backend, validating the draft before the target is loaded.
        tensorrt_loader: the TensorRT backend's draft class (built over the ``bundle_role``
            engine by :func:`edgebuild.runtime.trt_backend.assemble_runtime`).
        decoder: ``(target, draft, num_speculative_tokens, confidence_threshold) -> decoder``.
        bundle_role: the bundle role (directory and manifest ``roles`` key) of the draft.
    """

    name: str
    description: str
    config_parser: str
    torch_loader: str
    tensorrt_loader: str
    decoder: str
    bundle_role: str = "draft"

    def resolve(self, field: str) -> Any:
        """The object an import-path field names (imports its module now).

        Raises:
            ValueError: ``field`` is not one of the import-path fields.
        """
        if field not in _PATH_FIELDS:
            raise ValueError(f"{field!r} is not an import-path field; one of {_PATH_FIELDS}")
        module, _, attr = getattr(self, field).partition(":")
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj


_PATH_FIELDS = ("config_parser", "torch_loader", "tensorrt_loader", "decoder")

METHODS: dict[str, SpeculativeMethod] = {
    m.name: m
    for m in (
        SpeculativeMethod(
            name="dspark",
            description="DSpark parallel block drafter with Markov and confidence heads",
            config_parser="edgebuild.checkpoint.dspark_config:DSparkConfig",
            torch_loader="edgebuild.runtime.dspark_loader:prepare_torch_draft",
            tensorrt_loader="edgebuild.runtime.trt.draft:TrtDraft",
            decoder="edgebuild.runtime.decoding:DSparkDecoder",
        ),
    )
}
# named in messages ("planned, not yet supported"); no record until implemented
PLANNED_METHODS: tuple[str, ...] = ("eagle3", "dflash")


def method_names() -> tuple[str, ...]:
    """The supported method names, in registry order (CLI and recipe choices)."""
    return tuple(METHODS)


def speculative_help() -> str:
    """The ``--speculative-config`` help text of the CLIs, listing the registry's methods."""
    return (
        f"JSON: method ({' | '.join(METHODS)}), model (draft dir), num_speculative_tokens"
        "[, draft_top_k, confidence_threshold, confidence_scheduling, quantization, token_map]"
        ', e.g. {"method":"dspark","model":DRAFT,'
        '"num_speculative_tokens":7}'
    )


def get_method(name: object, where: str = "--speculative-config") -> SpeculativeMethod:
    """The record of method ``name``.

    Raises:
        ConfigError: an unknown method, naming ``where`` and the supported ones (and saying
            so when it is a planned one).
    """
    if isinstance(name, str) and name in METHODS:
        return METHODS[name]
    planned = f" ({name} is planned, not yet supported)" if name in PLANNED_METHODS else ""
    raise ConfigError(f"{where}: unknown method {name!r}{planned}; supported: {', '.join(METHODS)}")
