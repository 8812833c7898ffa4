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
