"""Paged KV cache: one page allocator, per-sequence page lists, and the per-layer pools.

Layout of each layer's pool (the attention contract, spec/attention-plugin.md):
`[num_pages, 2, num_kv_heads, page_size, head_dim]` (index 0 = K post-norm post-RoPE, 1 = V).
A sequence owns a list of pages; logical slot t of the sequence lives in page
`pages[t // page_size]` at offset `t % page_size`. Rolling back by n rows only lowers the
length (and frees pages that became empty); the stale rows are overwritten by the next write.
The allocator is storage-agnostic so the TensorRT backend reuses it with device pools.

**Prefix caching** (vLLM's automatic prefix caching): a full page of prompt rows may be
registered under the chained hash of its token block (:func:`block_hashes`); a later sequence
whose prompt starts with the same blocks attaches those pages instead of recomputing them.
Pages are refcounted and shared read-only: a sequence never writes below its
``shared_rows`` (writes only happen at rows >= ``length``, and rolling back into a shared page
is refused). A registered page whose last user is gone stays cached ("evictable"); it is
reused for new rows only when the free list is empty, least recently released first, and
:attr:`PageAllocator.free_pages` counts it as free. Only rows written by the prefill path
are registered (the decoders' job): decode / verify rows are computed by another attention
kernel and would give a later request other bits than a cold prefill.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from edgebuild.errors import RequestError

SMALL_TABLE = 1024  # PageAllocator.page_table builds up to this many entries from lists


class CacheCapacityError(RequestError):
    """Not enough free KV pages for a request (raised before any model work)."""


@dataclass
class Sequence:
    """One sequence's view of a paged cache: its pages and valid length (rows).

    `rope_delta`: RoPE position of cache slot t is t + rope_delta for rows without explicit
    positions (multimodal RoPE after an image prompt; 0 otherwise).
    `shared_rows`: the leading rows that live in prefix-cache pages (read-only: attached from
    the cache or registered into it); the sequence may never be rolled back below them.
    """

    seq_id: int
    pages: list[int] = field(default_factory=list)
    length: int = 0
    freed: bool = False
    rope_delta: int = 0
    shared_rows: int = 0


@dataclass
class RingSequence(Sequence):
    """A windowed DSpark draft's context on a fixed ring of pages (:class:`DraftRing`):
    ``length`` slots in use, slot t holding position ``base + t``; ``total`` = ``base +
    length`` context rows seen."""

    base: int = 0
    total: int = 0


@dataclass(frozen=True)
class DraftRing:
    """The fixed ring of a sliding-window draft's context cache, the same rule on every
    backend (:mod:`edgebuild.runtime.dspark_backend`, :mod:`edgebuild.runtime.trt.draft`).

    A request takes its ``pages`` pages at its first context row and keeps them until it is
    freed. Slot t holds position ``base + t``; when a write (or the block after it) would run
    past the ring, the oldest page moves to the end (``base`` += page size), so the page
    table is a rotation of the same pages. Only the rows a later block can see are written
    (the last ``window`` of a write); a recycled page's rows that are not rewritten lie at
    slots >= the context length or older than the window, which the attention window hides.
    The block's own rows are never written, so rejecting drafts leaves nothing to undo across
    the wrap: the ring only ever advances by accepted target rows.

    Attributes:
        window: W, the draft's ``sliding_window`` (positions a block row sees).
        pages: pages per request
            (:func:`~edgebuild.checkpoint.dspark_config.ring_pages`).
        page_size: rows per page.
    """

    window: int
    pages: int
    page_size: int

    @property
    def rows(self) -> int:
        return self.pages * self.page_size

    def make_room(self, allocator: PageAllocator, seq: RingSequence, end: int) -> None:
        """Own the ring (its pages taken on first use), then rotate until it covers
        positions below ``end``.

        Raises:
            CacheCapacityError: no ring is free (nothing is taken then).
        """
        if not seq.pages:
            allocator.reserve(seq, self.rows)
        while seq.base + self.rows < end:
            seq.pages.append(seq.pages.pop(0))
            seq.base += self.page_size
        seq.length = max(seq.total - seq.base, 0)

    def first_written(self, seq: RingSequence, rows: int) -> int:
        """Position of the first of ``rows`` new context rows that a later block can see
        (older ones are never written); call after :meth:`make_room`."""
        end = seq.total + rows
        return max(seq.total, end - self.window, seq.base)

    def advance(self, seq: RingSequence, rows: int) -> None:
        """``rows`` context rows were written (positions up to ``total + rows``)."""
        seq.total += rows
        seq.length = seq.total - seq.base

    @staticmethod
    def state(seq: RingSequence) -> tuple:
        """What :meth:`restore` puts back (page order, base, length, total)."""
        return list(seq.pages), seq.base, seq.length, seq.total

    @staticmethod
    def restore(allocator: PageAllocator, seq: RingSequence, state: tuple) -> None:
        """Undo :meth:`make_room` after a failed call: the page order and counters of
        ``state``; a ring taken by that call goes back to the pool. Rows the failed call
        wrote into a recycled page are not restored (an engine failure leaves its rows
        undefined, as on a full cache)."""
        pages, seq.base, seq.length, seq.total = state
        if pages:
            seq.pages[:] = pages
        elif seq.pages:  # taken by the failed call
            seq.length = 0
            allocator.rollback(seq, 0)


def block_hashes(token_ids: Seq[int], page_size: int) -> list[bytes]:
    """Chained hashes of the full `page_size`-token blocks of `token_ids` (a partial last
    block has none): ``h_i = sha256(h_{i-1} || int64 bytes of block i)``, h_{-1} empty.

    The chain makes a block's hash name the whole prefix up to and including it.
    """
    out, parent = [], b""
    for i in range(len(token_ids) // page_size):
        block = token_ids[i * page_size : (i + 1) * page_size]
        h = hashlib.sha256(parent)
        h.update(torch.tensor(list(block), dtype=torch.int64).numpy().tobytes())
        parent = h.digest()
        out.append(parent)
    return out


class PageAllocator:
    """Hands out fixed-size pages; shares only registered prefix pages (module docstring).

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
        self._refs = [0] * num_pages  # sequences holding each page
        self._page_of: dict[bytes, int] = {}  # block hash -> cached page
        self._hash_of: dict[int, bytes] = {}  # cached page -> block hash
        self._payload: dict[int, object] = {}  # cached page -> what the registrant kept
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount-0 cached, LRU first

    @property
    def free_pages(self) -> int:
        """Pages a reservation may take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def cached_pages(self) -> int:
        """Pages registered in the prefix cache (in use or evictable)."""
        return len(self._hash_of)

    def refcount(self, page: int) -> int:
        """Sequences holding `page` now (0: free, or cached and evictable)."""
        return self._refs[page]

    def _take(self) -> int:
        if self._free:
            page = self._free.pop()
        else:  # evict the least recently released cached page
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._hash_of.pop(page)]
            self._payload.pop(page, None)
        self._refs[page] = 1
        return page

    def _release(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] < 0:
            raise RuntimeError(f"page {page} released more often than taken")
        if self._refs[page] == 0:
            if page in self._hash_of:
                self._evictable[page] = None  # most recently released: evicted last
            else:
                self._free.append(page)

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
        if need > self.free_pages:
            raise CacheCapacityError(
                f"KV cache full: need {need} more pages of {self.page_size} rows, "
                f"{self.free_pages} free of {self.num_pages}; raise --max-kv-cache-capacity "
                "or lower the batch size"
            )
        for _ in range(max(need, 0)):
            seq.pages.append(self._take())

    def advance(self, seq: Sequence, rows: int) -> None:
        """Mark `rows` reserved rows as written."""
        if seq.length + rows > len(seq.pages) * self.page_size:
            raise RuntimeError("advance past reserved pages")
        seq.length += rows

    def rollback(self, seq: Sequence, rows: int) -> None:
        """Drop the last `rows` rows (0 <= rows <= length); free pages that became empty.

        Raises:
            ValueError: a bad row count; RuntimeError: a rollback into the sequence's shared
                prefix pages (a later write would overwrite rows other sequences read).
        """
        if rows < 0 or rows > seq.length:
            raise ValueError(f"rollback of {rows} rows on a sequence of {seq.length}")
        if seq.length - rows < seq.shared_rows:
            raise RuntimeError(
                f"rollback of sequence {seq.seq_id} to {seq.length - rows} rows would reopen "
                f"its shared prefix pages ({seq.shared_rows} rows)"
            )
        seq.length -= rows
        keep = self.pages_for(seq.length)
        while len(seq.pages) > keep:
            self._release(seq.pages.pop())

    def truncate(self, seq: Sequence, length: int) -> None:
        """Roll back to exactly `length` rows."""
        self.rollback(seq, seq.length - length)

    def free(self, seq: Sequence) -> None:
        """Return all pages of `seq` (idempotent)."""
        if not seq.freed:
            for page in reversed(seq.pages):  # the tail of a prompt is evicted first
                self._release(page)
            seq.pages.clear()
            seq.length = seq.shared_rows = 0
            seq.freed = True

    # ------------------------------------------------------------------ prefix cache
    def match(self, hashes: Seq[bytes]) -> list[int]:
        """Cached pages of the longest prefix of `hashes` (chained, :func:`block_hashes`)
        that the cache holds; nothing changes (no refcount, no LRU touch)."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def evictable_among(self, pages: Seq[int]) -> int:
        """How many of `pages` are evictable (attaching them uses that many free pages)."""
        return sum(1 for p in pages if self._refs[p] == 0)

    def payloads(self, pages: Seq[int]) -> list:
        """What was registered with each cached page (None where nothing was)."""
        return [self._payload.get(p) for p in pages]

    def attach(self, seq: Sequence, pages: Seq[int]) -> None:
        """Start an empty sequence with cached `pages` (from :meth:`match`) as its first rows.

        Raises:
            RuntimeError: a sequence that already holds rows, or a page not in the cache.
        """
        if seq.freed or seq.pages or seq.length:
            raise RuntimeError(f"attach to sequence {seq.seq_id}, which is not empty")
        for p in pages:
            if p not in self._hash_of:
                raise RuntimeError(f"page {p} is not in the prefix cache")
        for p in pages:
            if self._refs[p] == 0:
                del self._evictable[p]
            self._refs[p] += 1
        seq.pages = list(pages)
        seq.length = seq.shared_rows = len(pages) * self.page_size

    def register(self, seq: Sequence, index: int, block_hash: bytes, payload=None) -> bool:
        """Put page `index` of `seq` (full, written) in the cache under `block_hash`.

        Returns False when the hash is cached already (the page then stays private). The
        page becomes read-only: `seq.shared_rows` covers it.

        Raises:
            RuntimeError: the page is not full of written rows.
        """
        if (index + 1) * self.page_size > seq.length:
            raise RuntimeError(f"register of page {index} of a sequence of {seq.length} rows")
        page = seq.pages[index]
        if block_hash in self._page_of or page in self._hash_of:
            return False
        self._page_of[block_hash], self._hash_of[page] = page, block_hash
        if payload is not None:
            self._payload[page] = payload
        seq.shared_rows = max(seq.shared_rows, (index + 1) * self.page_size)
        return True

    def page_table(self, seqs: list[Sequence]) -> torch.Tensor:
        """int32 [B, max_pages] page table (unused entries 0)."""
        width = max(1, max(len(s.pages) for s in seqs))
        if len(seqs) * width <= SMALL_TABLE:  # one tensor from the padded lists (a zeros + a
            # copy per sequence cost ~10 us each); a large table pads less in torch
            return torch.tensor(
                [list(s.pages) + [0] * (width - len(s.pages)) for s in seqs], dtype=torch.int32
            ).view(len(seqs), width)
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
