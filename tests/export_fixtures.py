"""Helpers for the export / engine / bundle tests: tiny checkpoints, a tokenizer, graph inputs.

Plain functions writing into the directory they are given; test files wrap them in
``tmp_path_factory`` fixtures. Everything is tiny (hidden 64, 2-3 layers) so that a graph
exports in seconds on a shared CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tiny_checkpoints import write_tiny_checkpoint

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def make_tiny_target(
    out: Path, arch: str = "qwen3", tied: bool = False, seed: int = 0, **overrides
) -> Path:
    """A random transformers checkpoint (fp32): ``qwen3`` (q/k norm), ``llama`` or ``qwen2``
    (:data:`TINY` sizes; tests/tiny_checkpoints.py writes it)."""
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    fields = {**TINY, **extra, **overrides, "tie_word_embeddings": tied}
    return write_tiny_checkpoint(Path(out), arch, seed=seed, **fields)


def write_tiny_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer over ``t0 .. t{V-1}`` (``t1`` = EOS) saved as tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(Path(out) / "tokenizer.json"))
    (Path(out) / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t1", "unk_token": "t0"}
        )
    )


def base_feeds(cfg, batch: int = 2, rows: int = 5, capacity: int = 16, seed: int = 1) -> dict:
    """Portable ``base`` inputs: unequal lengths, one sequence with a random cached past."""
    g = torch.Generator().manual_seed(seed)
    past = torch.tensor([0, 4][:batch], dtype=torch.int32)
    lengths = torch.tensor([rows, rows - 2][:batch], dtype=torch.int32)
    feeds = {
        "input_ids": torch.randint(0, cfg.vocab_size, (batch, rows), generator=g).int(),
        "positions": (past[:, None] + torch.arange(rows)[None]).int(),
        "past_lengths": past,
        "input_lengths": lengths,
        "logits_rows": (lengths - 1).unsqueeze(1).int(),
    }
    shape = (batch, 2, cfg.num_key_value_heads, capacity, cfg.head_dim)
    for i in range(cfg.num_hidden_layers):
        feeds[f"kv_cache_{i}"] = torch.randn(*shape, generator=g)
    return feeds


def draft_feeds(cfg, batch: int = 2, context: int = 6, capacity: int = 24, seed: int = 3) -> dict:
    """Portable ``draft`` inputs for an empty cache: the first context update + block."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([context, context - 2][:batch], dtype=torch.int32)
    feeds = {
        "context_features": torch.randn(batch, context, cfg.fc_in_features, generator=g),
        "context_positions": torch.arange(context).int().expand(batch, context).contiguous(),
        "context_lengths": lengths,
        "past_lengths": torch.zeros(batch, dtype=torch.int32),
        "anchor_ids": torch.tensor([7, 42][:batch], dtype=torch.int32),
        "block_positions": (lengths[:, None] + torch.arange(cfg.block_size)[None]).int(),
    }
    shape = (batch, 2, cfg.num_key_value_heads, capacity, cfg.head_dim)
    for i in range(cfg.num_hidden_layers):
        feeds[f"kv_cache_{i}"] = torch.zeros(*shape)
    return feeds


def run_ort(onnx_path: Path, feeds: dict) -> dict[str, np.ndarray]:
    """Run a graph in onnxruntime (CPU); returns {output name: array}."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    outs = sess.run(None, {k: v.detach().numpy() for k, v in feeds.items()})
    return {o.name: v for o, v in zip(sess.get_outputs(), outs, strict=True)}


def walk_greedy(candidates: np.ndarray, scores: np.ndarray, b: int) -> tuple[list[int], list[int]]:
    """Greedy chain walk over the draft lattice: (tokens, index of prev candidate per slot)."""
    j = int(np.argmax(scores[b, 0, 0]))
    tokens, prev = [int(candidates[b, 0, j])], [0]
    for slot in range(1, candidates.shape[1]):
        i = j
        j = int(np.argmax(scores[b, slot, i]))
        tokens.append(int(candidates[b, slot, j]))
        prev.append(i)
    return tokens, prev
