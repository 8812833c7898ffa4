"""The one writer of tiny random transformers checkpoints for the tests.

:func:`write_tiny_checkpoint` builds a transformers config from the fields it is given, seeds
torch, instantiates the HF model and saves it with ``save_pretrained`` (safetensors,
``config.json`` with ``architectures``). The fixture modules' writers (``export_fixtures``,
``modelopt_fixtures``, ``serve_fixtures``, ``test_dspark_decoding``,
``test_train_dspark_forward``) delegate to it with their own sizes, so the files they write
are the ones they always wrote (their oracles stay valid).
"""

from __future__ import annotations

from pathlib import Path

import torch

# arch -> (transformers config class, model class); the model class is `architectures[0]`
ARCHS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}

# the DSpark decoding tests' target: tied, vocab 96, 4 layers, 1024 positions
TINY_LLAMA = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)


def write_tiny_checkpoint(
    out: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    sharpen: float = 1.0,
    **config,
) -> Path:
    """Write a random transformers checkpoint to `out` and return `out`.

    Args:
        arch: a key of :data:`ARCHS` (``qwen3``: q/k norm; ``llama``; ``qwen2``: q/k/v bias).
        seed: ``torch.manual_seed`` before the model is built (its random init).
        dtype: the saved weights' dtype (``model.safetensors``; ``config.json``'s dtype).
        sharpen: factor on ``embed_tokens`` after init (tied: ``lm_head`` too): sharper
            logits, less degenerate greedy continuations.
        config: the HF config fields (``hidden_size``, ``tie_word_embeddings``, ...).

    Raises:
        KeyError: an unknown `arch`.
    """
    import transformers

    config_cls, model_cls = ARCHS[arch]
    cfg = getattr(transformers, config_cls)(**config, architectures=[model_cls])
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg)
    if dtype != torch.float32:
        model = model.to(dtype)
    if sharpen != 1.0:
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(sharpen)
    model.eval().save_pretrained(str(out), safe_serialization=True)
    return Path(out)


def write_tiny_llama(
    path: Path, vocab: int = 96, layers: int = 4, seed: int = 0, sharpen: float = 20.0
) -> Path:
    """The DSpark tests' tiny tied Llama target (:data:`TINY_LLAMA`, vocab / layers as given)."""
    fields = {**TINY_LLAMA, "vocab_size": vocab, "num_hidden_layers": layers}
    return write_tiny_checkpoint(path, "llama", seed=seed, sharpen=sharpen, **fields)
