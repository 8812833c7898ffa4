"""Quantized checkpoint formats: configs, typed quantized weights and the dequantization math.

This module owns everything edgebuild knows about how a checkpoint stores a quantized linear
layer (facts in ``spec/nvfp4-and-fp8-checkpoints.md``):

* :class:`QuantConfig` / :func:`load_quant_config` read ``hf_quant_config.json`` (ModelOpt) or
  ``config.json``'s ``quantization_config`` (ModelOpt form, or the Hugging Face / DeepSeek /
  Qwen ``"fp8"`` block form) and answer "which format should module X have?".
* :class:`QuantizedWeight` is the one typed object for a quantized ``nn.Linear`` weight
  (packed data + scales + where it came from), with ``dequantize`` and ``validate``.
* :func:`build_linear_weight` turns the tensors stored under one prefix into a dense tensor or
  a :class:`QuantizedWeight`, deciding the format from the tensors actually present.
* :func:`unpack_nvfp4`, :func:`pack_nvfp4`, :func:`dequantize_nvfp4`, :func:`dequantize_fp8`
  and :func:`dequantize_fp8_block` are the reference math (the CPU path and the golden model
  for the TensorRT graphs).

Supported formats: ModelOpt NVFP4 (group 16), ModelOpt FP8 per-tensor, FP8 128x128 block
(``weight_scale_inv``), ModelOpt ``MIXED_PRECISION`` of those, and unquantized BF16/FP16/FP32.
Everything else (AWQ / GPTQ int4, W4A16, MXFP4, ...) is refused with :class:`QuantFormatError`.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import torch

from edgebuild.errors import CheckpointError, QuantFormatError

log = logging.getLogger("edgebuild.checkpoint")

__all__ = [
    "E2M1_VALUES",
    "QuantAlgo",
    "QuantConfig",
    "QuantizedWeight",
    "TensorLookup",
    "build_linear_weight",
    "dequantize_fp8",
    "dequantize_fp8_block",
    "dequantize_nvfp4",
    "is_quant_aux_tensor",
    "load_quant_config",
    "module_matches",
    "pack_nvfp4",
    "quant_tensor_suffixes",
    "unpack_nvfp4",
]

HF_QUANT_CONFIG = "hf_quant_config.json"

#: FP4 E2M1 values indexed by the 4-bit code: bit 3 = sign, bits 0..2 index the magnitudes.
E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
_E2M1_MAGNITUDES = E2M1_VALUES[:8]

NVFP4_GROUP_SIZE = 16
DEFAULT_FP8_BLOCK = (128, 128)

_SUFFIXES = (
    "weight_scale",
    "weight_scale_2",
    "input_scale",
    "weight_scale_inv",
    "k_scale",
    "v_scale",
)
_SOURCES = ("component", "target")
_FP8_DTYPES = (torch.float8_e4m3fn,)


class QuantAlgo(str, Enum):
    """Storage format of a (linear) weight.

    ``NONE``: dense BF16/FP16/FP32. ``NVFP4``: ModelOpt NVFP4 (packed E2M1 + FP8 block scales +
    FP32 global scale). ``FP8``: ModelOpt FP8 per-tensor (``weight_scale`` scalar). ``FP8_BLOCK``:
    DeepSeek / Qwen ``fp8`` with ``weight_block_size`` (``weight_scale_inv`` per tile).
    ``MIXED_PRECISION``: only ever the *global* algo of a :class:`QuantConfig` whose layers carry
    their own format in ``per_layer``; :meth:`QuantConfig.algo_for` never returns it.
    """

    NONE = "NONE"
    NVFP4 = "NVFP4"
    FP8 = "FP8"
    FP8_BLOCK = "FP8_BLOCK"
    MIXED_PRECISION = "MIXED_PRECISION"


# Config spellings we accept for each algo (ModelOpt / TensorRT-LLM names).
_ALGO_NAMES: dict[str, QuantAlgo] = {
    "NVFP4": QuantAlgo.NVFP4,
    "FP8": QuantAlgo.FP8,
    "FP8_BLOCK": QuantAlgo.FP8_BLOCK,
    "FP8_BLOCK_SCALES": QuantAlgo.FP8_BLOCK,
    "MIXED_PRECISION": QuantAlgo.MIXED_PRECISION,
    "NONE": QuantAlgo.NONE,
}
_SUPPORTED_ALGOS = "NVFP4, FP8, FP8_BLOCK (FP8_BLOCK_SCALES), MIXED_PRECISION (of those) or none"
_SUPPORTED_METHODS = '"modelopt" (NVFP4 / FP8 / MIXED_PRECISION) and "fp8" (e4m3, block scales)'
_SUPPORTED_KV = (None, "FP8")


def _strip_model(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def module_matches(module_name: str, pattern: str) -> bool:
    """Whether ``module_name`` matches a config module pattern (``exclude_modules`` / ``ignore``).

    ``fnmatch`` wildcards (``*``, ``?``, ``[...]``); a leading ``model.`` is ignored on both the
    name and the pattern (``model.layers.0.*`` matches ``layers.0.mlp``); a pattern without
    wildcards also matches the module's children (``model.layers.0.mlp`` matches
    ``model.layers.0.mlp.down_proj``), as ModelOpt's exclude summaries expect.
    """
    name = _strip_model(module_name)
    pat = _strip_model(pattern)
    if fnmatch.fnmatchcase(name, pat) or fnmatch.fnmatchcase(module_name, pattern):
        return True
    if not any(c in pattern for c in "*?["):
        return name.startswith(pat + ".")
    return False


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's quantization config, normalised from whichever file carried it.

    Attributes:
        algo: global format (``MIXED_PRECISION`` when layers carry their own, see ``per_layer``).
        group_size: NVFP4 block size along ``in`` (16; the only size TensorRT supports).
        exclude_modules: wildcard patterns of modules left unquantized (see
            :func:`module_matches` for the matching rules).
        kv_cache_quant_algo: ``"FP8"`` when K/V are stored in FP8 (``k_scale``/``v_scale``), else None.
        per_layer: module name -> format (ModelOpt ``MIXED_PRECISION`` ``quantized_layers``).
        weight_block_size: ``(128, 128)``-style tile of ``FP8_BLOCK`` scales, else None.
        source: the file (and field) this came from, for messages.
    """

    algo: QuantAlgo = QuantAlgo.NONE
    group_size: int = NVFP4_GROUP_SIZE
    exclude_modules: tuple[str, ...] = ()
    kv_cache_quant_algo: str | None = None
    per_layer: Mapping[str, QuantAlgo] = field(default_factory=dict, hash=False)
    weight_block_size: tuple[int, int] | None = None
    source: str = "<no quantization config>"

    def __post_init__(self) -> None:
        object.__setattr__(self, "algo", QuantAlgo(self.algo))
        object.__setattr__(self, "exclude_modules", tuple(self.exclude_modules))
        per_layer = {k: QuantAlgo(v) for k, v in dict(self.per_layer).items()}
        object.__setattr__(self, "per_layer", MappingProxyType(per_layer))
        if self.weight_block_size is not None:
            object.__setattr__(self, "weight_block_size", tuple(self.weight_block_size))

    @classmethod
    def none(cls, source: str = "<no quantization config>") -> QuantConfig:
        """The config of an unquantized checkpoint (every module is ``QuantAlgo.NONE``)."""
        return cls(algo=QuantAlgo.NONE, source=source)

    @property
    def is_quantized(self) -> bool:
        """True when some weight format other than NONE is configured."""
        return self.algo is not QuantAlgo.NONE or any(
            a is not QuantAlgo.NONE for a in self.per_layer.values()
        )

    def algo_for(self, module_name: str) -> QuantAlgo:
        """The format the config promises for one module (e.g. ``model.layers.0.mlp.down_proj``).

        Order: an entry of ``per_layer`` (exact or wildcard, ``model.`` prefix ignored), then
        ``exclude_modules`` (-> NONE), then the global ``algo`` (NONE for layers a
        MIXED_PRECISION config does not list). A trailing ``.weight`` is ignored. The tensors
        stored in the checkpoint have the last word (:func:`build_linear_weight`).
        """
        name = module_name[: -len(".weight")] if module_name.endswith(".weight") else module_name
        if self.per_layer:
            stripped = _strip_model(name)
            for key, algo in self.per_layer.items():
                if _strip_model(key) == stripped:
                    return algo
            for key, algo in self.per_layer.items():
                if any(c in key for c in "*?[") and module_matches(name, key):
                    return algo
        if any(module_matches(name, p) for p in self.exclude_modules):
            return QuantAlgo.NONE
        if self.algo is QuantAlgo.MIXED_PRECISION:
            return QuantAlgo.NONE
        return self.algo


# ----------------------------------------------------------------------------- config parsing


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise QuantFormatError(
            f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
            "fix or re-export the file (e.g. `edgebuild quantize`)"
        ) from None


def _parse_algo(value: Any, where: str) -> QuantAlgo:
    if value is None:
        return QuantAlgo.NONE
    if not isinstance(value, str) or value.upper() not in _ALGO_NAMES:
        raise QuantFormatError(
            f"{where}: unsupported quant_algo {value!r}; edgebuild reads {_SUPPORTED_ALGOS} "
            "(re-quantize with `edgebuild quantize --quant nvfp4|fp8`)"
        )
    return _ALGO_NAMES[value.upper()]


def _parse_kv(value: Any, where: str) -> str | None:
    if isinstance(value, Mapping):  # config.json kv_cache_scheme {"num_bits": 8, "type": "float"}
        if value.get("num_bits") == 8 and value.get("type") == "float":
            return "FP8"
        raise QuantFormatError(
            f"{where}: unsupported kv_cache_scheme {dict(value)!r}; supported: FP8 (8-bit float) or none"
        )
    if value is None or value == "":
        return None
    if isinstance(value, str) and value.upper() == "FP8":
        return "FP8"
    raise QuantFormatError(
        f"{where}: unsupported kv_cache_quant_algo {value!r}; supported: {list(_SUPPORTED_KV)}"
    )


def _parse_group_size(value: Any, algo: QuantAlgo, where: str) -> int:
    if value is None:
        return NVFP4_GROUP_SIZE
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise QuantFormatError(f"{where}: group_size must be a positive integer, got {value!r}")
    if algo is QuantAlgo.NVFP4 and value != NVFP4_GROUP_SIZE:
        raise QuantFormatError(
            f"{where}: NVFP4 group_size {value} is not supported; TensorRT NVFP4 uses blocks of "
            f"{NVFP4_GROUP_SIZE} (re-quantize with ModelOpt's NVFP4_DEFAULT_CFG)"
        )
    return value


def _parse_patterns(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise QuantFormatError(f"{where}: expected a list of module names/patterns, got {value!r}")
    return tuple(value)


def _parse_per_layer(value: Any, where: str) -> dict[str, QuantAlgo]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise QuantFormatError(f"{where}: expected an object module -> {{quant_algo: ...}}")
    out: dict[str, QuantAlgo] = {}
    for name, cfg in value.items():
        algo_value = cfg.get("quant_algo") if isinstance(cfg, Mapping) else cfg
        algo = _parse_algo(algo_value, f'{where}["{name}"].quant_algo')
        if algo is QuantAlgo.MIXED_PRECISION:
            raise QuantFormatError(
                f'{where}["{name}"].quant_algo: MIXED_PRECISION is not a layer format'
            )
        if isinstance(cfg, Mapping) and algo is QuantAlgo.NVFP4:
            _parse_group_size(cfg.get("group_size"), algo, f'{where}["{name}"].group_size')
        out[name] = algo
    return out


def _from_modelopt(q: Mapping[str, Any], where: str, *, config_json_form: bool) -> QuantConfig:
    algo = _parse_algo(q.get("quant_algo"), f"{where}.quant_algo")
    group_size = q.get("group_size")
    if config_json_form and group_size is None:
        # config.json form: the group size lives in config_groups.group_0.weights.group_size
        for grp in (q.get("config_groups") or {}).values():
            weights = grp.get("weights") if isinstance(grp, Mapping) else None
            if isinstance(weights, Mapping) and weights.get("num_bits") == 4:
                group_size = weights.get("group_size")
                break
    if "quant_algo" not in q and config_json_form:
        algo = _algo_from_config_groups(q.get("config_groups"), where)
    excludes_key = (
        "ignore" if config_json_form and "exclude_modules" not in q else "exclude_modules"
    )
    per_layer = _parse_per_layer(q.get("quantized_layers"), f"{where}.quantized_layers")
    if algo is QuantAlgo.MIXED_PRECISION and not per_layer:
        raise QuantFormatError(
            f"{where}: quant_algo MIXED_PRECISION needs a non-empty quantized_layers map "
            "(module -> {quant_algo}); the file is incomplete, re-export it"
        )
    kv_key = "kv_cache_quant_algo" if "kv_cache_quant_algo" in q else "kv_cache_scheme"
    block = q.get("weight_block_size")
    return QuantConfig(
        algo=algo,
        group_size=_parse_group_size(group_size, algo, f"{where}.group_size"),
        exclude_modules=_parse_patterns(q.get(excludes_key), f"{where}.{excludes_key}"),
        kv_cache_quant_algo=_parse_kv(q.get(kv_key), f"{where}.{kv_key}"),
        per_layer=per_layer,
        weight_block_size=_parse_block(block, f"{where}.weight_block_size") if block else None,
        source=where,
    )


def _algo_from_config_groups(groups: Any, where: str) -> QuantAlgo:
    if not groups:
        return QuantAlgo.NONE
    for grp in groups.values() if isinstance(groups, Mapping) else ():
        w = grp.get("weights") if isinstance(grp, Mapping) else None
        if isinstance(w, Mapping) and w.get("type") == "float":
            if w.get("num_bits") == 4:
                return QuantAlgo.NVFP4
            if w.get("num_bits") == 8:
                return QuantAlgo.FP8
    raise QuantFormatError(
        f"{where}.config_groups: cannot tell the format (no quant_algo and no 4/8-bit float "
        f"weights group); edgebuild reads {_SUPPORTED_ALGOS}"
    )


def _parse_block(value: Any, where: str) -> tuple[int, int]:
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise QuantFormatError(
            f"{where}: expected two positive integers like [128, 128], got {value!r}"
        )
    return (int(value[0]), int(value[1]))


def _from_hf_fp8(q: Mapping[str, Any], where: str) -> QuantConfig:
    fmt = q.get("fmt", "e4m3")
    if str(fmt).lower() != "e4m3":
        raise QuantFormatError(
            f"{where}.fmt: FP8 format {fmt!r} is not supported; only e4m3 (float8_e4m3fn) weights load"
        )
    block = q.get("weight_block_size", list(DEFAULT_FP8_BLOCK))
    if block is None:
        block = list(DEFAULT_FP8_BLOCK)
    key = next(
        (k for k in ("modules_to_not_convert", "ignored_layers", "ignore") if q.get(k) is not None),
        "modules_to_not_convert",
    )
    return QuantConfig(
        algo=QuantAlgo.FP8_BLOCK,
        exclude_modules=_parse_patterns(q.get(key), f"{where}.{key}"),
        kv_cache_quant_algo=_parse_kv(q.get("kv_cache_scheme"), f"{where}.kv_cache_scheme"),
        weight_block_size=_parse_block(block, f"{where}.weight_block_size"),
        source=where,
    )


def load_quant_config(ckpt_dir: Path, config: Mapping[str, Any]) -> QuantConfig:
    """Read a checkpoint's quantization config.

    Looks at ``<ckpt_dir>/hf_quant_config.json`` first (ModelOpt: ``quantization.quant_algo``,
    ``group_size``, ``exclude_modules``, ``kv_cache_quant_algo``, ``quantized_layers``), then at
    ``config["quantization_config"]`` (``config`` is the already-parsed ``config.json``):
    ``quant_method: "modelopt"`` (``quant_algo``, ``ignore``, ``config_groups``,
    ``kv_cache_scheme``, ``quantized_layers``) or ``quant_method: "fp8"`` (``fmt: "e4m3"``,
    ``weight_block_size`` -> ``FP8_BLOCK``, default [128, 128] as in transformers,
    ``modules_to_not_convert``). Neither present -> :meth:`QuantConfig.none`.

    Raises:
        QuantFormatError: malformed JSON (names the file), unsupported ``quant_algo`` /
            ``quant_method`` / ``fmt`` / ``kv_cache_quant_algo`` (names the file and field and
            lists the supported ones), NVFP4 group size other than 16.
        CheckpointError: the file exists but cannot be read.
    """
    ckpt_dir = Path(ckpt_dir)
    hf_path = ckpt_dir / HF_QUANT_CONFIG
    if hf_path.is_file():
        data = _read_json(hf_path)
        if not isinstance(data, Mapping):
            raise QuantFormatError(f"{hf_path}: expected a JSON object with a 'quantization' field")
        q = data.get("quantization", data if "quant_algo" in data else None)
        if not isinstance(q, Mapping):
            raise QuantFormatError(
                f"{hf_path}: missing the 'quantization' object (quant_algo, group_size, "
                "exclude_modules); re-export the checkpoint with ModelOpt"
            )
        where = f"{hf_path}: quantization" if "quantization" in data else str(hf_path)
        return _from_modelopt(q, where, config_json_form=False)

    cfg_path = ckpt_dir / "config.json"
    q = config.get("quantization_config") if isinstance(config, Mapping) else None
    if q is None:
        return QuantConfig.none(source=str(cfg_path))
    where = f"{cfg_path}: quantization_config"
    if not isinstance(q, Mapping):
        raise QuantFormatError(f"{where}: expected an object, got {type(q).__name__}")
    method = q.get("quant_method")
    method_l = str(method).lower() if method is not None else None
    if method_l == "modelopt":
        return _from_modelopt(q, where, config_json_form=True)
    if method_l == "fp8":
        return _from_hf_fp8(q, where)
    raise QuantFormatError(
        f"{where}.quant_method: {method!r} is not supported; edgebuild reads {_SUPPORTED_METHODS}. "
        "Quantize the BF16 checkpoint with `edgebuild quantize --quant nvfp4|fp8` instead"
    )


# ----------------------------------------------------------------------------- the math


def _e2m1_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def unpack_nvfp4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack FP4 E2M1 codes, two per byte, into their float values.

    Args:
        packed: uint8 ``[..., n/2]``; the **low nibble is the even (first) element**, the high
            nibble the odd one (ModelOpt's export layout, spec "ModelOpt NVFP4").

    Returns:
        float32 ``[..., n]``: code bit 3 = sign, bits 0..2 index ``[0, 0.5, 1, 1.5, 2, 3, 4, 6]``
        (so byte ``0x21`` -> ``[0.5, 1.0]``; code 8 is ``-0.0``).

    Raises:
        TypeError: ``packed`` is not uint8.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_nvfp4 expects uint8 packed codes, got {packed.dtype}")
    table = _e2m1_table(packed.device)
    low = (packed & 0x0F).long()
    high = (packed >> 4).long()
    codes = torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return table[codes]


def pack_nvfp4(values: torch.Tensor) -> torch.Tensor:
    """Pack float values that are exact E2M1 codes into bytes (inverse of :func:`unpack_nvfp4`).

    Args:
        values: float ``[..., n]`` with ``n`` even; every element must be one of
            ``±{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` (``-0.0`` keeps its sign bit).

    Returns:
        uint8 ``[..., n/2]``, low nibble = even element.

    Raises:
        ValueError: odd last dimension or a value that is not an E2M1 code (this function does
            not round; quantize first).
    """
    if values.shape[-1] % 2:
        raise ValueError(
            f"pack_nvfp4 needs an even last dimension, got shape {tuple(values.shape)}"
        )
    v = values.to(torch.float32)
    mags = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32, device=v.device)
    hit = v.abs().unsqueeze(-1) == mags
    if not bool(hit.any(-1).all()):
        bad = v[~hit.any(-1)].flatten()[:4].tolist()
        raise ValueError(f"pack_nvfp4: values {bad} are not FP4 E2M1 codes (quantize first)")
    codes = hit.to(torch.uint8).argmax(-1).to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def dequantize_nvfp4(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize a ModelOpt NVFP4 weight.

    ``w = e2m1(weight) * float(weight_scale) * weight_scale_2`` per block of ``g`` elements along
    the last axis, computed in float32 then cast to ``dtype`` (the same operations, in the same
    order, as ``modelopt.torch.quantization.qtensor.NVFP4QTensor.dequantize``; spec
    "ModelOpt NVFP4").

    Args:
        weight: uint8 ``[..., out, in/2]`` packed codes.
        weight_scale: float8_e4m3fn (or float) ``[..., out, in/g]`` block scales; ``g`` (16 for
            ModelOpt) is inferred as ``in / weight_scale.shape[-1]``.
        weight_scale_2: float32 scalar (``[]`` or one element) global scale.
        dtype: output dtype.

    Returns:
        ``dtype`` ``[..., out, in]``.

    Raises:
        QuantFormatError: shapes that do not divide into blocks.
    """
    values = unpack_nvfp4(weight)
    n_in = values.shape[-1]
    n_blocks = weight_scale.shape[-1]
    if n_blocks == 0 or n_in % n_blocks or weight_scale.shape[:-1] != values.shape[:-1]:
        raise QuantFormatError(
            f"NVFP4 weight_scale shape {tuple(weight_scale.shape)} does not fit weight "
            f"{tuple(weight.shape)} (logical {tuple(values.shape)})"
        )
    group = n_in // n_blocks
    scale = weight_scale.to(torch.float32) * weight_scale_2.to(torch.float32).reshape(())
    out = values.view(*values.shape[:-1], n_blocks, group) * scale.unsqueeze(-1)
    return out.reshape(values.shape).to(dtype)


def dequantize_fp8(
    weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantize a ModelOpt FP8 weight: ``w = float(weight) * weight_scale`` (spec "FP8").

    Args:
        weight: float8_e4m3fn ``[out, in]``.
        weight_scale: float32 scalar (per-tensor; ``[]`` or one element) or per-channel
            ``[out]`` / ``[out, 1]``.
        dtype: output dtype (computed in float32, then cast).

    Returns:
        ``dtype`` ``[out, in]``.
    """
    scale = weight_scale.to(torch.float32)
    if scale.numel() == 1:
        scale = scale.reshape(())
    elif scale.dim() == 1:
        scale = scale.unsqueeze(-1)
    return (weight.to(torch.float32) * scale).to(dtype)


def dequantize_fp8_block(
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: tuple[int, int] = DEFAULT_FP8_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize a block-FP8 weight (DeepSeek-V3 / Qwen3 ``fp8``, spec "FP8").

    Each ``block_size`` tile ``[r*bo:(r+1)*bo, c*bi:(c+1)*bi]`` of ``weight`` is multiplied by
    ``weight_scale_inv[r, c]`` (despite its name the stored value is the dequant multiplier).
    ``out`` / ``in`` need not be multiples of the block: the last tiles are partial.

    Args:
        weight: float8_e4m3fn ``[out, in]``.
        weight_scale_inv: float32 ``[ceil(out/bo), ceil(in/bi)]``.
        block_size: ``(bo, bi)``, usually ``(128, 128)``.
        dtype: output dtype (computed in float32, then cast).

    Returns:
        ``dtype`` ``[out, in]``.

    Raises:
        QuantFormatError: ``weight_scale_inv`` shape does not match the tiling.
    """
    out_f, in_f = weight.shape[-2:]
    bo, bi = block_size
    want = (math.ceil(out_f / bo), math.ceil(in_f / bi))
    if tuple(weight_scale_inv.shape[-2:]) != want:
        raise QuantFormatError(
            f"FP8 block weight_scale_inv shape {tuple(weight_scale_inv.shape)} does not fit weight "
            f"{tuple(weight.shape)} with blocks {tuple(block_size)} (expected {want})"
        )
    scale = weight_scale_inv.to(torch.float32)
    scale = scale.repeat_interleave(bo, dim=-2).repeat_interleave(bi, dim=-1)
    scale = scale[..., :out_f, :in_f]
    return (weight.to(torch.float32) * scale).to(dtype)


# ----------------------------------------------------------------------------- typed weight


def _desc(t: torch.Tensor | None) -> str:
    return "absent" if t is None else f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """One quantized ``nn.Linear`` weight with its scales, as stored in a checkpoint.

    Attributes:
        name: module prefix, e.g. ``model.layers.0.mlp.down_proj`` (tensors are ``<name>.weight``,
            ``<name>.weight_scale``, ...).
        format: ``NVFP4``, ``FP8`` or ``FP8_BLOCK``.
        data: NVFP4: uint8 ``[out, in/2]`` (low nibble = even element); FP8 / FP8_BLOCK:
            float8_e4m3fn ``[out, in]``.
        weight_scale: NVFP4: float8_e4m3fn ``[out, in/16]``; FP8: float32 scalar (or ``[out]``).
        weight_scale_2: NVFP4 float32 scalar global scale.
        input_scale: float32 scalar activation scale (ModelOpt static), if stored.
        weight_scale_inv: FP8_BLOCK float32 ``[ceil(out/bo), ceil(in/bi)]``.
        group_size: NVFP4 block length along ``in`` (16 when not given; ``weight_scale`` must
            have ``in / group_size`` columns).
        block_size: FP8_BLOCK tile ``(bo, bi)``.
        shape: logical ``(out, in)``; inferred from ``data`` when not given.
        checkpoint_source: ``"component"`` (the checkpoint being built) or ``"target"``.
        file: the file the tensors were read from, for messages.
    """

    name: str
    format: QuantAlgo
    data: torch.Tensor
    weight_scale: torch.Tensor | None = None
    weight_scale_2: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    weight_scale_inv: torch.Tensor | None = None
    group_size: int | None = None
    block_size: tuple[int, int] | None = None
    shape: tuple[int, int] | None = None
    checkpoint_source: str = "component"
    file: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", QuantAlgo(self.format))
        if self.format not in (QuantAlgo.NVFP4, QuantAlgo.FP8, QuantAlgo.FP8_BLOCK):
            raise ValueError(
                f"QuantizedWeight format must be NVFP4, FP8 or FP8_BLOCK, got {self.format}"
            )
        if self.checkpoint_source not in _SOURCES:
            raise ValueError(
                f"checkpoint_source must be one of {_SOURCES}, got {self.checkpoint_source!r}"
            )
        if self.shape is None and self.data.dim() >= 2:
            rows, cols = int(self.data.shape[-2]), int(self.data.shape[-1])
            logical = (rows, cols * 2) if self.format is QuantAlgo.NVFP4 else (rows, cols)
            object.__setattr__(self, "shape", logical)
        elif self.shape is not None:
            object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if self.format is QuantAlgo.NVFP4 and self.group_size is None:
            object.__setattr__(self, "group_size", NVFP4_GROUP_SIZE)
        if self.format is QuantAlgo.FP8_BLOCK and self.block_size is None:
            object.__setattr__(self, "block_size", DEFAULT_FP8_BLOCK)
        if self.block_size is not None:
            object.__setattr__(self, "block_size", tuple(self.block_size))

    @property
    def dtype(self) -> torch.dtype:
        """Storage dtype of ``data`` (uint8 or float8_e4m3fn)."""
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the packed data plus every stored scale."""
        tensors = (
            self.data,
            self.weight_scale,
            self.weight_scale_2,
            self.input_scale,
            self.weight_scale_inv,
        )
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def _where(self, suffix: str) -> str:
        f = self.file or "<checkpoint>"
        return f"{f}: tensor '{self.name}.{suffix}' ({self.checkpoint_source})"

    def _fail(self, suffix: str, problem: str) -> QuantFormatError:
        return QuantFormatError(
            f"{self._where(suffix)} {problem}; the {self.format.value} tensors of this layer are "
            "corrupt or not in the ModelOpt/HF layout - re-export the checkpoint "
            "(`edgebuild quantize`) or re-download the file"
        )

    def validate(self) -> QuantizedWeight:
        """Check dtypes, shapes and scale values; returns ``self``.

        Raises:
            QuantFormatError: naming the tensor, the file and the fix, when a dtype or shape is
                wrong for the format or any scale holds NaN/Inf.
        """
        data, shape = self.data, self.shape
        if data.dim() != 2 or shape is None or len(shape) != 2:
            raise self._fail(
                "weight", f"has shape {list(data.shape)}; expected a 2-D [out, in] weight"
            )
        out_f, in_f = shape
        if self.format is QuantAlgo.NVFP4:
            if data.dtype != torch.uint8:
                raise self._fail("weight", f"is {_desc(data)}; NVFP4 weights are uint8 [out, in/2]")
            if data.shape[0] != out_f or data.shape[1] * 2 < in_f:
                raise self._fail(
                    "weight", f"is {_desc(data)}; expected uint8 [{out_f}, {math.ceil(in_f / 2)}]"
                )
            g = self.group_size or NVFP4_GROUP_SIZE
            ws = self.weight_scale
            n_blocks = (data.shape[1] * 2) // g
            if ws is None:
                raise self._fail("weight_scale", "is missing")
            if ws.dtype != torch.float8_e4m3fn:
                raise self._fail(
                    "weight_scale", f"is {_desc(ws)}; NVFP4 block scales are float8_e4m3fn"
                )
            if (data.shape[1] * 2) % g or tuple(ws.shape) != (out_f, n_blocks):
                raise self._fail(
                    "weight_scale",
                    f"is {_desc(ws)}; expected float8_e4m3fn [{out_f}, {n_blocks}] (group {g})",
                )
            if self.weight_scale_2 is None:
                raise self._fail("weight_scale_2", "is missing")
            self._check_scalar("weight_scale_2", self.weight_scale_2)
        elif self.format is QuantAlgo.FP8:
            self._check_fp8_data(out_f, in_f)
            ws = self.weight_scale
            if ws is None:
                raise self._fail("weight_scale", "is missing")
            if not ws.is_floating_point() or ws.dtype in _FP8_DTYPES:
                raise self._fail("weight_scale", f"is {_desc(ws)}; expected a float32 scalar")
            if ws.numel() != 1 and ws.numel() != out_f:
                raise self._fail(
                    "weight_scale", f"is {_desc(ws)}; expected a float32 scalar (or [{out_f}])"
                )
        else:  # FP8_BLOCK
            self._check_fp8_data(out_f, in_f)
            bo, bi = self.block_size or DEFAULT_FP8_BLOCK
            want = (math.ceil(out_f / bo), math.ceil(in_f / bi))
            si = self.weight_scale_inv
            if si is None:
                raise self._fail("weight_scale_inv", "is missing")
            if not si.is_floating_point() or si.dtype in _FP8_DTYPES or tuple(si.shape) != want:
                raise self._fail(
                    "weight_scale_inv",
                    f"is {_desc(si)}; expected float32 {list(want)} for blocks {[bo, bi]}",
                )
        if self.input_scale is not None:
            self._check_scalar("input_scale", self.input_scale)
        for suffix in ("weight_scale", "weight_scale_2", "input_scale", "weight_scale_inv"):
            t = getattr(self, suffix)
            if t is not None and not bool(torch.isfinite(t.to(torch.float32)).all()):
                raise self._fail(suffix, "contains NaN or Inf")
        return self

    def _check_fp8_data(self, out_f: int, in_f: int) -> None:
        if self.data.dtype not in _FP8_DTYPES:
            raise self._fail(
                "weight", f"is {_desc(self.data)}; {self.format.value} weights are float8_e4m3fn"
            )
        if tuple(self.data.shape) != (out_f, in_f):
            raise self._fail("weight", f"is {_desc(self.data)}; expected [{out_f}, {in_f}]")

    def _check_scalar(self, suffix: str, t: torch.Tensor) -> None:
        if t.numel() != 1 or not t.is_floating_point() or t.dtype in _FP8_DTYPES:
            raise self._fail(suffix, f"is {_desc(t)}; expected a float32 scalar")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight ``[out, in]`` in ``dtype`` (math in float32; see the dequantize_* functions)."""
        if self.format is QuantAlgo.NVFP4:
            assert self.weight_scale is not None and self.weight_scale_2 is not None
            w = dequantize_nvfp4(self.data, self.weight_scale, self.weight_scale_2, dtype)
        elif self.format is QuantAlgo.FP8:
            assert self.weight_scale is not None
            w = dequantize_fp8(self.data, self.weight_scale, dtype)
        else:
            assert self.weight_scale_inv is not None
            w = dequantize_fp8_block(
                self.data, self.weight_scale_inv, self.block_size or DEFAULT_FP8_BLOCK, dtype
            )
        if self.shape is not None and tuple(w.shape) != tuple(self.shape):
            w = w[..., : self.shape[0], : self.shape[1]]  # NVFP4 padded along `in`
        return w

    def __repr__(self) -> str:
        return (
            f"QuantizedWeight({self.name!r}, {self.format.value}, shape={self.shape}, "
            f"source={self.checkpoint_source})"
        )


# ----------------------------------------------------------------------------- building


def quant_tensor_suffixes() -> tuple[str, ...]:
    """Auxiliary tensor suffixes that are scales, not parameters.

    ``("weight_scale", "weight_scale_2", "input_scale", "weight_scale_inv", "k_scale", "v_scale")``
    (no leading dot): a loader skips ``<prefix>.<suffix>`` when matching parameters.
    """
    return _SUFFIXES


def is_quant_aux_tensor(name: str) -> bool:
    """True when tensor ``name`` ends with ``.<suffix>`` for one of :func:`quant_tensor_suffixes`."""
    return name.rsplit(".", 1)[-1] in _SUFFIXES if "." in name else False


@runtime_checkable
class TensorLookup(Protocol):
    """What :func:`build_linear_weight` reads tensors through (e.g. a lazy safetensors reader).

    ``has(name)`` says whether a tensor exists without reading it; ``get(name)`` reads it
    (called only after ``has`` said yes, so a ``get`` that raises on absent names is fine).
    """

    def get(self, name: str) -> torch.Tensor | None: ...

    def has(self, name: str) -> bool: ...


TensorSource = Mapping[str, torch.Tensor] | TensorLookup | Callable[[str], torch.Tensor | None]


class _Reader:
    """Uniform ``maybe(name) -> Tensor | None`` over the accepted lookup kinds."""

    def __init__(self, tensors: TensorSource) -> None:
        self._tensors = tensors
        if isinstance(tensors, TensorLookup):
            self.maybe = lambda n: tensors.get(n) if tensors.has(n) else None
        elif isinstance(tensors, Mapping):
            self.maybe = lambda n: tensors[n] if n in tensors else None
        elif callable(tensors):
            self.maybe = tensors
        else:
            raise TypeError(
                "tensors must be a Mapping, an object with get()/has(), or a callable "
                "name -> Tensor | None"
            )


def build_linear_weight(
    prefix: str,
    tensors: TensorSource,
    quant_config: QuantConfig,
    checkpoint_source: str = "component",
    file: str = "",
) -> torch.Tensor | QuantizedWeight:
    """The weight of linear ``prefix`` as a dense tensor or a validated :class:`QuantizedWeight`.

    The format is decided by the tensors present (spec "ModelOpt NVFP4" / "FP8"):

    * uint8 ``weight`` + float8 ``weight_scale`` (+ ``weight_scale_2``) -> NVFP4
    * float8_e4m3fn ``weight`` + ``weight_scale_inv`` -> FP8_BLOCK (tile from
      ``quant_config.weight_block_size``, default 128x128)
    * float8_e4m3fn ``weight`` + scalar ``weight_scale`` -> FP8
    * floating ``weight`` -> returned as stored (no copy, no cast)

    ``input_scale`` is attached when present. When the tensors contradict
    ``quant_config.algo_for(prefix)`` the tensors win and a note is logged on
    ``edgebuild.checkpoint``: WARNING when the stored weight is quantized although the config
    says otherwise (e.g. ``lm_head`` excluded but stored NVFP4), INFO when a weight the config
    calls quantized is stored dense.

    Args:
        prefix: module name, e.g. ``model.layers.0.mlp.down_proj`` (without ``.weight``).
        tensors: where to read from, one of: an object with ``has(name) -> bool`` and
            ``get(name) -> Tensor`` (:class:`TensorLookup`; ``has`` is asked first, so ``get``
            may raise on absent names), a plain callable ``name -> Tensor | None`` (e.g. a lazy
            reader's ``maybe``), or a ``Mapping`` name -> tensor. Only this layer's tensors
            (``<prefix>.weight`` and the suffixes of :func:`quant_tensor_suffixes` it needs)
            are read.
        quant_config: the checkpoint's :class:`QuantConfig`.
        checkpoint_source: ``"component"`` or ``"target"``.
        file: file name for messages.

    Raises:
        CheckpointError: ``<prefix>.weight`` is absent.
        QuantFormatError: a quantized weight without its scales, an unsupported storage dtype
            (int8/int32 packing, float8_e5m2) or any check of :meth:`QuantizedWeight.validate`.
    """
    if checkpoint_source not in _SOURCES:
        raise ValueError(f"checkpoint_source must be one of {_SOURCES}, got {checkpoint_source!r}")
    reader = _Reader(tensors)
    where = file or "<checkpoint>"
    weight = reader.maybe(f"{prefix}.weight")
    if weight is None:
        raise CheckpointError(
            f"{where}: tensor '{prefix}.weight' not found ({checkpoint_source} checkpoint)"
        )

    def opt(suffix: str) -> torch.Tensor | None:
        return reader.maybe(f"{prefix}.{suffix}")

    expected = quant_config.algo_for(prefix)
    result = _stored_weight(prefix, weight, opt, quant_config, checkpoint_source, file)

    got = result.format if isinstance(result, QuantizedWeight) else QuantAlgo.NONE
    if got is not expected:
        note = (
            f"{where}: '{prefix}.weight' is stored as {got.value} but {quant_config.source} says "
            f"{expected.value}; using the stored format"
        )
        log.log(logging.WARNING if got is not QuantAlgo.NONE else logging.INFO, note)
    if isinstance(result, QuantizedWeight):
        result.validate()
    return result


def _stored_weight(
    prefix: str,
    weight: torch.Tensor,
    opt,
    quant_config: QuantConfig,
    checkpoint_source: str,
    file: str,
) -> torch.Tensor | QuantizedWeight:
    """The format the stored tensors of linear ``prefix`` say (see :func:`build_linear_weight`).

    ``opt(suffix)`` reads ``<prefix>.<suffix>`` or returns None. Not yet validated.

    Raises:
        QuantFormatError: missing scales or an unsupported storage dtype.
    """
    where = file or "<checkpoint>"
    result: torch.Tensor | QuantizedWeight
    if weight.dtype == torch.uint8:
        ws, ws2 = opt("weight_scale"), opt("weight_scale_2")
        for suffix, t in (("weight_scale", ws), ("weight_scale_2", ws2)):
            if t is None:
                raise QuantFormatError(
                    f"{where}: tensor '{prefix}.weight' is packed NVFP4 (uint8) but '{prefix}.{suffix}' "
                    "is missing; the checkpoint is incomplete - re-export it"
                )
        result = QuantizedWeight(
            name=prefix,
            format=QuantAlgo.NVFP4,
            data=weight,
            weight_scale=ws,
            weight_scale_2=ws2,
            input_scale=opt("input_scale"),
            group_size=quant_config.group_size,
            checkpoint_source=checkpoint_source,
            file=file,
        )
    elif weight.dtype in _FP8_DTYPES:
        scale_inv = opt("weight_scale_inv")
        if scale_inv is not None:
            result = QuantizedWeight(
                name=prefix,
                format=QuantAlgo.FP8_BLOCK,
                data=weight,
                weight_scale_inv=scale_inv,
                input_scale=opt("input_scale"),
                block_size=quant_config.weight_block_size or DEFAULT_FP8_BLOCK,
                checkpoint_source=checkpoint_source,
                file=file,
            )
        else:
            ws = opt("weight_scale")
            if ws is None:
                raise QuantFormatError(
                    f"{where}: tensor '{prefix}.weight' is float8_e4m3fn but neither "
                    f"'{prefix}.weight_scale' (FP8 per-tensor) nor '{prefix}.weight_scale_inv' "
                    "(FP8 block) is stored; the checkpoint is incomplete - re-export it"
                )
            result = QuantizedWeight(
                name=prefix,
                format=QuantAlgo.FP8,
                data=weight,
                weight_scale=ws,
                input_scale=opt("input_scale"),
                checkpoint_source=checkpoint_source,
                file=file,
            )
    elif weight.is_floating_point() and weight.dtype not in (torch.float8_e5m2,):
        result = weight
    else:
        raise QuantFormatError(
            f"{where}: tensor '{prefix}.weight' is stored as {weight.dtype}, which edgebuild cannot "
            f"read; supported: {_SUPPORTED_ALGOS} (float8_e4m3fn / NVFP4 uint8 / BF16 / FP16 / FP32). "
            "Quantize the BF16 checkpoint with `edgebuild quantize` instead"
        )
    return result
