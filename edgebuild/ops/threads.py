"""torch's intra-op threads around the CPU runtime's small torch ops."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def one_thread():
    """torch's intra-op threads set to 1 inside (restored after): for small torch ops between
    edgebuild's kernels (the draft's top-k over the vocabulary, the lattice's matmuls, the
    context's fc; a pending-context buffer's growth copy). At two threads an OpenMP region
    leaves a worker spinning for a while on the core edgebuild's kernel pool needs (and the
    other way round): a draft pass's int4 linears took 2.5x, top-k 3x their one-thread time,
    and one parallel copy of a grown pending buffer slowed the int4 decode steps after it by
    ~3% (bench/README.md). edgebuild's kernels size their pool from the same setting, so a
    short context update's linears and attention run on one thread too (measured faster as a
    whole: a draft pass 4.3 -> 2.7 ms at two threads). The setting is process-wide: the
    runtime's one worker thread owns the model, so nothing else runs torch meanwhile."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


# torch opens an OpenMP region for an elementwise op over more than this many elements
# (at::internal::GRAIN_SIZE)
OPENMP_GRAIN = 32768


def converted(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, on one thread (:func:`one_thread`) where ``t`` holds more than
    :data:`OPENMP_GRAIN` elements, so the conversion opens no OpenMP region whose spinning
    worker would take the core the kernels' pool needs. A bf16 runtime's logits (a SmolLM2 row:
    49,152 values, rounded to bf16 after the fp32 kernel, then widened for sampling) were its
    only such ops in a decode step: bf16 at two threads decoded no faster than at one
    (bench/README.md, runs of 2026-12-06 12:50 UTC). Any shape and dtypes; returns ``t``
    itself where it already has ``dtype``."""
    if t.dtype == dtype or t.numel() <= OPENMP_GRAIN:
        return t.to(dtype)
    with one_thread():
        return t.to(dtype)
