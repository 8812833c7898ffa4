"""The DSpark draft's config: both packagings, the one field reader, validation against the target.

Owns (spec/draft-checkpoint-formats.md, cited as "spec §N"):

* :class:`DSparkConfig`: both packagings (DeepSpec ``Qwen3DSparkModel``, SpecForge / RadixArk
  ``DSparkDraftModel``), parsed from the top level, ``dflash_config`` and ``dspark_config``
  (spec §1.1, §6.1), and ``validate()`` against the target (spec §1.5, §6.3-§6.8). Fields with
  values edgebuild does not implement are refused by name (:func:`_check_layout`).
* :func:`read_dspark_field`: the one reader of draft config fields, also used for the
  speculative config's ``draft_top_k`` default and the build's ``num_speculative_tokens``.

It lives in ``checkpoint`` (no torch modules) so that the speculative config, recipes and the
draft plan (:mod:`edgebuild.checkpoint.draft`) read draft configs without importing models;
:mod:`edgebuild.models.dspark` re-exports it with the draft model.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from edgebuild.checkpoint.config import ModelConfig
from edgebuild.errors import ConfigError, PairingError
from edgebuild.ops.rope import RopeScaling

log = logging.getLogger("edgebuild.checkpoint")

__all__ = [
    "DSparkConfig",
    "DSparkPackaging",
    "MarkovHeadType",
    "SUPPORTED_MARKOV_HEADS",
    "default_target_layer_ids",
    "read_dspark_field",
]


class DSparkPackaging(str, Enum):
    """How a DSpark checkpoint is packaged; the value is its ``architectures[0]`` (spec §1.1)."""

    DEEPSPEC = "Qwen3DSparkModel"  # fields at the top level; ships embed_tokens + lm_head
    SPECFORGE = "DSparkDraftModel"  # fields in dflash_config / dspark_config; no embed, no head


class MarkovHeadType(str, Enum):
    """Markov head variants (spec §1.3); the value is the config's ``markov_head_type``."""

    VANILLA = "vanilla"
    GATED = "gated"
    RNN = "rnn"


SUPPORTED_MARKOV_HEADS: tuple[str, ...] = tuple(t.value for t in MarkovHeadType)

# Sub-dicts that may carry the DSpark keys besides the top level (spec §1.1, §6.1).
_SECTIONS = ("dspark_config", "dflash_config")
_MISSING = object()
_DEFAULT = "default"


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Taps used when a config has none: ``round(1 + i*(n-4)/(L-1))``, or ``[n//2]`` if L = 1.

    Same rule as SpecForge / z-lab ``build_target_layer_ids`` (spec §1.5): n = 36, L = 5 gives
    ``(1, 9, 17, 25, 33)``. Python's ``round`` (half to even) as in the reference.
    """
    n, layers = num_target_layers, num_draft_layers
    if layers == 1:
        return (n // 2,)
    return tuple(int(round(1 + i * (n - 4) / (layers - 1))) for i in range(layers))


def _typed(value: Any, kind: type, where: str, source: str) -> Any:
    """Check a config value's type; ``bool`` is not an ``int`` here."""
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if kind is list:
        ok = isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        )
    if not ok:
        want = "a list of integers" if kind is list else kind.__name__
        raise ConfigError(f"{source}: field '{where}' must be {want}, got {value!r}")
    return value


def read_dspark_field(
    cfg: Mapping, key: str, kind: type, source: str, default: Any = _MISSING
) -> tuple[Any, str]:
    """A DSpark key read from ``dspark_config``, ``dflash_config`` and the top level.

    The one reader of draft config fields: :class:`DSparkConfig`, the runtime's
    ``draft_top_k`` default and the build flags' ``num_speculative_tokens`` default all use it,
    so a field means the same wherever it is written (spec §1.1, §6.1).

    Returns ``(value, where)`` with ``where`` the field path (for messages) or "default".

    Raises:
        ConfigError: missing without a default, a section that is not an object, a wrong type,
            or two locations that disagree (e.g. top-level vs ``dflash_config``).
    """
    hits: list[tuple[str, Any]] = []
    for section in _SECTIONS:
        sub = cfg.get(section)
        if sub is None:
            continue
        if not isinstance(sub, dict):
            raise ConfigError(f"{source}: '{section}' must be an object, got {sub!r}")
        if sub.get(key) is not None:
            hits.append((f"{section}.{key}", sub[key]))
    if cfg.get(key) is not None:
        hits.append((key, cfg[key]))
    if not hits:
        if default is _MISSING:
            raise ConfigError(
                f"{source}: required DSpark field '{key}' is missing; set it at the top level, "
                "in 'dflash_config' or in 'dspark_config'"
            )
        return default, _DEFAULT
    where, value = hits[0]
    for other_where, other in hits[1:]:
        if other != value:
            raise ConfigError(
                f"{source}: '{where}' = {value!r} disagrees with '{other_where}' = {other!r}; "
                "keep one value"
            )
    return _typed(value, kind, where, source), where


def _top(cfg: Mapping, key: str, kind: type, source: str, default: Any = _MISSING) -> Any:
    """A top-level config value (geometry keys), type-checked."""
    value = cfg.get(key)
    if value is None:
        if default is _MISSING:
            raise ConfigError(f"{source}: required field '{key}' is missing")
        return default
    return _typed(value, kind, key, source)


def _rope_dict_key(cfg: Mapping) -> str | None:
    """Which key holds the rope dict: ``rope_parameters`` (v5) or ``rope_scaling`` (v4)."""
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(cfg.get(key), dict) and cfg[key]:
            return key
    return None


def _text_rope_config(cfg: Mapping) -> dict:
    """``cfg`` without multimodal RoPE keys (DeepSpec configs copy them from a VL target).

    With equal t/h/w positions (text), mrope equals the 1-D rope, so dropping
    ``mrope_section`` / ``mrope_interleaved`` is exact for the draft (spec §6.1).
    """
    out = dict(cfg)
    key = _rope_dict_key(cfg)
    if key is not None and "mrope_section" in cfg[key]:
        params = {
            k: v for k, v in cfg[key].items() if k not in ("mrope_section", "mrope_interleaved")
        }
        if params.get("rope_type", params.get("type")) == "mrope":
            params.pop("type", None)
            params["rope_type"] = "default"
        out[key] = params
    return out


def _declares_theta(cfg: Mapping) -> bool:
    key = _rope_dict_key(cfg)
    return "rope_theta" in cfg or (key is not None and "rope_theta" in cfg[key])


def _draft_rope(cfg: Mapping, target: ModelConfig, source: str) -> RopeScaling:
    """The draft's RoPE (spec §6.1, §7): its own scaling, else the target's; full head_dim.

    * rope read from ``rope_parameters`` or ``rope_scaling`` (mrope keys dropped).
    * no scaling in the draft (type ``default``) while the target scales (e.g. yarn): the
      draft takes the target's scaling; ``rope_theta`` stays the draft's when it declares one.
    * ``partial_rotary_factor`` is forced to 1: DeepSpec configs inherit it from the target,
      but the draft rotates the full head_dim (spec §7).
    """
    own = RopeScaling.from_hf_config(_text_rope_config(cfg), source=source)
    rope = own
    if own.rope_type == "default" and target.rope.rope_type != "default":
        theta = own.rope_theta if _declares_theta(cfg) else target.rope.rope_theta
        rope = dataclasses.replace(target.rope, rope_theta=theta)
        log.info(
            "%s: draft has no rope scaling; using the target's %s scaling (%s)",
            source,
            target.rope.rope_type,
            target.source,
        )
    if rope.partial_rotary_factor != 1.0:
        log.info(
            "%s: ignoring inherited partial_rotary_factor; DSpark rotates all of head_dim", source
        )
        rope = dataclasses.replace(rope, partial_rotary_factor=1.0)
    return rope


# Every key a ``dspark_config`` / ``dflash_config`` section may hold: parsed by DSparkConfig,
# checked (:func:`_check_layout`, :meth:`DSparkConfig.validate`) or inert. Any other key is
# refused by name.
_PARSED_KEYS = frozenset(
    {
        "block_size",
        "mask_token_id",
        "target_layer_ids",
        "num_target_layers",
        "markov_rank",
        "markov_head_type",
        "enable_confidence_head",
        "confidence_head_with_markov",
        "attention_mode",
        "projector_type",
        "markov_topk",  # the runtime's draft_top_k default (edgebuild.speculative.config)
    }
)
# Keys that do not change inference: training settings (loss weight, anchors sampled per
# sequence) and TensorRT-Edge-LLM's sidecar file names (edgebuild reads the heads' tensors
# from the checkpoint; missing tensors are refused by the tensor check).
_INERT_KEYS = frozenset({"confidence_head_alpha", "num_anchors", "heads_file", "heads_info_file"})
# Layout flags (vLLM / DFlash spellings) -> the one value edgebuild implements. DSpark rows are
# all-predicting (row 0, the anchor, predicts s+1; spec §3), attention is non-causal over the
# whole context and block, RoPE is the half-split (neox) form (spec §7), no sliding window.
_IMPLEMENTED_FLAGS: dict[str, Any] = {
    "sample_from_anchor": True,
    "query_zero_predicts_next": True,
    "causal": False,
    "is_causal": False,
    "is_neox_style": True,
}
_SECTION_KEYS = (
    _PARSED_KEYS
    | _INERT_KEYS
    | set(_IMPLEMENTED_FLAGS)
    | {"draft_vocab_size", "base_model_hidden_size", "swa_window_size", "attention_sink_bias"}
    | {"use_swa"}
)


def _check_layout(cfg: Mapping, source: str, num_layers: int, vocab_size: int) -> None:
    """Refuse, by name, every config field whose value edgebuild does not implement.

    * unknown keys inside ``dspark_config`` / ``dflash_config``;
    * layout flags (``sample_from_anchor``, ``query_zero_predicts_next``, ``causal``,
      ``is_causal``, ``use_swa``, ``is_neox_style``) with another value than the implemented
      one (so contradictory combinations are refused too);
    * ``draft_vocab_size`` != ``vocab_size`` (a reduced draft vocabulary needs a ``d2t`` map,
      which is not implemented), ``attention_sink_bias``;
    (sliding windows are read by :func:`sliding_window_of`).

    Raises:
        ConfigError: naming the file, the field and the fix.
    """
    for section in _SECTIONS:
        sub = cfg.get(section)
        unknown = sorted(set(sub) - _SECTION_KEYS) if isinstance(sub, dict) else []
        if unknown:
            raise ConfigError(
                f"{source}: unknown DSpark field(s) {[f'{section}.{k}' for k in unknown]}; "
                f"edgebuild does not implement them (known: {', '.join(sorted(_SECTION_KEYS))}); "
                "remove them if they do not change the model"
            )
    for key, implemented in _IMPLEMENTED_FLAGS.items():
        value, where = read_dspark_field(cfg, key, bool, source, implemented)
        if value != implemented:
            raise ConfigError(
                f"{source}: field '{where}' = {value!r} is not implemented; edgebuild runs "
                f"DSpark drafts with {key} = {implemented!r} (all-predicting rows, row 0 "
                "predicts the token after the anchor; non-causal, full attention; half-split "
                "RoPE). Use a draft trained that way or remove the field"
            )
    draft_vocab, where = read_dspark_field(cfg, "draft_vocab_size", int, source, None)
    if draft_vocab is not None and draft_vocab != vocab_size:
        raise ConfigError(
            f"{source}: field '{where}' = {draft_vocab} differs from vocab_size {vocab_size}; a "
            "reduced draft vocabulary (with a 'd2t' map) is not implemented. Use a draft over "
            "the target's full vocabulary"
        )
    sink, where = read_dspark_field(cfg, "attention_sink_bias", object, source, None)
    if sink not in (None, False):
        raise ConfigError(f"{source}: field '{where}' (attention sinks) is not implemented")


def sliding_window_of(cfg: Mapping, source: str, num_layers: int) -> int | None:
    """The draft's attention window W, or None for full attention (module docstring).

    Read from, in this order (the DeepSpec and the SpecForge / HF spellings):

    * ``use_swa: true`` with ``swa_window_size`` (``dflash_config`` / ``dspark_config`` or top
      level);
    * ``layer_types`` listing ``sliding_attention`` for every layer, with ``sliding_window``;
    * Qwen3's ``use_sliding_window: true`` with ``sliding_window`` and no ``layer_types``:
      HF makes layer i sliding iff i >= ``max_window_layers``; all layers must agree.

    Raises:
        ConfigError: naming the field: a window that is not a positive int, a window flag
            without its size, or a mix of sliding and full-attention layers (one cache kind
            per draft).
    """
    use_swa, where = read_dspark_field(cfg, "use_swa", bool, source, False)
    if use_swa:
        size, size_where = read_dspark_field(cfg, "swa_window_size", int, source, None)
        size_where = "swa_window_size" if size_where == _DEFAULT else size_where
        return _positive_window(size, size_where, source, f"'{where}' = true")
    types = list(cfg.get("layer_types") or [])[:num_layers]
    window = cfg.get("sliding_window")
    if types:
        sliding = [t == "sliding_attention" for t in types]
        if not any(sliding):
            return None
        if not all(sliding):
            raise ConfigError(
                f"{source}: layer_types {types} mix sliding and full attention; edgebuild runs "
                "drafts whose layers all use one kind (a ring cache for sliding, pages for "
                "full attention)"
            )
        return _positive_window(window, "sliding_window", source, "layer_types sliding_attention")
    if cfg.get("use_sliding_window") is not True or window is None:
        return None
    full_layers = cfg.get("max_window_layers")
    if full_layers is None:
        raise ConfigError(
            f"{source}: fields 'use_sliding_window' = true and 'sliding_window' = {window!r} "
            "without 'max_window_layers' (HF's default, 28, makes the layers below it full "
            f"attention); set max_window_layers to 0 (all {num_layers} layers sliding) or to "
            f"{num_layers} (all full attention)"
        )
    if not isinstance(full_layers, int) or full_layers >= num_layers:
        return None  # HF: layers below max_window_layers use full attention
    if full_layers > 0:
        raise ConfigError(
            f"{source}: fields 'use_sliding_window' = true, 'sliding_window' = {window!r} and "
            f"'max_window_layers' = {full_layers} make layers 0..{full_layers - 1} full "
            f"attention and the rest sliding ({num_layers} layers); edgebuild runs drafts whose "
            "layers all use one kind: set max_window_layers to 0 (all sliding) or to "
            f"{num_layers} (all full)"
        )
    return _positive_window(window, "sliding_window", source, "'use_sliding_window' = true")


def ring_pages(window: int, block_size: int, page_size: int) -> int:
    """Pages of a windowed draft's per-request ring (every backend's
    :class:`~edgebuild.runtime.kv_cache.DraftRing`): the window, the block and one page of
    slack, ``ceil((W + block_size) / page_size) + 1``. The slack keeps a whole window behind
    the end of any write once the ring has rotated: the ring then covers ``end + block_size``
    and starts less than one page above ``end + block_size - rows``, i.e. below ``end - W``."""
    return -(-(window + block_size) // page_size) + 1


def _positive_window(size, where: str, source: str, why: str) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(
            f"{source}: {why} asks for sliding-window attention but field '{where}' is "
            f"{size!r}; give the window in tokens (a positive int)"
        )
    return size


def _packaging(draft_cfg: Mapping[str, Any], source: str) -> DSparkPackaging:
    """The packaging named by ``architectures[0]``; the projector must be DSpark's.

    Raises:
        ConfigError: not a DSpark architecture (lists the supported ones), or a
            ``projector_type`` other than "dspark".
    """
    arch = (draft_cfg.get("architectures") or [None])[0]
    try:
        packaging = DSparkPackaging(arch)
    except ValueError:
        supported = ", ".join(p.value for p in DSparkPackaging)
        raise ConfigError(
            f"{source}: architectures[0] is {arch!r}, not a DSpark draft; supported: {supported}"
        ) from None
    projector, _ = read_dspark_field(draft_cfg, "projector_type", str, source, "dspark")
    if projector != "dspark":
        raise ConfigError(
            f"{source}: projector_type is {projector!r}; a DSpark draft has 'dspark' "
            "(a DFlash or other projector is not a DSpark checkpoint)"
        )
    return packaging


@dataclass(frozen=True)
class DSparkConfig:
    """A DSpark draft's config (HF key names), parsed by :meth:`from_dict`.

    Attributes:
        packaging: DeepSpec or SpecForge / RadixArk (spec §1.1).
        block_size: rows per draft block, B (anchor + B-1 masks).
        mask_token_id: id embedded at the block's mask rows.
        target_layer_ids: taps, output-of-layer ids of the target (HF ``hidden_states[l+1]``,
            spec §1.5); the fc input is their features concatenated in this order.
        num_target_layers: the target's layer count the draft was trained for.
        markov_rank: r, 0 = no Markov head.
        markov_head_type: "vanilla" | "gated" | "rnn" (checked by :meth:`validate`).
        enable_confidence_head, confidence_head_with_markov: spec §1.4.
        hidden_size .. vocab_size: the draft backbone's geometry (see :meth:`with_tensor_geometry`).
        rope: RoPE of the draft (see :func:`_draft_rope`); rotary dim = head_dim.
        attention_mode: SpecForge "gqa" / "mha" or None.
        layer_types: per-layer attention types when the config lists them.
        sliding_window: W, the draft's attention window (:func:`sliding_window_of`), or None
            (full attention). A block row at position p sees context positions > p - W: the
            context cache is a fixed ring of pages per request.
        fields_from: where each DSpark field was read ("dflash_config.mask_token_id", ...,
            or "default"), used in messages.
    """

    packaging: DSparkPackaging
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    markov_rank: int
    markov_head_type: str
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    vocab_size: int
    rope: RopeScaling
    attention_mode: str | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    source: str = "config.json"
    fields_from: dict = field(default_factory=dict, repr=False, compare=False)
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ derived
    @property
    def num_taps(self) -> int:
        """n_t = len(target_layer_ids)."""
        return len(self.target_layer_ids)

    @property
    def fc_in_features(self) -> int:
        """Width of the concatenated target features, n_t * d (spec §1.2 ``fc.weight``)."""
        return self.num_taps * self.hidden_size

    @property
    def head_type(self) -> MarkovHeadType | None:
        """The Markov head variant, or None when markov_rank is 0."""
        return MarkovHeadType(self.markov_head_type) if self.markov_rank > 0 else None

    @property
    def confidence_in_features(self) -> int:
        """Width of the confidence head's input: d (+ r with the Markov input)."""
        return self.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)

    def kv_bytes_per_row(self, dtype_bytes: int) -> int:
        """K + V bytes of one context row over all draft layers (``dtype_bytes`` per value)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    def ring_rows(self, page_size: int) -> int:
        """Rows of a windowed draft's per-request ring: whole pages holding the window, the
        block and one page of slack (``ceil((W + block_size) / page_size) + 1`` pages)."""
        if not self.sliding_window:
            raise ValueError("ring_rows of a full-attention draft")
        return ring_pages(self.sliding_window, self.block_size, page_size) * page_size

    def kv_budget(self, dtype_bytes: int, page_size: int = 32) -> dict:
        """What the draft's context cache costs: a full-attention draft holds one row per
        target position (``bytes_per_token``; its pages are counted beside the target's); a
        windowed one a fixed ring per request (``bytes_per_request``, constant in the context).

        Returns:
            ``{"attention": "full", "bytes_per_token": int}`` or ``{"attention": "sliding",
            "sliding_window": W, "ring_rows": rows, "bytes_per_request": int}``.
        """
        per_row = self.kv_bytes_per_row(dtype_bytes)
        if not self.sliding_window:
            return {"attention": "full", "bytes_per_token": per_row}
        rows = self.ring_rows(page_size)
        return {
            "attention": "sliding",
            "sliding_window": self.sliding_window,
            "ring_rows": rows,
            "bytes_per_request": rows * per_row,
        }

    def where(self, name: str) -> str:
        """The config field path of DSpark field ``name`` (for messages)."""
        found = self.fields_from.get(name, name)
        return f"{name} (default)" if found == _DEFAULT else found

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(
        cls, draft_cfg: Mapping[str, Any], target: ModelConfig, source: str = "config.json"
    ) -> DSparkConfig:
        """Parse a draft ``config.json`` of either packaging and validate it against ``target``.

        DSpark keys are read from the top level, ``dflash_config`` and ``dspark_config`` (two
        locations that disagree are an error); geometry keys from the top level. Defaults when
        absent: ``num_target_layers`` = the target's, ``target_layer_ids`` by
        :func:`default_target_layer_ids`, ``markov_rank`` 0, ``markov_head_type`` "vanilla"
        (SpecForge's default), ``enable_confidence_head`` false, ``confidence_head_with_markov``
        = (markov_rank > 0) (SpecForge's default, made consistent).

        Raises:
            ConfigError: unknown architecture (lists the supported ones), a ``projector_type``
                other than "dspark", missing / mistyped fields, a field whose value is not
                implemented (:func:`_check_layout`), bad rope, or any :meth:`validate` error.
            PairingError: from :meth:`validate`.
        """
        packaging = _packaging(draft_cfg, source)
        hidden = _top(draft_cfg, "hidden_size", int, source)
        heads = _top(draft_cfg, "num_attention_heads", int, source)
        layers = _top(draft_cfg, "num_hidden_layers", int, source)
        fields_from: dict[str, str] = {}

        def dspark(key: str, kind: type, default: Any = _MISSING) -> Any:
            value, where = read_dspark_field(draft_cfg, key, kind, source, default)
            fields_from[key] = where
            return value

        n_target = dspark("num_target_layers", int, target.num_hidden_layers)
        taps = dspark("target_layer_ids", list, None)
        if taps is None:
            taps = list(default_target_layer_ids(n_target, layers))
        rank = dspark("markov_rank", int, 0)
        confidence = dspark("enable_confidence_head", bool, False)
        # read only when the head is on: DeepSpec ignores it otherwise
        with_markov = dspark("confidence_head_with_markov", bool, rank > 0) if confidence else False
        layer_types = draft_cfg.get("layer_types") or ()
        vocab = _top(draft_cfg, "vocab_size", int, source)
        _check_layout(draft_cfg, source, layers, vocab)
        config = cls(
            packaging=packaging,
            block_size=dspark("block_size", int),
            mask_token_id=dspark("mask_token_id", int),
            target_layer_ids=tuple(taps),
            num_target_layers=n_target,
            markov_rank=rank,
            markov_head_type=dspark("markov_head_type", str, "vanilla").lower(),
            enable_confidence_head=confidence,
            confidence_head_with_markov=with_markov,
            hidden_size=hidden,
            intermediate_size=_top(draft_cfg, "intermediate_size", int, source),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=_top(draft_cfg, "num_key_value_heads", int, source, heads),
            head_dim=_top(draft_cfg, "head_dim", int, source, hidden // max(heads, 1)),
            rms_norm_eps=_top(draft_cfg, "rms_norm_eps", float, source, 1e-6),
            attention_bias=_top(draft_cfg, "attention_bias", bool, source, False),
            vocab_size=vocab,
            rope=_draft_rope(draft_cfg, target, source),
            attention_mode=dspark("attention_mode", str, None),
            layer_types=tuple(layer_types),
            sliding_window=sliding_window_of(draft_cfg, source, layers),
            source=source,
            fields_from=fields_from,
            raw=dict(draft_cfg),
        )
        config.validate(target)
        return config

    def with_tensor_geometry(self, shapes: Mapping[str, tuple[int, ...]]) -> DSparkConfig:
        """Heads, KV heads, head_dim and intermediate size read from layer 0's tensors.

        DeepSpec configs are copies of the target config, so these keys may describe the
        target rather than the draft (spec §6.1). ``shapes`` maps canonical names (see
        :func:`canonical_name`) to logical shapes; absent tensors leave the config value (the
        loader reports them as missing). Hidden size, layer count, vocab and rank are not
        derived: a mismatch there is a checkpoint error.
        """
        p = "layers.0"
        q_norm = shapes.get(f"{p}.self_attn.q_norm.weight")
        if q_norm is None or len(q_norm) != 1 or q_norm[0] <= 0:
            return self
        head_dim = q_norm[0]
        updates: dict[str, int] = {"head_dim": head_dim}
        for name, key in (("q_proj", "num_attention_heads"), ("k_proj", "num_key_value_heads")):
            shape = shapes.get(f"{p}.self_attn.{name}.weight")
            if shape is not None and len(shape) == 2 and shape[0] % head_dim == 0:
                updates[key] = shape[0] // head_dim
        gate = shapes.get(f"{p}.mlp.gate_proj.weight")
        if gate is not None and len(gate) == 2:
            updates["intermediate_size"] = gate[0]
        changed = {k: v for k, v in updates.items() if getattr(self, k) != v}
        if changed:
            log.info("%s: draft geometry from tensor shapes: %s", self.source, changed)
        return dataclasses.replace(self, **changed) if changed else self

    # ------------------------------------------------------------------ validation
    def validate(self, target: ModelConfig, fc_in_features: int | None = None) -> None:
        """Check the draft alone and against its target, before any expensive work.

        Args:
            target: the paired target's config.
            fc_in_features: the stored ``fc.weight`` input width, when known (loader).

        Raises:
            ConfigError: bad geometry, block_size < 1, markov_rank < 0, an unsupported
                markov_head_type (lists the supported ones), confidence_head_with_markov
                without a Markov head, mask_token_id outside [0, vocab_size), empty /
                unsorted / duplicate / negative target_layer_ids, an attention_mode that
                contradicts the head counts, sliding-attention layers.
            PairingError: target_layer_ids >= the target's layer count or equal to its last
                layer, num_target_layers != the target's, hidden sizes differ, fc input width
                != n_t * d.
        """
        self._validate_geometry()
        self._validate_heads()
        self._validate_taps(target)
        s = self.source
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"{s}: field '{self.where('mask_token_id')}' = {self.mask_token_id} is outside "
                f"[0, vocab_size={self.vocab_size}); set it to the draft's mask token id "
                "(151669 for Qwen3, 248070 for Qwen3.6/3.8)"
            )
        if self.hidden_size != target.hidden_size:
            raise PairingError(
                f"{s}: draft hidden_size {self.hidden_size} != target hidden_size "
                f"{target.hidden_size} ({target.source}); the draft was trained for another "
                "target - pair it with its own target"
            )
        declared, where = read_dspark_field(self.raw, "base_model_hidden_size", int, s, None)
        if declared is not None and declared != self.fc_in_features:
            raise ConfigError(
                f"{s}: field '{where}' = {declared} != len(target_layer_ids) * hidden_size = "
                f"{self.num_taps} * {self.hidden_size} = {self.fc_in_features}; fix one of them"
            )
        self._check_fc(fc_in_features)

    def _check_fc(self, fc_in_features: int | None) -> None:
        if fc_in_features is not None and fc_in_features != self.fc_in_features:
            raise PairingError(
                f"{self.source}: fc.weight takes {fc_in_features} inputs but "
                f"len(target_layer_ids) * hidden_size = {self.num_taps} * {self.hidden_size} = "
                f"{self.fc_in_features}; fix '{self.where('target_layer_ids')}' (one id per "
                "tapped target layer) or pair the draft with its own target"
            )

    def check_stored(self, fc_in_features: int | None, geometry_changed: bool) -> None:
        """After :meth:`validate`: what the stored tensors may change, checked again.

        :meth:`with_tensor_geometry` may replace heads, KV heads, head_dim and intermediate
        size (``geometry_changed``): those are checked as :meth:`validate` checks them; the
        stored ``fc.weight`` input width (``fc_in_features``, when known) must be n_t * d.
        The other fields are as :meth:`validate` saw them.

        Raises:
            ConfigError: the tensor-derived geometry is inconsistent.
            PairingError: ``fc_in_features`` != len(target_layer_ids) * hidden_size.
        """
        if geometry_changed:
            self._validate_geometry()
        self._check_fc(fc_in_features)

    def _validate_geometry(self) -> None:
        s = self.source
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"{s}: field '{name}' must be positive, got {getattr(self, name)}"
                )
        hq, hkv = self.num_attention_heads, self.num_key_value_heads
        if hq <= 0 or hkv <= 0 or hq % hkv:
            raise ConfigError(
                f"{s}: num_attention_heads ({hq}) must be a positive multiple of "
                f"num_key_value_heads ({hkv})"
            )
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(f"{s}: head_dim must be positive and even, got {self.head_dim}")
        if self.block_size < 1:
            raise ConfigError(
                f"{s}: field '{self.where('block_size')}' must be >= 1, got {self.block_size}"
            )
        mode = self.attention_mode
        if mode is not None and (mode not in ("gqa", "mha") or (mode == "mha") != (hq == hkv)):
            raise ConfigError(
                f"{s}: field '{self.where('attention_mode')}' = {mode!r} does not fit "
                f"{hq} query / {hkv} KV heads ('gqa' needs fewer KV heads, 'mha' equal; "
                "spec section 6.12)"
            )
        kinds = ("sliding_attention",) if self.sliding_window else ("full_attention",)
        bad = [t for t in self.layer_types[: self.num_hidden_layers] if t not in kinds]
        if bad:
            raise ConfigError(
                f"{s}: layer_types {list(self.layer_types[: self.num_hidden_layers])} contain "
                f"{sorted(set(bad))}; DSpark drafts use full attention in every layer"
            )

    def _validate_heads(self) -> None:
        s = self.source
        if self.markov_rank < 0:
            raise ConfigError(
                f"{s}: field '{self.where('markov_rank')}' must be >= 0 (0 = no Markov head), "
                f"got {self.markov_rank}"
            )
        if self.markov_rank > 0 and self.markov_head_type not in SUPPORTED_MARKOV_HEADS:
            raise ConfigError(
                f"{s}: field '{self.where('markov_head_type')}' = {self.markov_head_type!r} is "
                f"not supported; supported: {', '.join(SUPPORTED_MARKOV_HEADS)}"
            )
        if self.confidence_head_with_markov and self.markov_rank == 0:
            raise ConfigError(
                f"{s}: field '{self.where('confidence_head_with_markov')}' is true but there is "
                f"no Markov head ('{self.where('markov_rank')}' = 0); set it to false or give "
                "the draft a Markov head"
            )

    def _validate_taps(self, target: ModelConfig) -> None:
        s, ids, field_ = self.source, list(self.target_layer_ids), self.where("target_layer_ids")
        n = target.num_hidden_layers
        if self.num_target_layers != n:
            raise PairingError(
                f"{s}: field '{self.where('num_target_layers')}' = {self.num_target_layers} but "
                f"the target ({target.source}) has {n} layers; the draft was trained for "
                "another target"
            )
        if not ids:
            raise ConfigError(f"{s}: field '{field_}' is empty; list the tapped target layers")
        if any(i < 0 for i in ids):
            raise ConfigError(
                f"{s}: field '{field_}' = {ids} has negative ids; -1 (embedding output, "
                "accepted by DeepSpec) is not supported: the target engine exports layer "
                "outputs 0..n-2 only (spec section 6.5)"
            )
        if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
            raise ConfigError(
                f"{s}: field '{field_}' = {ids} must be strictly increasing (sorted, no "
                "duplicates); features are concatenated in list order (spec section 1.5)"
            )
        if ids[-1] >= n:
            raise PairingError(
                f"{s}: field '{field_}' = {ids} has ids >= the target's {n} layers "
                f"({target.source}); valid ids are 0..{n - 2}"
            )
        if ids[-1] == n - 1:
            raise PairingError(
                f"{s}: field '{field_}' = {ids} taps the target's final layer {n - 1}; "
                "HF hidden_states[n] is taken after the final norm, so DeepSpec forbids that "
                f"id (spec sections 1.5, 6.5). Valid ids are 0..{n - 2}; ids written for a "
                "capture hook on the layer input (vLLM) must be converted (subtract 1) first"
            )
