"""edgebuild's C++ decode / verify attention for the CPU runtime (``kernels/decode_attention.cpp``).

Why: a decode step's attention through torch ops (gather the pages into a dense copy, build
the per-row problem, ``scaled_dot_product_attention``, scatter the output back) cost ~200 us
a layer for SmolLM2 at a 64-row context, a quarter of an int4 decode step, almost all of it
per-op overhead (bench/README.md). The kernel reads K/V in place from the pages and runs
each (row, head) alone in fp32 (scores, softmax, weighted sum; one rounding to the compute
dtype at the end), so a row's bits do not depend on the other rows of the pass: DSpark's
verify rows equal target-only's decode rows, as with the torch path it replaces.

Built at first use by :mod:`edgebuild.ops.cpu_build` (``-march=native``; g++ and ninja).
``EDGEBUILD_ATTENTION_KERNEL``: ``auto`` (the default: this kernel where it builds, else the
torch path, with one log line saying why) or ``torch`` (always the torch path).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import shutil
from pathlib import Path

import torch

from edgebuild.errors import MissingDependencyError
from edgebuild.ops import cpu_build

log = logging.getLogger("edgebuild.runtime")

SOURCE = Path(__file__).resolve().parent / "kernels" / "decode_attention.cpp"
ENV = "EDGEBUILD_ATTENTION_KERNEL"
FLAGS = ["-march=native"]
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _load() -> bool:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "torch"):
        raise MissingDependencyError(f"{ENV}={mode!r}: use auto or torch")
    if mode == "torch":
        return False
    why, fixable = None, True
    if platform.system() != "Linux":
        why, fixable = f"not a Linux host ({platform.system()})", False
    elif (
        shutil.which("g++") is None
        and shutil.which("c++") is None
        and cpu_build.prebuilt(SOURCE, FLAGS) is None
    ):
        why = "no C++ compiler (g++) on PATH to build it"
    else:
        try:
            cpu_build.build_and_load(SOURCE, FLAGS)
        except Exception as exc:  # a compiler or torch extension failure: fall back
            why = f"it could not be built or loaded ({cpu_build.first_error(exc)})"
    if why is None:
        log.info("attention: edgebuild's decode kernel (%s)", SOURCE.name)
        return True
    log.log(
        logging.WARNING if fixable else logging.INFO,
        "attention: the torch decode path (edgebuild's kernel: %s)", why,
    )  # fmt: skip
    return False


def available() -> bool:
    """Whether :func:`decode_attention` runs here (``EDGEBUILD_ATTENTION_KERNEL``).

    Raises:
        MissingDependencyError: ``EDGEBUILD_ATTENTION_KERNEL`` is not auto / torch.
    """
    return _load()


def usable(q_dtype: torch.dtype, cache: torch.Tensor, head_dim: int) -> bool:
    """True when the kernel takes this call: bf16 / fp32, the cache in the compute dtype,
    contiguous, and a head size that is a multiple of 16."""
    return (
        q_dtype in DTYPES
        and cache.dtype == q_dtype
        and cache.is_contiguous()
        and head_dim % 16 == 0
        and available()
    )


def decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    page_table: torch.Tensor,
    row_b: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of R new rows over their sequences' pages.

    Args:
        q: [R, Hq, D] the rows' queries (normalized and rotated), bf16 or fp32.
        cache: [num_pages, 2, Hkv, page_size, D] the KV pool in q's dtype (the rows' own K/V
            already written).
        page_table: int64 [B, pages] physical pages of each sequence.
        row_b: int64 [R] the sequence of each row.
        mask: bool [R, T] the key columns each row sees (column t = slot t of its sequence).
        scale: the softmax scale (usually D ** -0.5).

    Returns:
        [R, Hq * D] in q's dtype.

    Raises:
        RuntimeError: shapes or dtypes outside the above (the message names the argument).
    """
    return torch.ops.edgebuild_attn.decode_attention(
        q.contiguous(), cache, page_table.long().contiguous(), row_b.long(), mask.contiguous(),
        float(scale),
    )  # fmt: skip


def decode_step(
    heads: torch.Tensor,
    cache: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    write_b: torch.Tensor,
    write_i: torch.Tensor,
    write_pages: torch.Tensor,
    write_offsets: torch.Tensor,
    page_table: torch.Tensor,
    mask: torch.Tensor | None,
    hq: int,
    scale: float,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    new_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """A layer's decode / verify attention in one call: the valid rows' q and k normalized
    (optional) and rotated, their K/V written to the pool, then :func:`decode_attention`.

    The rotation is :func:`edgebuild.ops.rope.rotate_with`'s, operation for operation (fp32,
    each product and sum rounded on its own, one rounding to the model dtype), so without
    norms the pool and the output equal the torch ops' bit for bit
    (tests/test_attention_fast.py). The norm is HF's per-head RMSNorm (``Qwen3RMSNorm``:
    ``w * dtype(x * rsqrt(mean(x^2) + eps))``) with the sum of squares in fp64, as the fp32
    linear kernels' norm; it may differ from torch's fp32 sum in the last bit.

    Args:
        heads: contiguous [B, S, Hq + 2 * Hkv, D] the projected rows, bf16 or fp32.
        cache: [num_pages, 2, Hkv, page_size, D] the KV pool in heads' dtype; written in place.
        cos, sin: fp32 contiguous [B, S, rotary_dim / 2] the rows' RoPE halves (rotary_dim 0:
            no rotation; channels past rotary_dim pass through).
        write_b, write_i: int64 [R] batch / row index of each valid row.
        write_pages, write_offsets: int64 [R] the pool page and slot of each valid row's K/V.
        page_table: int64 [B, pages].
        mask: bool [R, T] the pool's key columns each row sees; None: the K/V are written and
            nothing is attended (a draft's context update), an empty [0, Hq * D] returned.
        hq: query heads; scale: the softmax scale.
        q_norm, k_norm: [D] per-head RMSNorm weights (Qwen3, DSpark drafts), or None.
        eps: the norms' epsilon.
        new_mask: bool [R, S] (a non-causal draft block): nothing is written; row r attends
            the pool's keys in ``mask`` and then the step's new rows s of its own sequence where
            ``new_mask[r, s]`` (their k normalized and rotated, their v as projected).

    Returns:
        [R, Hq * D] in heads' dtype.

    Raises:
        RuntimeError: shapes, dtypes or indices outside the above (the message names them).
    """
    return torch.ops.edgebuild_attn.decode_step(
        heads, cache, cos, sin, write_b, write_i, write_pages, write_offsets, page_table, mask,
        hq, float(scale), q_norm, k_norm, float(eps), new_mask,
    )  # fmt: skip
