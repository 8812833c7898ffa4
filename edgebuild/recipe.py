"""Build recipes: which target + draft pair to build, for which Jetson, with which limits.

A recipe is a small YAML file (``recipes/*.yaml``)::

    name: smollm2-135m-dspark
    target: {path: examples/smollm2-135m}
    draft: {path: edgebuild/data/smollm2-135m-dspark}
    speculative: {method: dspark, num_speculative_tokens: 7, draft_top_k: 16,
                  confidence_threshold: 0.0}
    build: {device: thor, precision: bf16, max_batch_size: 1, max_input_len: 2048,
            max_kv_cache_capacity: 4096, page_size: 32,
            max_image_tokens: 1024, max_images: 4}   # the last two: VLM targets only

:func:`load_recipe` parses it (unknown keys and wrong types are refused, naming the field);
:meth:`Recipe.validate` checks the settings together (device vs precision, KV capacity vs
input length, ...) and names the field and the fix. Only settings are checked here: the
checkpoints themselves (formats, pairing) are checked at build time, so a recipe for weights
that are not on this machine still validates. Relative paths are resolved against the
recipe's directory first, then the project root (the nearest ancestor with
``pyproject.toml``), see :meth:`Recipe.resolve`.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from edgebuild.checkpoint.hub import ModelSource, resolve_model_ref
from edgebuild.errors import ConfigError
from edgebuild.speculative.registry import method_names

__all__ = ["Device", "Precision", "Recipe", "load_recipe"]

#: TensorRT-Edge-LLM chain mode: verify size <= 17, so at most 16 drafts per step.
MAX_SPECULATIVE_TOKENS = 16


class Device(str, Enum):
    """Target Jetson; the value is the recipe spelling."""

    THOR = "thor"  # Jetson Thor, Blackwell sm_110: FP4 and FP8 tensor cores
    ORIN = "orin"  # Jetson AGX Orin, Ampere sm_87: no FP8, no FP4


class Precision(str, Enum):
    """Engine compute precision of the target (the draft runs in FP16/BF16)."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    NVFP4 = "nvfp4"


#: device -> (SM name, precisions its tensor cores run)
DEVICE_SUPPORT: dict[Device, tuple[str, frozenset[Precision]]] = {
    Device.THOR: ("sm_110", frozenset(Precision)),
    Device.ORIN: ("sm_87", frozenset({Precision.BF16, Precision.FP16})),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelRef(_Strict):
    """A checkpoint: a local ``path`` (relative to the recipe or project root) and/or a Hub
    ``repo`` id with an optional ``revision`` (branch, tag or commit; default ``main``).

    With both, the local folder is used when it exists, else the Hub id is resolved (into the
    Hub cache, :mod:`edgebuild.checkpoint.hub`). At least one of ``path`` / ``repo`` is set.
    """

    path: str | None = None
    repo: str | None = None
    revision: str | None = None

    @model_validator(mode="after")
    def _one_of(self) -> ModelRef:
        if self.path is None and self.repo is None:
            raise ValueError("give 'path' (a local folder) or 'repo' (a Hub id), or both")
        if self.revision is not None and self.repo is None:
            raise ValueError("'revision' applies to a Hub 'repo'; add 'repo: ORG/NAME'")
        return self


class SpeculativeSettings(_Strict):
    method: str = "dspark"
    num_speculative_tokens: int = 7
    draft_top_k: int = 16
    confidence_threshold: float = 0.0


class BuildSettings(_Strict):
    """The ``build:`` section: target device, precision and the shapes the engines accept.

    Attributes:
        device, precision: see :class:`Device`, :class:`Precision`.
        max_batch_size: sequences per engine call.
        max_input_len: longest prompt in tokens (image tokens included).
        max_kv_cache_capacity: KV rows per sequence (prompt + generated + one verify block);
            the engines' pool holds ``max_batch_size`` of them. Not the server flag of the
            same name on the CPU backend, which is the whole pool: at run time the two are
            ``RuntimeOptions.max_seq_rows`` and ``RuntimeOptions.max_kv_rows``.
        page_size: rows per KV page (power of two <= 256).
        max_image_tokens: language-model tokens of all images of one vision pass (one
            request), i.e. merged patches; the ``visual`` engine accepts up to
            ``spatial_merge_size^2 * max_image_tokens`` patches. Used only when the target is
            a vision-language model; at most ``max_input_len`` (checked at build time). The
            full-attention blocks' scratch memory grows as ``max_images * (4 *
            max_image_tokens)^2`` fp32 values per head for a 2x2 merge: keep it as small as
            the images need (1024 tokens = one 896 x 896 image with Qwen2.5-VL).
        max_images: images in one vision pass (the engine's segment axis), <= max_image_tokens.
    """

    device: Device
    precision: Precision
    max_batch_size: int = 1
    max_input_len: int = 2048
    max_kv_cache_capacity: int = 4096
    page_size: int = 32
    max_image_tokens: int = 1024
    max_images: int = 4


class Recipe(_Strict):
    """A parsed recipe; ``source`` is the file it came from (for messages and paths)."""

    name: str
    description: str | None = None
    target: ModelRef
    draft: ModelRef | None = None
    speculative: SpeculativeSettings | None = None
    build: BuildSettings
    source: Path = Path("recipe.yaml")

    def _fail(self, field: str, problem: str, fix: str) -> None:
        raise ConfigError(f"{self.source}: field '{field}' {problem}; fix: {fix}")

    def validate(self) -> Recipe:
        """Check the settings together; returns self.

        Raises:
            ConfigError: naming the field and the fix (e.g. NVFP4 on Orin, a KV capacity
                smaller than the longest input, a draft without speculative settings).
        """
        self._validate_build()
        self._validate_speculative()
        return self

    def _validate_build(self) -> None:
        b = self.build
        sm, supported = DEVICE_SUPPORT[b.device]
        if b.precision not in supported:
            ok = ", ".join(sorted(p.value for p in supported))
            self._fail(
                "build.precision",
                f"is {b.precision.value!r} but Jetson {b.device.value} ({sm}) has no "
                f"{b.precision.value.upper()} tensor cores",
                f"use one of {ok} on {b.device.value}, or build for device 'thor' (sm_110)",
            )
        positive = ("max_batch_size", "max_input_len", "max_kv_cache_capacity", "page_size")
        for name in (*positive, "max_image_tokens", "max_images"):
            if getattr(b, name) < 1:
                self._fail(f"build.{name}", f"is {getattr(b, name)}", "use a positive integer")
        if b.max_images > b.max_image_tokens:
            self._fail(
                "build.max_images",
                f"is {b.max_images}, more than build.max_image_tokens ({b.max_image_tokens}); "
                "every image takes at least one token",
                f"lower it to at most {b.max_image_tokens} or raise build.max_image_tokens",
            )
        if b.page_size & (b.page_size - 1) or b.page_size > 256:
            self._fail(
                "build.page_size", f"is {b.page_size}", "use a power of two <= 256 (e.g. 32)"
            )
        n = self.speculative.num_speculative_tokens if self.speculative else 0
        need = b.max_input_len + n + 1
        if b.max_kv_cache_capacity < need:
            self._fail(
                "build.max_kv_cache_capacity",
                f"is {b.max_kv_cache_capacity}, less than max_input_len ({b.max_input_len}) + "
                f"one verify block ({n + 1})",
                f"raise it to at least {need} or lower build.max_input_len",
            )
        if b.max_kv_cache_capacity % b.page_size:
            self._fail(
                "build.max_kv_cache_capacity",
                f"is {b.max_kv_cache_capacity}, not a multiple of build.page_size ({b.page_size})",
                f"round it to {-(-b.max_kv_cache_capacity // b.page_size) * b.page_size}",
            )

    def _validate_speculative(self) -> None:
        s = self.speculative
        if self.draft is None:
            if s is not None:
                self._fail(
                    "speculative", "is set but there is no draft", "add 'draft: {path: ...}'"
                )
            return
        if s is None:
            self._fail("draft", "is set without speculative settings", "add 'speculative:'")
        if s.method not in method_names():  # the registry's methods
            self._fail(
                "speculative.method",
                f"is {s.method!r}",
                f"use one of {', '.join(method_names())}",
            )
        if not 1 <= s.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            self._fail(
                "speculative.num_speculative_tokens",
                f"is {s.num_speculative_tokens}",
                f"use 1..{MAX_SPECULATIVE_TOKENS} (at most the draft's block_size, checked at "
                "build time)",
            )
        if s.draft_top_k < 0:
            self._fail("speculative.draft_top_k", f"is {s.draft_top_k}", "use 0 (full) or more")
        if not 0.0 <= s.confidence_threshold < 1.0:
            self._fail(
                "speculative.confidence_threshold",
                f"is {s.confidence_threshold}",
                "use a value in [0, 1) (0 = off)",
            )

    # ------------------------------------------------------------------ paths
    def project_root(self) -> Path:
        """The nearest ancestor of the recipe file holding ``pyproject.toml`` (else the cwd)."""
        for parent in self.source.resolve().parents:
            if (parent / "pyproject.toml").is_file():
                return parent
        return Path.cwd()

    def resolve(self, ref: ModelRef) -> Path:
        """A checkpoint folder (:meth:`resolve_source`'s ``path``)."""
        return self.resolve_source(ref).path

    def _local_path(self, ref: ModelRef) -> Path | None:
        if ref.path is None:
            return None
        path = Path(ref.path).expanduser()
        if path.is_absolute():
            return path
        near = self.source.resolve().parent / path
        return near if near.exists() else self.project_root() / path

    def resolve_source(self, ref: ModelRef) -> ModelSource:
        """Where a reference's checkpoint is: the local ``path`` when it exists (absolute as
        is; relative to the recipe dir if that exists, else to the project root), else the
        ``repo`` resolved through the Hub cache; a ``path`` alone that does not exist is
        returned as is (weights are checked at build time).

        Raises:
            CheckpointError: a Hub id that cannot be resolved (names the fix).
        """
        local = self._local_path(ref)
        if local is not None and (local.is_dir() or ref.repo is None):
            return ModelSource(local, str(ref.path))
        return resolve_model_ref(ref.repo, ref.revision, what="recipe model")

    def resolved(self) -> tuple[Recipe, dict[str, ModelSource]]:
        """This recipe with every reference resolved to a local ``path`` (Hub ids downloaded
        if needed, once), and the sources by role (``target``, ``draft``) for the manifest.

        Raises:
            CheckpointError: a Hub id that cannot be resolved.
        """
        sources = {"target": self.resolve_source(self.target)}
        if self.draft is not None:
            sources["draft"] = self.resolve_source(self.draft)
        refs = {role: ModelRef(path=str(src.path)) for role, src in sources.items()}
        return self.model_copy(update=refs), sources

    def speculative_config(self) -> dict[str, Any] | None:
        """The runtime's ``--speculative-config`` dict, or None without a draft."""
        if self.draft is None or self.speculative is None:
            return None
        local = self._local_path(self.draft)
        if local is not None and (local.is_dir() or self.draft.repo is None):
            model = str(local)
        else:  # a Hub id: resolved when the config is parsed (nothing is fetched here)
            rev = f"@{self.draft.revision}" if self.draft.revision else ""
            model = f"{self.draft.repo}{rev}"
        return {"model": model, **self.speculative.model_dump()}


def _describe(err: dict) -> str:
    loc = ".".join(str(x) for x in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"field '{loc}' is not a recipe key (check the spelling)"
    if err["type"] == "missing":
        return f"field '{loc}' is required"
    return f"field '{loc}': {err['msg']} (got {err.get('input')!r})"


def load_recipe(path: str | Path) -> Recipe:
    """Parse and validate a recipe file.

    Raises:
        ConfigError: unreadable YAML, unknown keys, wrong types, or any :meth:`Recipe.validate`
            error; the message names the file and the field.
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: recipe not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe is a YAML mapping (name, target, build, ...)")
    if "source" in data:
        raise ConfigError(f"{path}: field 'source' is not a recipe key (check the spelling)")
    try:
        recipe = Recipe.model_validate({**data, "source": path})
    except ValidationError as exc:
        problems = "; ".join(_describe(e) for e in exc.errors())
        raise ConfigError(f"{path}: {problems}") from None
    return recipe.validate()
