"""Pieces shared by the model definitions: the paged-batch metadata and weight loading helpers.

Models never import the runtime: the runtime builds a :class:`PagedBatch` and passes per-layer
KV pools in; models call :mod:`edgebuild.ops` for attention, RoPE and norms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from edgebuild.checkpoint.quant import QuantizedWeight
from edgebuild.errors import CheckpointError


@dataclass
class PagedBatch:
    """Where the new rows of a step go in the paged KV cache.

    Attributes:
        page_table: int32 [B, max_pages_per_seq], physical page ids per sequence.
        past_lengths: int32 [B], rows already valid in the cache per sequence.
        input_lengths: int32 [B], valid new rows per sequence (the rest of S is padding).
        positions: int32 [B, S], RoPE position of each new row.
    """

    page_table: torch.Tensor
    past_lengths: torch.Tensor
    input_lengths: torch.Tensor
    positions: torch.Tensor


class RMSNorm(nn.Module):
    """RMSNorm with HF parameter name `weight` [dim]; math in :func:`edgebuild.ops.norm.rms_norm`."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from edgebuild.ops.norm import rms_norm

        return rms_norm(x, self.weight, self.eps)


def dense(value: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """A weight as a dense tensor of `dtype` (NVFP4/FP8 dequantized: the CPU path)."""
    if isinstance(value, QuantizedWeight):
        return value.dequantize(dtype)
    return value.to(dtype)


def check_shape(name: str, file: str, got: tuple, want: tuple, field_hint: str = "") -> None:
    """Raise CheckpointError when a tensor's shape does not match what the config implies."""
    if tuple(got) != tuple(want):
        hint = f" ({field_hint})" if field_hint else ""
        raise CheckpointError(
            f"{file}: tensor '{name}' has shape {list(got)} but the config implies "
            f"{list(want)}{hint}; the weights and config.json do not belong together"
        )
