"""Device buffers of the TensorRT backend: each role's engine inputs/outputs at their largest
shape (:class:`RoleBuffers`, bound as contiguous prefix views), the tap ring of the target's
tapped hidden states (:class:`TapRing`), and the host-side helpers that pad rows, build page
tables and reserve KV pages within the engines' limits (the overview is
:mod:`edgebuild.runtime.trt_backend`'s docstring)."""

from __future__ import annotations

import contextlib
import math
from typing import Protocol

import torch

from edgebuild.errors import EngineError
from edgebuild.runtime.kv_cache import CacheCapacityError, PageAllocator, Sequence
from edgebuild.runtime.trt_plan import (
    DTYPES,
    KV_INPUT,
    KV_OUTPUT,
    BufferPlan,
    EngineLimits,
    RoleIO,
)


class EngineRunner(Protocol):
    """Runs one role's engine on bound buffers (:class:`~edgebuild.runtime.trt_engine.TrtEngineRunner`)."""

    def execute(
        self, profile: int, bindings: dict[str, torch.Tensor], graph_key: tuple | None = None
    ) -> None: ...


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


# ----------------------------------------------------------------------------- buffers
class RoleBuffers:
    """The buffers of one role, allocated once from the plan; calls bind prefix views.

    Args:
        plan: the backend's buffer plan.
        role: ``base``, ``draft`` or ``visual``.
        io: the role's declared I/O (binding order).
        device: where device buffers live (``cuda``; ``cpu`` in the CPU tests).
    """

    def __init__(self, plan: BufferPlan, role: str, io: RoleIO, device: torch.device | str):
        self.io, self.device = io, torch.device(device)
        pin = self.device.type == "cuda"
        self.device_bufs: dict[str, torch.Tensor] = {}
        self.host_bufs: dict[str, torch.Tensor] = {}
        for spec in plan.role(role, "device"):
            if spec.alias_of is None:
                self.device_bufs[spec.name] = torch.zeros(
                    spec.shape, dtype=DTYPES[spec.dtype], device=self.device
                )
        for spec in plan.role(role, "host"):
            self.host_bufs[spec.name] = torch.zeros(
                spec.shape, dtype=DTYPES[spec.dtype], pin_memory=pin
            )

    def pool(self, name: str) -> torch.Tensor:
        """A KV pool (``kv_cache_i``), full shape."""
        return self.device_bufs[name]

    @staticmethod
    def prefix(buf: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The contiguous view of ``buf``'s first ``prod(shape)`` elements as ``shape``."""
        return buf.view(-1)[: math.prod(shape)].view(shape)

    def bind(
        self,
        host_inputs: dict[str, torch.Tensor],
        device_shapes: dict[str, tuple[int, ...]],
    ) -> dict[str, torch.Tensor]:
        """Views for every I/O tensor of one call, host inputs copied to the device.

        ``host_inputs``: the values of the inputs written from the host (their shapes are the
        call's); ``device_shapes``: the shapes of every other non-KV tensor. KV inputs and
        outputs are bound to the whole pool (the same memory: the plugin updates in place).
        """
        views = {}
        for desc in (*self.io.inputs, *self.io.outputs):
            name = desc.name
            if name.startswith(KV_INPUT):
                views[name] = self.device_bufs[name]
            elif name.startswith(KV_OUTPUT):
                views[name] = self.device_bufs[KV_INPUT + name[len(KV_OUTPUT) :]]
            elif name in host_inputs:
                value = host_inputs[name]
                stage = self.prefix(self.host_bufs[name], tuple(value.shape))
                stage.copy_(value)
                views[name] = self.prefix(self.device_bufs[name], tuple(value.shape))
                views[name].copy_(stage, non_blocking=True)
            else:
                views[name] = self.prefix(self.device_bufs[name], device_shapes[name])
        return views

    def read_back(self, name: str, device_view: torch.Tensor) -> torch.Tensor:
        """Enqueue the copy of an output view into its host staging; returns the host view."""
        host = self.prefix(self.host_bufs[name], tuple(device_view.shape))
        host.copy_(device_view, non_blocking=True)
        return host


class TapRing:
    """Device rows holding each target sequence's latest tapped hidden states.

    The decoder keeps one pending feature block per request (the taps of its latest target
    call) until the draft consumes it; a sequence's new write releases its previous block.
    Blocks are placed first-fit in a ring of :attr:`EngineLimits.tap_ring_rows` rows.

    Args:
        rows: a preallocated device tensor [ring_rows, n_taps * hidden].
    """

    def __init__(self, rows: torch.Tensor):
        self.rows = rows
        self.live: dict[int, tuple[int, int]] = {}  # seq_id -> (start, count)
        self.head = 0

    def _fits(self, start: int, n: int) -> bool:
        if start + n > self.rows.shape[0]:
            return False
        return all(start + n <= s or s + m <= start for s, m in self.live.values())

    def write(self, seq_id: int, src: torch.Tensor) -> torch.Tensor:
        """Copy ``src`` [n, F] (device) into the ring for ``seq_id``; returns the ring view.

        Raises:
            EngineError: no room (more pending feature rows than the ring holds).
        """
        self.live.pop(seq_id, None)
        n = int(src.shape[0])
        candidates = [self.head, 0, *(s + m for s, m in self.live.values())]
        start = next((c for c in candidates if self._fits(c, n)), None)
        if start is None:
            pending = sum(m for _, m in self.live.values())
            raise EngineError(
                f"tap ring full: {n} rows for sequence {seq_id} do not fit beside {pending} "
                f"pending rows of {len(self.live)} sequences ({self.rows.shape[0]} rows); "
                "lower the number of concurrent requests or rebuild with a larger max batch"
            )
        view = self.rows[start : start + n]
        view.copy_(src)
        self.live[seq_id] = (start, n)
        self.head = start + n
        return view

    def release(self, seq_id: int) -> None:
        self.live.pop(seq_id, None)


def _pad(rows: list[list[int]] | list[torch.Tensor], width: int, fill: int = 0) -> torch.Tensor:
    out = torch.full((len(rows), width), fill, dtype=torch.int32)
    for b, r in enumerate(rows):
        r = torch.as_tensor(r, dtype=torch.int32)
        out[b, : r.shape[0]] = r
    return out


def _page_table(allocator: PageAllocator, seqs: list[Sequence], width: int) -> torch.Tensor:
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    for b, s in enumerate(seqs):
        if s.pages:
            table[b, : len(s.pages)] = torch.tensor(s.pages, dtype=torch.int32)
    return table


def _reserve(allocator: PageAllocator, limits: EngineLimits, seqs, lengths) -> None:
    """Reserve pages for new rows; a sequence may not outgrow the engine's page table."""
    for s, n in zip(seqs, lengths, strict=True):
        if allocator.pages_for(s.length + n) > limits.pages_per_seq:
            raise CacheCapacityError(
                f"sequence of {s.length + n} rows exceeds the engines' KV capacity of "
                f"{limits.kv_capacity} rows per sequence (build.max_kv_cache_capacity); "
                "shorten the request or rebuild the bundle with a larger capacity"
            )
    done = []
    try:
        for s, n in zip(seqs, lengths, strict=True):
            done.append((s, s.length))
            allocator.reserve(s, n)
    except CacheCapacityError:
        for s, length in done:
            allocator.truncate(s, length)
        raise
