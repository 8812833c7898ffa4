"""Tensor shapes a config implies, and the one shape check (re-exported by models.common).

In ``checkpoint`` so that a draft is validated against its tensors (:mod:`edgebuild.checkpoint.draft`)
without importing the models.
"""

from __future__ import annotations

from edgebuild.errors import CheckpointError


def layer_linear_shapes(
    hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int
) -> dict[str, tuple[int, int]]:
    """[out, in] of each linear of a pre-norm decoder layer (HF names, relative to the layer).

    Shared by the target (`llama.py`) and the DSpark draft (`dspark.py`), whose layers have
    the same Qwen3/Llama geometry.
    """
    return {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (intermediate, hidden),
        "mlp.up_proj": (intermediate, hidden),
        "mlp.down_proj": (hidden, intermediate),
    }


def check_shape(name: str, file: str, got: tuple, want: tuple, field_hint: str = "") -> None:
    """Raise CheckpointError when a tensor's shape does not match what the config implies."""
    if tuple(got) != tuple(want):
        hint = f" ({field_hint})" if field_hint else ""
        raise CheckpointError(
            f"{file}: tensor '{name}' has shape {list(got)} but the config implies "
            f"{list(want)}{hint}; the weights and config.json do not belong together"
        )
