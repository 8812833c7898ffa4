"""One draft plan: a DSpark draft and its target, opened, read and validated once.

:func:`pair_draft` is what `edgebuild run`, `edgellm-serve`, `edgebuild build` and `edgebuild
inspect --draft` call before any weight is loaded: it opens each checkpoint once (a target
already opened by the caller is reused, tagged "target", not re-read), parses the draft's
config once (both packagings: the top level, ``dflash_config``, ``dspark_config``;
:class:`~edgebuild.checkpoint.dspark_config.DSparkConfig`), and validates once: pairing
(hidden size, vocab, tokenizer, head; :meth:`PairedSources.validate`), the config (taps, mask
id, heads, block size, unimplemented fields), every tensor name and shape (``fc`` width, norms,
Markov and confidence heads; headers only) and the resolved ``lm_head`` / ``embed_tokens``
shapes. The :class:`DraftPlan` it returns carries all of that to the loaders (torch:
:meth:`edgebuild.models.dspark.DSparkDraft.from_plan`; export: the ``draft`` graph).

This module also owns the draft's tensor names (:func:`canonical_name`, the single
name-mapping rule) and shapes (:func:`expected_shapes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from edgebuild.checkpoint.config import ModelConfig
from edgebuild.checkpoint.dspark_config import DSparkConfig, MarkovHeadType
from edgebuild.checkpoint.pairing import PairedSources, Resolved
from edgebuild.checkpoint.quant import is_quant_aux_tensor
from edgebuild.checkpoint.shapes import check_shape, layer_linear_shapes
from edgebuild.checkpoint.source import COMPONENT, TARGET, WeightSource
from edgebuild.errors import CheckpointError, PairingError

__all__ = [
    "CheckedDraft",
    "DraftPlan",
    "canonical_name",
    "check_draft",
    "checked_config",
    "expected_shapes",
    "pair_draft",
]


@dataclass(frozen=True)
class DraftPlan:
    """A draft paired with its target and validated (:func:`pair_draft`).

    Attributes:
        target: the target checkpoint, tagged "target" (its tensors lend head / embedding).
        draft: the draft checkpoint, tagged "component".
        pair: the two as :class:`PairedSources`.
        target_config: the target's parsed config.
        config: the draft's config, validated, geometry from its tensor shapes.
        names: {canonical parameter name: stored tensor name} of the draft's tensors.
        lm_head, embed_tokens: the resolved ``[V, d]`` head / embedding (the draft's own or
            the target's; a QuantizedWeight stays quantized), each with its origin.
    """

    target: WeightSource
    draft: WeightSource
    pair: PairedSources
    target_config: ModelConfig
    config: DSparkConfig
    names: dict[str, str]
    lm_head: Resolved
    embed_tokens: Resolved

    @staticmethod
    def origin(resolved: Resolved) -> str:
        """``"<file>: <tensor name>"`` of a resolved tensor (for messages)."""
        return f"{resolved.file}: {resolved.name}"

    def provenance(self) -> dict[str, str]:
        """{role: "component" | "target"} of the draft's head and embedding."""
        return {
            "lm_head": self.lm_head.checkpoint_source,
            "embed_tokens": self.embed_tokens.checkpoint_source,
        }


def _opened(source: WeightSource | str | Path, tag: str) -> WeightSource:
    """``source`` as a WeightSource tagged ``tag``: opened here, reused, or re-tagged (a view
    that shares the already-read headers and config)."""
    if not isinstance(source, WeightSource):
        return WeightSource(source, tag)
    return source if source.checkpoint_source == tag else source.as_source(tag)


def pair_draft(
    target: WeightSource | str | Path,
    draft: WeightSource | str | Path,
    target_config: ModelConfig | None = None,
) -> DraftPlan:
    """Open (once), read (once) and validate (once) a DSpark draft against its target.

    Args:
        target: the target checkpoint directory, or its already opened WeightSource (reused;
            a "component" source is viewed as "target" without re-reading its files).
        draft: the draft checkpoint directory, or its opened WeightSource.
        target_config: the target's parsed config, when the caller has it.

    Returns:
        The :class:`DraftPlan` (module docstring for what was checked). Only safetensors
        headers and the resolved head / embedding are read.

    Raises:
        CheckpointError: unreadable checkpoints, missing / unexpected / mis-shaped tensors.
        ConfigError / PairingError / QuantFormatError: a draft that does not fit its target,
            naming the file and the field or tensor.
    """
    draft_source = _opened(draft, COMPONENT)
    target_source = _opened(target, TARGET)
    if target_config is None:
        target_config = ModelConfig.from_dict(
            target_source.config, source=str(target_source.config_path)
        )
    pair = PairedSources(draft_source, target_source)
    pair.validate()
    head, embed = pair.lm_head(), pair.embed_tokens()
    cfg, names = checked_config(
        draft_source,
        target_config,
        (head.shape, DraftPlan.origin(head)),
        (embed.shape, DraftPlan.origin(embed)),
    )
    return DraftPlan(target_source, draft_source, pair, target_config, cfg, names, head, embed)


# ---------------------------------------------------------------------------- validation
def checked_config(
    source: WeightSource,
    target_config: ModelConfig,
    lm_head: tuple[tuple[int, ...], str],
    embed_tokens: tuple[tuple[int, ...], str],
) -> tuple[DSparkConfig, dict[str, str]]:
    """Config, tensor names, shapes and the resolved ``[V, d]`` tensors, checked (headers only).

    ``lm_head`` / ``embed_tokens``: (logical shape, origin for messages) of the resolved tensors.
    Returns the config with the tensor-derived geometry and {canonical name: stored name}. The
    config is validated once (:meth:`DSparkConfig.from_dict`); what the tensors may change
    (geometry, ``fc`` width) is re-checked by :meth:`DSparkConfig.check_stored`.
    """
    cfg = DSparkConfig.from_dict(source.config, target_config, str(source.config_path))
    names = _canonical_names(source)
    shapes = {canon: _logical_shape(source, orig) for canon, orig in names.items()}
    geometry = cfg.with_tensor_geometry(shapes)
    fc_shape = shapes.get("fc.weight", ())
    geometry.check_stored(
        fc_in_features=fc_shape[1] if len(fc_shape) == 2 else None,
        geometry_changed=geometry is not cfg,
    )
    cfg = geometry
    _check_tensors(source, cfg, names, shapes, expected_shapes(cfg))
    _check_resolved(cfg, lm_head[0], lm_head[1], "lm_head")
    _check_resolved(cfg, embed_tokens[0], embed_tokens[1], "embed_tokens")
    return cfg, names


@dataclass(frozen=True)
class CheckedDraft:
    """A draft validated against its target by :func:`check_draft`.

    Attributes:
        config: the draft's config, geometry from its tensor shapes.
        lm_head, embed_tokens: the resolved head / embedding (the draft's own or the target's).
    """

    config: DSparkConfig
    lm_head: Resolved
    embed_tokens: Resolved


def check_draft(pair: PairedSources, target_config: ModelConfig) -> CheckedDraft:
    """The one validation of a DSpark draft against its target, before any weight is loaded.

    :func:`pair_draft` (what `edgebuild run`, the server, `edgebuild build` and `edgebuild
    inspect --draft` call) runs these checks, and so does
    :meth:`~edgebuild.models.dspark.DSparkDraft.from_source`: pairing (hidden size,
    vocab, tokenizer, head; :meth:`PairedSources.validate`), the config (:class:`DSparkConfig`:
    taps, mask id, heads, block size, unimplemented fields), every tensor name and shape
    (``fc`` width, norms, Markov and confidence heads) and the resolved ``lm_head`` /
    ``embed_tokens`` shapes. Only safetensors headers and the resolved head / embedding are read.

    Raises:
        ConfigError / PairingError / CheckpointError / QuantFormatError: naming the file and
            the field or tensor.
    """
    pair.validate()
    head, embed = pair.lm_head(), pair.embed_tokens()
    cfg, _ = checked_config(
        pair.draft,
        target_config,
        (head.shape, f"{head.file}: {head.name}"),
        (embed.shape, f"{embed.file}: {embed.name}"),
    )
    return CheckedDraft(cfg, head, embed)


# ---------------------------------------------------------------------------- names and shapes
# Legacy SpecForge nesting (spec §1.2; SpecForge dflash.py normalize_draft_head_checkpoint_keys).
_LEGACY_PREFIXES = (
    ("logit_head.markov_head.", "markov_head."),
    ("logit_head.confidence_head.", "confidence_head."),
)
# Resolved by the caller (PairedSources), never loaded from the draft by this module.
_RESOLVED_PREFIXES = ("lm_head.", "embed_tokens.")


def canonical_name(name: str) -> str:
    """The parameter name of checkpoint tensor ``name``: the single name-mapping rule.

    Drops one leading ``model.`` and maps the legacy ``logit_head.markov_head.`` /
    ``logit_head.confidence_head.`` nesting to ``markov_head.`` / ``confidence_head.``
    (spec §1.2). ``model.layers.0.fc`` -> ``layers.0.fc``; DeepSpec names are unchanged.
    """
    if name.startswith("model."):
        name = name[len("model.") :]
    for old, new in _LEGACY_PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _canonical_names(source: WeightSource) -> dict[str, str]:
    """{canonical name: stored name}; raises CheckpointError when two names collide."""
    out: dict[str, str] = {}
    for name in source.names():
        canon = canonical_name(name)
        if canon in out:
            raise CheckpointError(
                f"{source.path}: tensors '{out[canon]}' and '{name}' are the same parameter "
                f"'{canon}'; keep one of them"
            )
        out[canon] = name
    return out


def _logical_shape(source: WeightSource, name: str) -> tuple[int, ...]:
    """Stored shape, with NVFP4's two codes per byte unpacked."""
    info = source.info(name)
    prefix = name.rpartition(".")[0]
    if info.dtype == torch.uint8 and f"{prefix}.weight_scale" in source:
        return (info.shape[0], info.shape[1] * 2)
    return tuple(info.shape)


def expected_shapes(cfg: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """Canonical tensor names -> shapes a checkpoint of ``cfg`` must hold (spec §1.2).

    Excludes ``embed_tokens`` and ``lm_head`` (resolved by the caller).
    """
    d, hq, hkv, hd, i = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    )
    out: dict[str, tuple[int, ...]] = {}
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}"
        linears = layer_linear_shapes(d, hq, hkv, hd, i)
        for name, shape in linears.items():
            out[f"{p}.{name}.weight"] = shape
            if cfg.attention_bias and name.startswith("self_attn."):
                out[f"{p}.{name}.bias"] = (shape[0],)
        out[f"{p}.self_attn.q_norm.weight"] = (hd,)
        out[f"{p}.self_attn.k_norm.weight"] = (hd,)
        out[f"{p}.input_layernorm.weight"] = (d,)
        out[f"{p}.post_attention_layernorm.weight"] = (d,)
    out["fc.weight"] = (d, cfg.fc_in_features)
    out["hidden_norm.weight"] = (d,)
    out["norm.weight"] = (d,)
    r, v = cfg.markov_rank, cfg.vocab_size
    if cfg.head_type is not None:
        out["markov_head.markov_w1.weight"] = (v, r)
        out["markov_head.markov_w2.weight"] = (v, r)
        if cfg.head_type is MarkovHeadType.GATED:
            out["markov_head.gate_proj.weight"] = (r, d + r)
            out["markov_head.gate_proj.bias"] = (r,)
        elif cfg.head_type is MarkovHeadType.RNN:
            out["markov_head.joint_proj.weight"] = (3 * r, 2 * r + d)
            out["markov_head.joint_proj.bias"] = (3 * r,)
    if cfg.enable_confidence_head:
        out["confidence_head.proj.weight"] = (1, cfg.confidence_in_features)
        out["confidence_head.proj.bias"] = (1,)
    return out


_SHAPE_HINTS = {
    "markov_head.": "markov_rank / markov_head_type",
    "confidence_head.": "enable_confidence_head / confidence_head_with_markov / markov_rank",
    "fc.": "target_layer_ids / hidden_size",
}


def _ignored(canon: str) -> bool:
    return (
        canon.startswith(_RESOLVED_PREFIXES)
        or canon.endswith("rotary_emb.inv_freq")
        or is_quant_aux_tensor(canon)
    )


def _check_tensors(
    source: WeightSource,
    cfg: DSparkConfig,
    names: dict[str, str],
    shapes: dict[str, tuple[int, ...]],
    expected: dict[str, tuple[int, ...]],
) -> None:
    """Missing, unexpected, mis-shaped or non-float tensors -> CheckpointError (file + tensor)."""
    where = str(source.path)
    missing = [n for n in expected if n not in names]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(
            f"{where}: missing tensors {missing[:5]}{more}; the checkpoint is incomplete or does "
            f"not match {cfg.source} ({cfg.num_hidden_layers} layers, markov_rank "
            f"{cfg.markov_rank} '{cfg.markov_head_type}', confidence head "
            f"{cfg.enable_confidence_head})"
        )
    unexpected = [names[n] for n in names if n not in expected and not _ignored(n)]
    if unexpected:
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise CheckpointError(
            f"{where}: unexpected tensors {unexpected[:5]}{more} for {cfg.source} "
            f"({cfg.num_hidden_layers} layers, markov_rank {cfg.markov_rank} "
            f"'{cfg.markov_head_type}', confidence head {cfg.enable_confidence_head}); check "
            "markov_head_type / enable_confidence_head, or that config.json belongs to these "
            "weights (a vocabulary map 'd2t' is not supported)"
        )
    for canon, shape in expected.items():
        info = source.info(names[canon])
        hint = next((h for p, h in _SHAPE_HINTS.items() if canon.startswith(p)), "")
        check_shape(names[canon], str(info.file), shapes[canon], shape, hint)
        if not (info.dtype.is_floating_point or info.dtype == torch.uint8):
            raise CheckpointError(
                f"{info.file}: tensor '{names[canon]}' has dtype {info.dtype}, expected a "
                "floating-point or packed NVFP4 (uint8) weight"
            )


def _check_resolved(cfg: DSparkConfig, shape: tuple[int, ...], origin: str, role: str) -> None:
    """The resolved head / embedding must be ``[V, d]`` of the draft (PairingError otherwise)."""
    want = (cfg.vocab_size, cfg.hidden_size)
    if shape != want:
        raise PairingError(
            f"{origin}: {role} has shape {list(shape)} but the draft ({cfg.source}) needs "
            f"{list(want)} (vocab_size, hidden_size): the Markov bias and the block ids use the "
            "draft's vocabulary; pair the draft with the target it was trained for"
        )
