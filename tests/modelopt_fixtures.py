"""Tiny checkpoints for tests: a random Qwen3 and its ModelOpt NVFP4 export.

Plain functions (no global cache): each writes into the directory it is given. Test files wrap
them in ``tmp_path_factory`` session fixtures. Building the tiny NVFP4 checkpoint needs
nvidia-modelopt (``pip install 'edgebuild[quant]'``) and takes a couple of seconds on a CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_checkpoints import write_tiny_checkpoint

TINY_QWEN3 = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1000,
    intermediate_size=128,
    max_position_embeddings=512,
)


def make_tiny_qwen3(
    tmp_dir: Path,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write a random transformers ``Qwen3ForCausalLM`` checkpoint (no tokenizer) and return its dir.

    hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 16, vocab 1000, intermediate 128;
    ``model.safetensors`` in ``dtype``; ``config.json`` with ``architectures`` set.
    The directory is ``tmp_dir / "qwen3-tiny[-tied]"``.
    """
    out = Path(tmp_dir) / ("qwen3-tiny-tied" if tie_word_embeddings else "qwen3-tiny")
    fields = {**TINY_QWEN3, "tie_word_embeddings": tie_word_embeddings}
    return write_tiny_checkpoint(out, "qwen3", seed=seed, dtype=dtype, **fields)


def random_calib_inputs(n: int = 8, seq_len: int = 24, vocab: int = 1000, seed: int = 1):
    """``n`` LongTensors [1, seq_len] of random token ids (calibration without a tokenizer)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, seq_len), generator=g) for _ in range(n)]


def make_tiny_nvfp4_qwen3(
    tmp_dir: Path,
    quantize_lm_head: bool,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """A tiny Qwen3 quantized to NVFP4 by :func:`edgebuild.quantize.quantize_checkpoint`.

    The BF16 source is written to ``tmp_dir/src-*`` and the export to
    ``tmp_dir/qwen3-tiny-nvfp4[-head][-tied]`` (returned). Calibrates on random token ids.
    ``quantize_lm_head`` stores ``lm_head.weight`` as NVFP4 too.
    """
    from edgebuild.quantize import quantize_checkpoint

    tmp_dir = Path(tmp_dir)
    name = "qwen3-tiny-nvfp4" + ("-head" if quantize_lm_head else "")
    name += "-tied" if tie_word_embeddings else ""
    src = make_tiny_qwen3(
        tmp_dir / f"src-{name}", tie_word_embeddings=tie_word_embeddings, seed=seed
    )
    return quantize_checkpoint(
        src,
        tmp_dir / name,
        quant="nvfp4",
        lm_head="nvfp4" if quantize_lm_head else None,
        calib_inputs=random_calib_inputs(),
    )
