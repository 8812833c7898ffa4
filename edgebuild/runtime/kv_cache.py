"""Paged KV cache: one page allocator, per-sequence page lists, and the per-layer pools.

Layout of each layer's pool (the attention contract, spec/attention-plugin.md):
`[num_pages, 2, num_kv_heads, page_size, head_dim]` (index 0 = K post-norm post-RoPE, 1 = V).
A sequence owns a list of pages; logical slot t of the sequence lives in page
`pages[t // page_size]` at offset `t % page_size`. Rolling back by n rows only lowers the
length (and frees pages that became empty); the stale rows are overwritten by the next write.
The allocator is storage-agnostic so the TensorRT backend reuses it with device pools.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from edgebuild.errors import RequestError


class CacheCapacityError(RequestError):
    """Not enough free KV pages for a request (raised before any model work)."""


@dataclass
class Sequence:
    """One sequence's view of a paged cache: its pages and valid length (rows).

    `rope_delta`: RoPE position of cache slot t is t + rope_delta for rows without explicit
    positions (multimodal RoPE after an image prompt; 0 otherwise).
    """

    seq_id: int
    pages: list[int] = field(default_factory=list)
    length: int = 0
    freed: bool = False
    rope_delta: int = 0


class PageAllocator:
    """Hands out fixed-size pages; never shares a page between sequences.

    Args:
        num_pages: pages in the pool.
        page_size: rows (tokens) per page.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))
        self._ids = itertools.count()

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, rows: int) -> int:
        """Pages needed to hold `rows` rows."""
        return -(-rows // self.page_size)

    def new_sequence(self) -> Sequence:
        return Sequence(next(self._ids))

    def reserve(self, seq: Sequence, new_rows: int) -> None:
        """Make room for `new_rows` more rows after `seq.length`.

        Raises:
            CacheCapacityError: the pool has too few free pages (nothing is allocated then).
        """
        if seq.freed:
            raise RuntimeError(f"sequence {seq.seq_id} was freed")
        need = self.pages_for(seq.length + new_rows) - len(seq.pages)
        if need > len(self._free):
            raise CacheCapacityError(
                f"KV cache full: need {need} more pages of {self.page_size} rows, "
                f"{len(self._free)} free of {self.num_pages}; raise --max-kv-cache-capacity "
                "or lower the batch size"
            )
        for _ in range(max(need, 0)):
            seq.pages.append(self._free.pop())

    def advance(self, seq: Sequence, rows: int) -> None:
        """Mark `rows` reserved rows as written."""
        if seq.length + rows > len(seq.pages) * self.page_size:
            raise RuntimeError("advance past reserved pages")
        seq.length += rows

    def rollback(self, seq: Sequence, rows: int) -> None:
        """Drop the last `rows` rows (0 <= rows <= length); free pages that became empty."""
        if rows < 0 or rows > seq.length:
            raise ValueError(f"rollback of {rows} rows on a sequence of {seq.length}")
        seq.length -= rows
        keep = self.pages_for(seq.length)
        while len(seq.pages) > keep:
            self._free.append(seq.pages.pop())

    def truncate(self, seq: Sequence, length: int) -> None:
        """Roll back to exactly `length` rows."""
        self.rollback(seq, seq.length - length)

    def free(self, seq: Sequence) -> None:
        """Return all pages of `seq` (idempotent)."""
        if not seq.freed:
            self._free.extend(reversed(seq.pages))
            seq.pages.clear()
            seq.length = 0
            seq.freed = True

    def page_table(self, seqs: list[Sequence]) -> torch.Tensor:
        """int32 [B, max_pages] page table (unused entries 0)."""
        width = max(1, max(len(s.pages) for s in seqs))
        table = torch.zeros(len(seqs), width, dtype=torch.int32)
        for b, s in enumerate(seqs):
            if s.pages:
                table[b, : len(s.pages)] = torch.tensor(s.pages, dtype=torch.int32)
        return table


def allocate_pools(
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> list[torch.Tensor]:
    """Per-layer KV pools, each [num_pages, 2, num_kv_heads, page_size, head_dim]."""
    return [
        torch.zeros(num_pages, 2, num_kv_heads, page_size, head_dim, dtype=dtype, device=device)
        for _ in range(num_layers)
    ]
