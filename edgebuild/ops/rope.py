"""Rotary position embedding (RoPE): config parsing, inverse frequencies, cos/sin table, apply.

This module owns everything RoPE for the project, in the form the attention plugin consumes:
one fp32 table ``rope_cos_sin [max_position, rotary_dim]`` whose row ``p`` is
``[cos(p * inv_freq) * s, sin(p * inv_freq) * s]`` (cos half first, then sin half, each
``rotary_dim // 2`` wide; ``s`` = the rope type's ``attention_scaling``), and the "rotate half"
(GPT-NeoX / Llama) rotation of the first ``rotary_dim`` channels of a head.

Supported rope types (``SUPPORTED_ROPE_TYPES``): ``default``, ``linear``, ``llama3``, ``yarn``.
The frequencies are bit-for-bit those of ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``
(transformers 5.14: ``_compute_linear_scaling_rope_parameters``, ``_compute_llama3_parameters``,
``_compute_yarn_parameters``) and of ``LlamaRotaryEmbedding.compute_default_rope_parameters``.
Any other type (``dynamic``, ``longrope``, ``mrope``, ``proportional``...) is refused with a
``ConfigError``; nothing falls back silently to the default rope.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from edgebuild.errors import ConfigError

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")

# HF's default when a config carries no rope_theta (RotaryEmbeddingConfigMixin.default_theta).
DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class RopeScaling:
    """RoPE parameters of one attention layer type; field names are the Hugging Face keys.

    Fields (unused ones keep their defaults):
        rope_type: one of ``SUPPORTED_ROPE_TYPES``.
        rope_theta: base wavelength (HF ``rope_theta``; 10000.0 when a config omits it).
        factor: context extension factor (``linear``, ``llama3``, ``yarn``); 1.0 = none.
        original_max_position_embeddings: pre-extension context length (``llama3``, ``yarn``).
        low_freq_factor, high_freq_factor: ``llama3`` smoothing band (Llama 3.1: 1 and 4).
        beta_fast, beta_slow: ``yarn`` ramp bounds; ``None`` (or 0) means 32 and 1, as in HF.
        attention_factor: ``yarn`` cos/sin multiplier; ``None`` = derived from ``factor``
            (and from ``mscale``/``mscale_all_dim`` when both are set and non-zero).
        mscale, mscale_all_dim: ``yarn`` (DeepSeek-style) attention factor terms.
        truncate: ``yarn`` floors/ceils the correction range (HF default True; gpt-oss False).
        partial_rotary_factor: fraction of ``head_dim`` that is rotated (see ``rotary_dim``).

    Raises:
        ConfigError: on an unsupported ``rope_type`` or an inconsistent value (message names
            the field).
    """

    rope_type: str = "default"
    rope_theta: float = DEFAULT_ROPE_THETA
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope_type {self.rope_type!r} is not supported; supported rope types: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta}")
        if not self.factor > 0:
            raise ConfigError(f"factor must be > 0, got {self.factor}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ConfigError(
                f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}"
            )
        if self.rope_type in ("llama3", "yarn"):
            if self.original_max_position_embeddings is None:
                raise ConfigError(
                    f"rope_type {self.rope_type!r} needs original_max_position_embeddings"
                )
            if self.original_max_position_embeddings <= 0:
                raise ConfigError(
                    "original_max_position_embeddings must be > 0, got "
                    f"{self.original_max_position_embeddings}"
                )
        if self.rope_type == "llama3":
            if self.low_freq_factor is None or self.high_freq_factor is None:
                raise ConfigError("rope_type 'llama3' needs low_freq_factor and high_freq_factor")
            if self.high_freq_factor <= self.low_freq_factor:
                raise ConfigError(
                    f"llama3 high_freq_factor ({self.high_freq_factor}) must be greater than "
                    f"low_freq_factor ({self.low_freq_factor})"
                )

    def rotary_dim(self, head_dim: int) -> int:
        """Number of rotated channels per head: ``int(head_dim * partial_rotary_factor)``.

        Same rule as transformers (``dim = int(head_dim * partial_rotary_factor)``).

        Raises:
            ConfigError: if the result is odd or zero (the half-split rotation needs pairs).
        """
        dim = int(head_dim * self.partial_rotary_factor)
        if dim <= 0 or dim % 2:
            raise ConfigError(
                f"rotary dim int({head_dim} * partial_rotary_factor {self.partial_rotary_factor}) "
                f"= {dim} must be a positive even number"
            )
        return dim

    @classmethod
    def from_hf_config(
        cls, cfg: dict, source: str = "config.json", layer_type: str | None = None
    ) -> RopeScaling:
        """Read the RoPE parameters of a Hugging Face config dict (transformers v4 or v5 layout).

        Layouts:
            * v5: ``rope_parameters`` = ``{"rope_type", "rope_theta", "factor", ...}``, or a dict
              of such dicts keyed by layer type (then ``layer_type`` picks one).
            * v4: ``rope_theta`` at top level and ``rope_scaling`` = ``{"rope_type"|"type", ...}``
              or ``null``.
        As in transformers' ``standardize_rope_params``: a missing rope type is ``default``; a
        missing ``rope_theta`` is 10000.0; a top-level ``partial_rotary_factor`` or
        ``original_max_position_embeddings`` wins over the dict's; ``llama3``/``yarn`` default
        ``original_max_position_embeddings`` to ``max_position_embeddings``; a ``yarn`` without
        ``factor`` uses ``max_position_embeddings / original_max_position_embeddings``.

        Args:
            cfg: the parsed ``config.json`` (for a VLM: its text config).
            source: file name used in error messages.
            layer_type: key into a per-layer-type ``rope_parameters`` dict.

        Raises:
            ConfigError: unsupported rope type (names ``source``, the field and the supported
                types), multimodal RoPE (``mrope_section``), a missing required key, or an
                invalid value.
        """
        params, field = _rope_dict(cfg, source, layer_type)
        rope_type = params.get("rope_type", params.get("type"))
        type_field = f"{field}.{'rope_type' if 'rope_type' in params else 'type'}"
        rope_type = "default" if rope_type is None else rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"{source}: rope type {rope_type!r} (field {type_field}) is not supported; "
                f"supported rope types: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if params.get("mrope_section") is not None:
            raise ConfigError(
                f"{source}: {field}.mrope_section is set (multimodal 3-axis RoPE); RopeScaling "
                "covers 1-D positions only"
            )

        theta = params.get("rope_theta")
        theta = cfg.get("rope_theta") if theta is None else theta
        partial = cfg.get("partial_rotary_factor")
        partial = params.get("partial_rotary_factor") if partial is None else partial
        fields: dict = {
            "rope_type": rope_type,
            "rope_theta": _number(
                DEFAULT_ROPE_THETA if theta is None else theta,
                source,
                f"{field}.rope_theta" if params.get("rope_theta") is not None else "rope_theta",
            ),
            "partial_rotary_factor": _number(
                1.0 if partial is None else partial, source, "partial_rotary_factor"
            ),
            **_scaling_fields(rope_type, cfg, params, field, source),
        }
        try:
            return cls(**fields)
        except ConfigError as exc:
            raise ConfigError(f"{source} ({field}): {exc}") from None


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")
_YARN_OPTIONAL_KEYS = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")


def _number(value, source: str, name: str) -> float:
    """``value`` as a float; a ConfigError naming ``source`` and the field when it is not a
    JSON number (a string, a bool, an object)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(
            f"{source}: {name} must be a number, got {type(value).__name__} {value!r}"
        )
    return float(value)


def _scaling_fields(rope_type: str, cfg: dict, params: dict, field: str, source: str) -> dict:
    """The ``RopeScaling`` fields of a scaled rope type, with HF's defaults applied."""
    fields: dict = {}
    if rope_type in ("llama3", "yarn"):
        # a top-level value wins (HF's Phi-3 exception), then the dict's, then max positions
        original = cfg.get("original_max_position_embeddings")
        original = original or params.get("original_max_position_embeddings")
        original = original or cfg.get("max_position_embeddings")
        if original is None:
            raise ConfigError(
                f"{source}: rope type {rope_type!r} needs "
                f"{field}.original_max_position_embeddings or max_position_embeddings"
            )
        fields["original_max_position_embeddings"] = int(
            _number(original, source, f"{field}.original_max_position_embeddings")
        )
    if rope_type in ("linear", "llama3"):
        required = ("factor",) if rope_type == "linear" else _LLAMA3_KEYS
        missing = [f"{field}.{k}" for k in required if params.get(k) is None]
        if missing:
            raise ConfigError(f"{source}: rope type {rope_type!r} needs {', '.join(missing)}")
        fields.update({k: _number(params[k], source, f"{field}.{k}") for k in required})
    if rope_type == "yarn":
        factor = params.get("factor")
        if factor is None:  # HF: the post-/pre-extension context ratio
            max_pos = cfg.get("max_position_embeddings")
            if max_pos is None:
                raise ConfigError(
                    f"{source}: yarn rope without {field}.factor needs max_position_embeddings"
                )
            factor = max_pos / fields["original_max_position_embeddings"]
        fields["factor"] = _number(factor, source, f"{field}.factor")
        for key in _YARN_OPTIONAL_KEYS:
            if params.get(key) is not None:
                fields[key] = _number(params[key], source, f"{field}.{key}")
        fields["truncate"] = bool(params.get("truncate", True))
    return fields


def _rope_dict(cfg: dict, source: str, layer_type: str | None) -> tuple[dict, str]:
    """Return (the flat rope dict of ``cfg``, its field name for messages)."""
    params = cfg.get("rope_parameters")
    field = "rope_parameters"
    if not params:
        params, field = cfg.get("rope_scaling") or {}, "rope_scaling"
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: {field} must be an object, got {type(params).__name__}")
    nested = bool(params) and all(isinstance(v, dict) for v in params.values())
    if nested:
        if layer_type is None:
            raise ConfigError(
                f"{source}: {field} is per layer type ({', '.join(sorted(params))}); "
                "pass layer_type to pick one"
            )
        if layer_type not in params:
            raise ConfigError(
                f"{source}: {field} has no entry for layer type {layer_type!r}; "
                f"it has: {', '.join(sorted(params))}"
            )
        return params[layer_type], f"{field}.{layer_type}"
    return params, field


def compute_inv_freq(rotary_dim: int, rope: RopeScaling) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scaling for ``rotary_dim`` rotated channels.

    Mirrors transformers 5.14 exactly (same operations in the same fp32 order):
    ``LlamaRotaryEmbedding.compute_default_rope_parameters`` and
    ``modeling_rope_utils._compute_{linear_scaling_rope,llama3,yarn}_parameters`` with
    ``dim = rotary_dim`` (i.e. ``int(head_dim * partial_rotary_factor)``).

    Args:
        rotary_dim: rotated channels per head (positive, even).
        rope: the parsed parameters.

    Returns:
        ``(inv_freq, attention_scaling)``: fp32 ``[rotary_dim // 2]`` on the CPU, and the float
        multiplier HF applies to cos and sin (1.0 except for ``yarn``).

    Raises:
        ConfigError: if ``rotary_dim`` is not a positive even number.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ConfigError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    dim, base = rotary_dim, rope.rope_theta
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(dim, rope)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if rope.rope_type == "linear":
        inv_freq /= rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_smooth(inv_freq, rope)
    return inv_freq, 1.0


def _llama3_smooth(inv_freq: torch.Tensor, rope: RopeScaling) -> torch.Tensor:
    """Llama 3.1 frequency smoothing (HF ``_compute_llama3_parameters``)."""
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the band between interpolated
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama)


def _yarn_inv_freq(dim: int, rope: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as HF ``_compute_yarn_parameters``: ramped inv_freq + mscale."""
    base, factor = rope.rope_theta, rope.factor

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(
                get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim)
            )
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def correction_dim(num_rotations: float) -> float:
        max_pos = rope.original_max_position_embeddings
        return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_factor)
        + inv_freq_extrapolation * extrapolation_factor
    )
    return inv_freq, attention_factor


def rope_cos_sin_table(rotary_dim: int, max_position: int, rope: RopeScaling) -> torch.Tensor:
    """The attention plugin's RoPE table.

    Args:
        rotary_dim: rotated channels per head (positive, even).
        max_position: number of rows (positions ``0 .. max_position - 1``).
        rope: the parsed parameters.

    Returns:
        fp32 ``[max_position, rotary_dim]``; row ``p`` is
        ``[cos(p * inv_freq) * s, sin(p * inv_freq) * s]`` with ``(inv_freq, s)`` from
        ``compute_inv_freq`` (for ``linear`` the positions are thus divided by ``factor``).
        Same fp32 values as HF's rotary embedding ``forward`` (which gives ``cat(cos, cos)``).

    Raises:
        ConfigError: bad ``rotary_dim``; ValueError: ``max_position`` < 1.
    """
    if max_position < 1:
        raise ValueError(f"max_position must be >= 1, got {max_position}")
    inv_freq, attention_scaling = compute_inv_freq(rotary_dim, rope)
    positions = torch.arange(max_position, dtype=torch.int64).to(torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [max_position, rotary_dim // 2]
    return torch.cat((freqs.cos() * attention_scaling, freqs.sin() * attention_scaling), dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rotary_dim = table.shape[-1]`` channels of ``x`` ("rotate half").

    For ``x1, x2`` = the two halves of those channels and ``cos, sin`` = the table row at the
    position: ``[x1 * cos - x2 * sin, x2 * cos + x1 * sin]``; channels past ``rotary_dim``
    (partial rotary) pass through unchanged. Equals HF ``apply_rotary_pos_emb`` in fp32.

    Args:
        x: ``[*P, *M, D]`` where ``P = positions.shape``, e.g. ``[B, S, H, D]`` with
            positions ``[B, S]`` (token-major, as the packed qkv rows), or ``[B, S, D]``.
            HF's head-major ``[B, H, S, D]`` is not accepted (transpose first).
        positions: integer ``P``, each in ``[0, table.shape[0])``.
        table: fp32 ``[max_position, rotary_dim]`` from ``rope_cos_sin_table``.

    Returns:
        ``x``'s shape and dtype; computed in fp32 and cast back once.

    Raises:
        ValueError: shapes that do not fit, odd or too wide ``rotary_dim``, a position outside
            the table.
    """
    rotary_dim = table.shape[-1]
    if table.dim() != 2 or rotary_dim % 2 or rotary_dim > x.shape[-1]:
        raise ValueError(
            f"rope table must be [max_position, rotary_dim] with an even rotary_dim <= head dim "
            f"{x.shape[-1]}, got {tuple(table.shape)}"
        )
    lead = positions.dim()
    if tuple(x.shape[:lead]) != tuple(positions.shape) or x.dim() < lead + 1:
        raise ValueError(
            f"positions {tuple(positions.shape)} must be a prefix of x's shape {tuple(x.shape)}"
        )
    check_positions(positions, table)
    half = rotary_dim // 2
    rows = table.float()[positions.long()]  # [*P, rotary_dim]
    rows = rows.reshape(*positions.shape, *([1] * (x.dim() - lead - 1)), rotary_dim)
    return rotate_with(x, rows[..., :half], rows[..., half:])


def check_positions(positions: torch.Tensor, table: torch.Tensor) -> None:
    """Raise ValueError unless ``positions`` are integers that index rows of ``table``."""
    if positions.is_floating_point():
        raise ValueError(f"positions must be an integer tensor, got {positions.dtype}")
    if not positions.numel():
        return
    if positions.numel() <= 64:  # a decode / draft step: on Python ints (4 small ops less)
        listed = positions.flatten().tolist()
        low, high = min(listed), max(listed)
    else:
        low, high = int(positions.min()), int(positions.max())
    if low < 0 or high >= table.shape[0]:
        raise ValueError(
            f"positions span [{low}, {high}] but the rope table has {table.shape[0]} rows; "
            "build it with a larger max_position"
        )


def rotate_with(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The "rotate half" rotation of :func:`apply_rope` with its table rows already gathered.

    Args:
        x: ``[..., D]`` any float dtype.
        cos, sin: fp32, broadcastable to ``x[..., :rotary_dim // 2]`` (the two halves of the
            table rows at each position).

    Returns:
        ``x``'s shape and dtype: ``[x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest]`` computed
        in fp32 and cast back once (channels past ``rotary_dim`` pass through).
    """
    half = cos.shape[-1]
    rotary_dim = 2 * half
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half:rotary_dim], xf[..., rotary_dim:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
    return out.to(x.dtype)
