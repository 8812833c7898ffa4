"""`edgebuild quantize`: BF16/FP32 Hugging Face checkpoint -> ModelOpt NVFP4 / FP8 checkpoint.

A thin wrapper around NVIDIA ModelOpt (``pip install 'edgebuild[quant]'``):

1. load the checkpoint with ``transformers.AutoModelForCausalLM`` (local files only),
2. ``modelopt.torch.quantization.quantize`` with ``NVFP4_DEFAULT_CFG`` / ``FP8_DEFAULT_CFG``
   (``lm_head`` left in the checkpoint dtype unless ``lm_head="nvfp4"|"fp8"``), calibrating the
   activation scales with a forward pass over short prompts (``edgebuild/data/calib_prompts.txt``)
   or caller-given token ids,
3. ``modelopt.torch.export.export_hf_checkpoint`` into a temporary directory next to ``out``,
   tokenizer files copied, the result checked (``hf_quant_config.json`` readable by
   :func:`edgebuild.checkpoint.quant.load_quant_config`, quantized tensors present), then renamed
   to ``out`` in one step.

What works on a CPU-only machine (checked with nvidia-modelopt 0.47, torch 2.13 CPU): the
calibration forward (quantizers only *collect* amax, nothing is fake-quantized yet) and the
export, for NVFP4 and FP8. A forward of the *fake-quantized* model afterwards works for FP8 but
fails for NVFP4 ("amax must be a CUDA tensor for dynamic block quantization"), so this module
never runs one; check the result by loading the exported checkpoint (``edgebuild inspect`` /
the torch backend dequantizes it). Export needs ``config.architectures`` (set here when missing)
and the ``requests`` package. The whole model is held in memory while quantizing.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from edgebuild.checkpoint.quant import QuantAlgo, load_quant_config
from edgebuild.errors import CheckpointError, ConfigError, MissingDependencyError, QuantFormatError

log = logging.getLogger("edgebuild.quantize")

__all__ = ["QUANT_FORMATS", "default_calib_prompts", "lm_head_quant_cfg", "quantize_checkpoint"]

#: ``quant`` / ``lm_head`` values -> (ModelOpt config name, hf_quant_config ``quant_algo``).
QUANT_FORMATS: dict[str, tuple[str, QuantAlgo]] = {
    "nvfp4": ("NVFP4_DEFAULT_CFG", QuantAlgo.NVFP4),
    "fp8": ("FP8_DEFAULT_CFG", QuantAlgo.FP8),
}

# Files copied from the source checkpoint when present (export writes config.json,
# generation_config.json, hf_quant_config.json and the safetensors itself).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "preprocessor_config.json",
)
_PIP_HINT = "pip install 'edgebuild[quant]'"


def default_calib_prompts() -> list[str]:
    """The shipped calibration prompts (``edgebuild/data/calib_prompts.txt``, one per line)."""
    text = resources.files("edgebuild").joinpath("data/calib_prompts.txt").read_text("utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def _import_modelopt() -> tuple[Any, Callable[..., Any]]:
    try:
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint
    except ImportError as exc:
        raise MissingDependencyError(
            f"quantizing needs NVIDIA ModelOpt (import failed: {exc}); {_PIP_HINT}"
        ) from None
    try:
        import requests  # noqa: F401  (export_hf_checkpoint imports it)
    except ImportError:
        raise MissingDependencyError(
            f"ModelOpt's checkpoint export needs the 'requests' package; {_PIP_HINT}"
        ) from None
    return mtq, export_hf_checkpoint


def _entry_cfg(quant_cfg: Any, quantizer_name: str) -> dict[str, Any]:
    """The ``cfg`` ModelOpt's config gives to ``quantizer_name`` (list or legacy dict form)."""
    if isinstance(quant_cfg, dict):
        value = quant_cfg.get(quantizer_name)
        if isinstance(value, dict):
            return copy.deepcopy(value)
    else:
        for entry in quant_cfg:
            if entry.get("quantizer_name") == quantizer_name and "cfg" in entry:
                return copy.deepcopy(entry["cfg"])
    raise QuantFormatError(
        f"this ModelOpt version's config has no '{quantizer_name}' entry; "
        "edgebuild supports nvidia-modelopt >= 0.47"
    )


def lm_head_quant_cfg(base: dict[str, Any], head: dict[str, Any] | None) -> dict[str, Any]:
    """A deep copy of ModelOpt config ``base`` whose ``*lm_head*`` quantizers use ``head``'s format.

    ``base`` / ``head`` are ModelOpt configs such as ``mtq.NVFP4_DEFAULT_CFG`` (neither is
    modified). ``head=None`` returns an unchanged copy (ModelOpt's defaults keep the head
    unquantized). Otherwise the ``*lm_head*`` "enable: false" entries are dropped and
    ``*lm_head*weight_quantizer`` / ``*lm_head*input_quantizer`` entries with ``head``'s weight
    and input quantizer settings are appended (later entries win in ModelOpt). Handles both the
    list form of ``quant_cfg`` (ModelOpt >= 0.47) and the older dict form.
    """
    cfg = copy.deepcopy(base)
    if head is None:
        return cfg
    qc = cfg["quant_cfg"]
    w_cfg = _entry_cfg(head["quant_cfg"], "*weight_quantizer")
    i_cfg = _entry_cfg(head["quant_cfg"], "*input_quantizer")
    if isinstance(qc, dict):
        for key in [k for k in qc if "lm_head" in k]:
            del qc[key]
        qc["*lm_head*weight_quantizer"] = w_cfg
        qc["*lm_head*input_quantizer"] = i_cfg
    else:
        qc[:] = [e for e in qc if "lm_head" not in str(e.get("quantizer_name", ""))]
        qc.append({"quantizer_name": "*lm_head*weight_quantizer", "cfg": w_cfg})
        qc.append({"quantizer_name": "*lm_head*input_quantizer", "cfg": i_cfg})
    return cfg


def _check_format(value: str | None, what: str, allow_none: bool) -> str | None:
    if value is None and allow_none:
        return None
    key = str(value).lower()
    if key not in QUANT_FORMATS:
        choices = sorted(QUANT_FORMATS) + (
            ["None (keep the checkpoint dtype)"] if allow_none else []
        )
        raise ConfigError(f"{what}={value!r} is not supported; choose one of {choices}")
    return key


def _calibration_batches(
    src: Path,
    calib_prompts: Sequence[str] | None,
    calib_inputs: Sequence[torch.Tensor] | None,
    max_samples: int,
    max_seq_len: int,
) -> list[torch.Tensor]:
    if calib_inputs is not None:
        batches = []
        for i, ids in enumerate(list(calib_inputs)[:max_samples]):
            ids = torch.as_tensor(ids)
            if ids.dtype not in (torch.int64, torch.int32) or ids.dim() not in (1, 2):
                raise ConfigError(
                    f"calib_inputs[{i}]: expected a LongTensor [T] or [B, T] of token ids, "
                    f"got {ids.dtype} {list(ids.shape)}"
                )
            batches.append((ids.unsqueeze(0) if ids.dim() == 1 else ids).long()[:, :max_seq_len])
    else:
        from transformers import AutoTokenizer

        prompts = list(calib_prompts) if calib_prompts is not None else default_calib_prompts()
        tok_files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
        if not any((src / f).is_file() for f in tok_files):
            # transformers 5 would silently build an empty tokenizer from config.json
            raise CheckpointError(
                f"{src}: no tokenizer files ({', '.join(tok_files)}) for calibration; add the "
                "tokenizer to the checkpoint or pass calib_inputs (token ids)"
            )
        try:
            tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
            raise CheckpointError(
                f"{src}: cannot load the tokenizer for calibration ({exc}); add the tokenizer "
                "files to the checkpoint or pass calib_inputs (token ids)"
            ) from None
        batches = [
            tok(p, return_tensors="pt", truncation=True, max_length=max_seq_len).input_ids
            for p in prompts[:max_samples]
        ]
    batches = [b for b in batches if b.numel() > 0]
    if not batches:
        raise ConfigError(
            "no calibration data: every prompt / token sequence is empty (is the tokenizer "
            "complete?); give non-empty prompts or calib_inputs"
        )
    return batches


def _safetensors_dtypes(ckpt: Path) -> dict[str, str]:
    """name -> safetensors dtype string, read from the file headers only."""
    out: dict[str, str] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        out.update({k: v["dtype"] for k, v in header.items() if k != "__metadata__"})
    return out


def _finish_export(
    tmp: Path, src: Path, want: QuantAlgo, lm_head: str | None, tie_embeddings: bool
) -> None:
    """Copy tokenizer files, untie a quantized head in config.json, check the export."""
    for name in _TOKENIZER_FILES:
        if (src / name).is_file() and not (tmp / name).exists():
            shutil.copy2(src / name, tmp / name)
    cfg_path = tmp / "config.json"
    config = json.loads(cfg_path.read_text("utf-8"))
    if lm_head is not None and tie_embeddings:
        # The export stores a separate (quantized) lm_head next to the BF16 embedding; a loader
        # that honoured tie_word_embeddings would drop the quantized head.
        config["tie_word_embeddings"] = False
        cfg_path.write_text(json.dumps(config, indent=2) + "\n", "utf-8")
        log.info("lm_head quantized separately from the tied embedding: tie_word_embeddings=false")
    if not (tmp / "hf_quant_config.json").is_file():
        raise QuantFormatError(
            f"ModelOpt export wrote no hf_quant_config.json in {tmp}; nothing was quantized "
            "(does the model have nn.Linear layers?)"
        )
    qcfg = load_quant_config(tmp, config)
    if qcfg.algo is not want:
        raise QuantFormatError(
            f"{qcfg.source}: quant_algo is {qcfg.algo.value}, expected {want.value}; "
            "the ModelOpt export did not quantize as asked"
        )
    dtypes = _safetensors_dtypes(tmp)
    n_scales = sum(1 for k in dtypes if k.endswith(".weight_scale"))
    if not n_scales:
        raise QuantFormatError(f"{tmp}: the exported safetensors hold no quantized weights")
    if lm_head is not None and dtypes.get("lm_head.weight") not in ("U8", "F8_E4M3"):
        raise QuantFormatError(
            f"{tmp}: lm_head={lm_head!r} was asked but 'lm_head.weight' was exported as "
            f"{dtypes.get('lm_head.weight', 'absent')}; the model's head is not named lm_head"
        )
    log.info("export checked: %s, %d quantized linear weights", qcfg.algo.value, n_scales)


def quantize_checkpoint(
    src: Path,
    out: Path,
    quant: str = "nvfp4",
    lm_head: str | None = None,
    calib_prompts: list[str] | None = None,
    max_calib_samples: int = 32,
    calib_inputs: list[torch.Tensor] | None = None,
    *,
    max_seq_len: int = 512,
    dtype: torch.dtype | None = None,
    device: str = "cpu",
    overwrite: bool = False,
) -> Path:
    """Quantize a Hugging Face causal-LM checkpoint with ModelOpt and export it.

    Args:
        src: checkpoint directory (``config.json`` + safetensors, tokenizer unless
            ``calib_inputs`` is given). Read with ``local_files_only``; nothing is downloaded.
        out: output directory; must not exist (or be empty) unless ``overwrite``.
        quant: ``"nvfp4"`` (ModelOpt ``NVFP4_DEFAULT_CFG``) or ``"fp8"`` (``FP8_DEFAULT_CFG``).
        lm_head: None keeps the head in the checkpoint dtype (ModelOpt's default);
            ``"nvfp4"`` / ``"fp8"`` quantizes it too (a different format than ``quant`` gives a
            ``MIXED_PRECISION`` checkpoint). With tied embeddings the embedding stays unquantized
            and the exported ``config.json`` says ``tie_word_embeddings: false``.
        calib_prompts: calibration texts (default: ``edgebuild/data/calib_prompts.txt``).
        max_calib_samples: at most this many prompts / sequences are run.
        calib_inputs: token id tensors (``LongTensor [T]`` or ``[B, T]``) used instead of
            prompts, e.g. for a checkpoint without a tokenizer.
        max_seq_len: calibration sequences are truncated to this many tokens.
        dtype: dtype of the unquantized tensors in the export (default: the checkpoint's).
        device: where calibration runs (``"cpu"`` works, see the module docstring).
        overwrite: replace an existing non-empty ``out``.

    Returns:
        ``out``, which then holds ``config.json`` (with ``quantization_config``),
        ``hf_quant_config.json``, ``model*.safetensors`` and the tokenizer files.

    Raises:
        MissingDependencyError: nvidia-modelopt or requests is not installed.
        ConfigError: unknown ``quant`` / ``lm_head`` or empty calibration data.
        CheckpointError: ``src`` is not a loadable checkpoint, ``out`` exists, no tokenizer.
        QuantFormatError: the export did not produce the requested format.
    """
    quant_key = _check_format(quant, "quant", allow_none=False)
    head_key = _check_format(lm_head, "lm_head", allow_none=True)
    assert quant_key is not None
    src, out = _check_dirs(Path(src).resolve(), Path(out).resolve(), overwrite)
    mtq, export_hf_checkpoint = _import_modelopt()
    qcfg, want = _modelopt_cfg(mtq, quant_key, head_key)

    batches = _calibration_batches(src, calib_prompts, calib_inputs, max_calib_samples, max_seq_len)
    model = _load_model(src, device)
    tie = bool(getattr(model.config, "tie_word_embeddings", False))

    log.info(
        "quantizing to %s (lm_head: %s) with %d calibration samples on %s",
        quant_key,
        head_key or "unquantized",
        len(batches),
        device,
    )
    mtq.quantize(model, qcfg, _forward_loop(batches, device))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        log.info("exporting to %s", tmp)
        with torch.no_grad():
            export_hf_checkpoint(model, dtype=dtype, export_dir=tmp)
        _finish_export(tmp, src, want, head_key, tie)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote %s", out)
    return out


def _modelopt_cfg(mtq, quant_key: str, head_key: str | None) -> tuple[dict, QuantAlgo]:
    """ModelOpt's quantization config (head included when ``head_key``) and the format the
    export must then have (``MIXED_PRECISION`` for a head in another format)."""
    cfg_name, want = QUANT_FORMATS[quant_key]
    qcfg = lm_head_quant_cfg(
        getattr(mtq, cfg_name), getattr(mtq, QUANT_FORMATS[head_key][0]) if head_key else None
    )
    if head_key is not None and head_key != quant_key:
        want = QuantAlgo.MIXED_PRECISION
    return qcfg, want


def _forward_loop(batches: list[torch.Tensor], device: str):
    """ModelOpt's calibration callback: run every batch of token ids through the model."""

    def forward_loop(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for i, ids in enumerate(batches):
                m(input_ids=ids.to(device))
                if (i + 1) % 8 == 0 or i + 1 == len(batches):
                    log.info("calibration %d/%d", i + 1, len(batches))

    return forward_loop


def _check_dirs(src: Path, out: Path, overwrite: bool) -> tuple[Path, Path]:
    """``src`` must be a checkpoint, ``out`` another directory, absent or empty unless
    ``overwrite`` (CheckpointError otherwise)."""
    if not (src / "config.json").is_file():
        raise CheckpointError(
            f"{src}: no config.json; expected a Hugging Face checkpoint directory"
        )
    if out == src:
        raise CheckpointError(f"{out}: the output directory must differ from the source checkpoint")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise CheckpointError(f"{out} already exists and is not empty; remove it or pass overwrite")
    return src, out


def _load_model(src: Path, device: str):
    """The transformers causal LM of ``src`` on ``device`` in eval mode (local files only).

    Raises:
        CheckpointError: transformers cannot load it.
    """
    from transformers import AutoModelForCausalLM

    log.info("loading %s", src)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(src), local_files_only=True, dtype="auto")
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
        raise CheckpointError(f"{src}: transformers cannot load this checkpoint ({exc})") from None
    model = model.to(device).eval()
    if not getattr(model.config, "architectures", None):
        model.config.architectures = [type(model).__name__]  # export needs it
    return model


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move ``tmp`` to ``out`` in one rename (an existing ``out`` is moved aside first)."""
    old = None
    if out.exists():
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        else:
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
