"""Decoder-LLM config parsing: one frozen dataclass for Llama / Qwen2 / Qwen3 targets.

Accepts both transformers v4 and v5 `config.json` layouts (`rope_theta` at the top level or in
`rope_parameters`; `rope_scaling` or `rope_parameters`; legacy key `type`); rope parsing itself
lives in :mod:`edgebuild.ops.rope`. Fields keep the Hugging Face key names. `validate()` runs
before any expensive work and names the file, the field and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from edgebuild.errors import CheckpointError, ConfigError, unreadable
from edgebuild.ops.mrope import check_mrope_section, parse_mrope
from edgebuild.ops.rope import RopeScaling


class Family(str, Enum):
    """Decoder families served by :mod:`edgebuild.models.llama` (one generic decoder)."""

    LLAMA = "llama"  # optional attention/mlp bias from config
    QWEN2 = "qwen2"  # q/k/v bias always present
    QWEN3 = "qwen3"  # per-head q_norm / k_norm


# architectures[0] or model_type -> family. Explicit registry: an unknown one is an error.
_ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family.LLAMA,
    "MistralForCausalLM": Family.LLAMA,
    "Qwen2ForCausalLM": Family.QWEN2,
    "Qwen3ForCausalLM": Family.QWEN3,
    "Qwen2_5_VLForConditionalGeneration": Family.QWEN2,  # language model; visual.* in vision.py
}
_MODEL_TYPES: dict[str, Family] = {
    "llama": Family.LLAMA,
    "mistral": Family.LLAMA,
    "qwen2": Family.QWEN2,
    "qwen3": Family.QWEN3,
    "qwen2_5_vl": Family.QWEN2,
}
# Vision-language checkpoints: text fields may sit under `text_config`, RoPE is multimodal
# (mrope_section) and `vision_config` describes the `visual.*` tower (edgebuild.models.vision).
_MULTIMODAL: frozenset[str] = frozenset({"Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl"})


def text_config_view(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language-model fields of a config: a nested `text_config` merged over the top level.

    Hub VLM configs are flat (returned as is); transformers 5 writes `text_config` (its keys win;
    top-level keys such as `architectures` and `tie_word_embeddings` are kept).
    """
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    return {**top, **text}


def read_json(path: Path, what: str = "config") -> dict[str, Any]:
    """Read a JSON object from `path`.

    Raises:
        CheckpointError: the file is missing, unreadable (permissions), is not valid JSON
            or is not an object; the message names the file and the problem.
    """
    path = Path(path)
    try:
        if not path.is_file():
            raise CheckpointError(f"{path}: missing {what} file")
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise unreadable(exc, path) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc}); re-export the {what}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _get(cfg: dict, key: str, source: str, kind: type | tuple, default: Any = ...) -> Any:
    value = cfg.get(key, default)
    if value is ...:
        raise ConfigError(f"{source}: required field '{key}' is missing")
    if value is None and default is None:
        return None
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        names = " or ".join(getattr(k, "__name__", str(k)) for k in kinds)
        raise ConfigError(f"{source}: field '{key}' must be {names}, got {value!r}")
    return value


def _flag(cfg: dict, key: str, source: str) -> bool:
    """A boolean field (absent or null = False); a string such as "false" is an error."""
    value = cfg.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: field '{key}' must be true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class ModelConfig:
    """Geometry and options of a decoder LLM, parsed from an HF `config.json`.

    Attributes keep HF names. `head_dim` defaults to hidden_size // num_attention_heads.
    `layer_types[i]` is "full_attention" or "sliding_attention" (window `sliding_window`).
    `raw` keeps the whole dict (drafts inherit target fields from it).
    """

    family: Family
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeScaling
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    layer_types: tuple[str, ...]
    bos_token_id: int | None
    eos_token_id: tuple[int, ...]
    torch_dtype: str | None
    source: str = "config.json"
    raw: dict = field(default_factory=dict, repr=False, compare=False)
    mrope_section: tuple[int, ...] | None = None  # multimodal RoPE (t, h, w) widths
    vision_config: dict | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Parse an HF config dict (v4 or v5 layout).

        Raises:
            ConfigError: unknown architecture (lists the supported ones), a missing or
                mistyped field, an unknown rope type, or inconsistent geometry.
        """
        arch, model_type, family = _family(cfg, source)
        # Multimodal configs may keep the LLM under text_config; drafts read only top-level.
        full = cfg
        multimodal = (arch or model_type) in _MULTIMODAL
        if multimodal:
            if not isinstance(full.get("vision_config"), dict):
                raise ConfigError(
                    f"{source}: a {arch or model_type} config needs a 'vision_config' object"
                )
            cfg = text_config_view(cfg)
            rope, mrope_section = parse_mrope(cfg, source)
        else:
            rope, mrope_section = RopeScaling.from_hf_config(cfg, source=source), None
        hidden = _get(cfg, "hidden_size", source, int)
        heads = _get(cfg, "num_attention_heads", source, int)
        kv_heads = _get(cfg, "num_key_value_heads", source, int, heads) or heads
        head_dim = _get(cfg, "head_dim", source, int, None) or hidden // max(heads, 1)
        n_layers = _get(cfg, "num_hidden_layers", source, int)
        window, layer_types = _attention_layout(cfg, source, family, n_layers)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        config = cls(
            family=family,
            architecture=arch or family.value,
            vocab_size=_get(cfg, "vocab_size", source, int),
            hidden_size=hidden,
            intermediate_size=_get(cfg, "intermediate_size", source, int),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(_get(cfg, "rms_norm_eps", source, (int, float), 1e-6)),
            max_position_embeddings=_get(cfg, "max_position_embeddings", source, int, 2048),
            rope=rope,
            tie_word_embeddings=_flag(cfg, "tie_word_embeddings", source),
            attention_bias=family is Family.QWEN2 or bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family is Family.QWEN3,
            sliding_window=int(window) if window else None,
            layer_types=tuple(layer_types),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            source=source,
            raw=dict(full),
            mrope_section=mrope_section,
            vision_config=dict(full["vision_config"]) if multimodal else None,
        )
        config.validate()
        return config

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        """Parse `path` (a config.json, or a directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(read_json(path), source=str(path))

    def validate(self) -> None:
        """Check geometry; raises ConfigError naming the field and the fix."""
        s = self.source
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{s}: '{name}' must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{s}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"{s}: 'layer_types' has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        bad = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if bad:
            raise ConfigError(f"{s}: unsupported layer_types {sorted(bad)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ConfigError(f"{s}: sliding_attention layers need a positive 'sliding_window'")
        if self.head_dim % 2:
            raise ConfigError(f"{s}: head_dim must be even for RoPE, got {self.head_dim}")
        if self.mrope_section is not None:
            check_mrope_section(self.mrope_section, self.rope.rotary_dim(self.head_dim), s)

    def window_for_layer(self, layer: int) -> int:
        """Sliding window of `layer` in tokens, 0 for full attention."""
        if self.layer_types[layer] != "sliding_attention":
            return 0
        return self.sliding_window or 0


def _family(cfg: dict[str, Any], source: str) -> tuple[str, str, Family]:
    """``(architecture, model_type, family)`` of an HF config (either name may be "").

    Raises:
        ConfigError: neither names a supported family (lists the supported architectures).
    """
    arch_list = cfg.get("architectures") or []
    if isinstance(arch_list, str):
        arch_list = [arch_list]
    arch = arch_list[0] if isinstance(arch_list, list) and arch_list else ""
    arch = arch if isinstance(arch, str) else ""
    model_type = cfg.get("model_type")
    model_type = model_type if isinstance(model_type, str) else ""
    family = _ARCHITECTURES.get(arch) or _MODEL_TYPES.get(model_type)
    if family is None:
        raise ConfigError(
            f"{source}: unsupported architecture "
            f"{arch or cfg.get('architectures') or cfg.get('model_type')!r}; "
            f"supported: {', '.join(sorted(_ARCHITECTURES))}"
        )
    return arch, model_type, family


def _attention_layout(
    cfg: dict[str, Any], source: str, family: Family, n_layers: int
) -> tuple[int | None, list[str]]:
    """``(sliding_window, layer_types)``: the window (Llama always reads it, others only with
    ``use_sliding_window``) and the per-layer types, listed or derived from
    ``max_window_layers``.

    Raises:
        ConfigError: ``layer_types`` that is not a list of strings.
    """
    window = None
    if family is Family.LLAMA or cfg.get("use_sliding_window", False):
        window = _get(cfg, "sliding_window", source, int, None)
    layer_types = cfg.get("layer_types")
    if layer_types is not None and (
        not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types)
    ):
        raise ConfigError(f"{source}: 'layer_types' must be a list of strings, got {layer_types!r}")
    if layer_types is None:
        max_window_layers = cfg.get("max_window_layers", n_layers)
        layer_types = [
            "sliding_attention"
            if window is not None and (family is Family.LLAMA or i >= max_window_layers)
            else "full_attention"
            for i in range(n_layers)
        ]
    return window, layer_types
