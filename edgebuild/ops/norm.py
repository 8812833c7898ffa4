"""RMSNorm as Hugging Face Llama / Qwen2 / Qwen3 compute it (the fp32-variance variant)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x**2, -1) + eps)).to(x.dtype)``, variance in fp32.

    Identical to ``LlamaRMSNorm.forward`` / ``Qwen3RMSNorm.forward`` (transformers 5.14): the
    normalisation runs in fp32, is cast back to ``x.dtype``, then multiplied by ``weight`` (so the
    result dtype is ``torch.promote_types(weight.dtype, x.dtype)``, as in HF).

    Args:
        x: ``[..., N]`` any float dtype.
        weight: ``[N]``.
        eps: added to the mean square (HF ``rms_norm_eps``, typically 1e-5 or 1e-6).

    Returns:
        ``[..., N]``.

    Raises:
        ValueError: if ``weight`` is not ``[N]`` with ``N = x.shape[-1]``.
    """
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm weight must be [{x.shape[-1]}] for input {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)
