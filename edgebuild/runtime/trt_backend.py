"""The TensorRT backend: :class:`TrtTarget` and :class:`TrtDraft` over a bundle's engines.

Both implement the protocols of :mod:`edgebuild.runtime.backend`, so the decoders of
:mod:`edgebuild.runtime.decoding` drive them exactly as they drive the torch backend.

Memory (all sized by :func:`edgebuild.runtime.trt_plan.plan_buffers` and allocated once, at
load): every engine input/output at its largest shape (a call binds contiguous prefix views
of these), host staging for what the host writes and reads back, and per layer a device KV
page pool for the base and for the draft. The pools are addressed through the same
:class:`~edgebuild.runtime.kv_cache.PageAllocator` page tables as the CPU backend ("one
allocator, two storage backends"): the allocator hands out page ids, the engine's
``page_table`` input carries them, the plugin reads and writes the pool in place.

One step of DSpark decoding on this backend (the words of :mod:`edgebuild.runtime.decoding`):

1. **verify**: the base engine runs [anchor, drafts] in its ``generate`` profile; the tapped
   hidden states are copied, on the device, into the tap ring (:class:`TapRing`) and handed to
   the decoder as device views; the logits rows are copied to the host (the decoder needs
   them to accept: that is the step's one synchronisation on the target side).
2. **update_context** only remembers the accepted rows' device views.
3. **propose**: the draft engine's single call writes those rows into the draft KV pool
   (context update) and runs the block pass; the pending features go from the tap ring to the
   draft's ``context_features`` input by a device-to-device copy (no host round trip). The
   top-k lattice (``[B, n, K]`` ids, ``[B, n, K, K]`` scores, ``[B, n, K]`` confidences) is
   copied to the host and walked by :func:`walk_lattice` (the decoder needs the tokens on the
   host to build the verify rows: the draft side's one synchronisation).

Decode, verify and draft calls pass a CUDA-graph key ``(batch, rows, ...)`` to the engine
runner (:mod:`edgebuild.runtime.trt_engine`), which captures shapes that repeat.

Images (a vision-language target; its bundle has a ``visual`` role and a multimodal base
graph, see :mod:`edgebuild.export.graphs` and :mod:`edgebuild.export.visual`):

1. :class:`TrtVisual` runs the ``visual`` engine once per request (when the request is
   created): the host builds the :class:`~edgebuild.models.vision.VisionPlan` of its images
   (window and segment indices, 2-D rotary rows, merge order) and binds it with the pixel
   rows; the ``image_embeds`` output is copied, on the device, into a tensor the request keeps
   until its prefill (the one per-request device allocation of this backend; the engine's
   output buffer is reused by the next pass).
2. The prefill runs the base engine's multimodal graph: the prompt's image pad rows carry the
   ids ``vocab_size + k`` (prompt-table style) and row ``k`` of the ``image_embeds`` input is
   filled, device to device, from the request's embeddings; the rows' RoPE positions are the
   3-axis ``mrope_positions``. Decode and verify rows are text: 1-row table, positions
   ``slot + rope_delta`` on every axis.
3. The DSpark draft's first context is the multimodal prefill's taps (image rows included),
   as for a text prompt.

Checked on the CPU only (stand-in engines that run the exported graphs eagerly, in
``tests/test_trt_vlm.py``); real TensorRT engines and GPU execution of this path have not been
run here.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from edgebuild.errors import ConfigError, EngineError, MissingDependencyError, RequestError
from edgebuild.models.image_processing import ImageInput
from edgebuild.models.vision import VisionConfig, VisionPlan
from edgebuild.runtime.backend import MultimodalPrefill, Proposal, TargetStep
from edgebuild.runtime.kv_cache import CacheCapacityError, PageAllocator, Sequence
from edgebuild.runtime.markov_walk import walk_lattice
from edgebuild.runtime.multimodal import ImageInputError, VisionEncoder
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.runtime.trt_plan import (
    DTYPES,
    KV_INPUT,
    KV_OUTPUT,
    TAP_RING,
    TAPS_OUTPUT,
    BufferPlan,
    EngineLimits,
    Profile,
    RoleIO,
    choose_profile,
    plan_buffers,
    role_io,
    role_profiles,
)

log = logging.getLogger("edgebuild.runtime")


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


# ----------------------------------------------------------------------------- target
IMAGE_TABLE = "image_embeds"  # the multimodal base engine's image-embedding input


def _fill_image_table(
    table: torch.Tensor,  # [N_call, d] device view of the base engine's image_embeds input
    images: list[MultimodalPrefill | None],
) -> None:
    """Copy each prompt's image embeddings (device) into the call's table, in batch order
    (the rows :meth:`TrtTarget._inputs` gave the ids ``vocab_size + row``)."""
    offset = 0
    for m in images:
        if m is not None and m.num_image_rows:
            n = m.num_image_rows
            table[offset : offset + n].copy_(m.image_embeds)  # device to device
            offset += n


class TrtTarget:
    """TargetBackend on the ``base`` engine (module docstring).

    A base engine with an ``image_embeds`` input (a VLM bundle) also runs multimodal
    prefills (``images`` of :meth:`forward`); a text engine refuses them.

    Args:
        runner: the base engine runner.
        io, profiles: the role's declared I/O and optimization profiles.
        plan: the buffer plan (sizes every allocation).
        tap_layers: the layers the engine's ``target_hidden_states`` concatenates.
        max_model_len: longest sequence the model supports (RoPE table rows).
        device: where the buffers live; stream: the CUDA stream (None on the CPU).
    """

    def __init__(
        self,
        runner: EngineRunner,
        io: RoleIO,
        profiles: list[Profile],
        plan: BufferPlan,
        tap_layers: tuple[int, ...],
        max_model_len: int,
        device: torch.device | str = "cuda",
        stream=None,
    ):
        self.runner, self.io, self.profiles, self.stream = runner, io, profiles, stream
        self.limits = plan.limits
        self.tap_layers = tuple(tap_layers)
        self.vocab_size = int(io.get("logits").dims[-1])
        self.max_model_len = min(max_model_len, self.limits.kv_capacity)
        self.buffers = RoleBuffers(plan, "base", io, device)
        self.allocator = PageAllocator(self.limits.num_pages, self.limits.page_size)
        has_taps = TAPS_OUTPUT in io.names()
        self.ring = TapRing(self.buffers.device_bufs[TAP_RING]) if has_taps else None
        self.generate = self._generate_profile()
        self.multimodal = IMAGE_TABLE in io.names()
        # image rows one call may carry (the prefill profile's image_tokens axis), 0: none
        self.max_image_rows = (
            max(p.shapes[IMAGE_TABLE][2][0] for p in profiles) if self.multimodal else 0
        )

    def _generate_profile(self) -> int | None:
        """The profile decode/verify calls run in (CUDA-graph keys are only made for it)."""
        names = [p.name for p in self.profiles]
        return names.index("generate") if "generate" in names else None

    def new_sequence(self) -> Sequence:
        return self.allocator.new_sequence()

    def can_fit(self, rows: int) -> bool:
        return self.allocator.pages_for(rows) <= self.limits.pages_per_seq

    def rollback(self, seq: Sequence, rows: int) -> None:
        self.allocator.rollback(seq, rows)

    def free(self, seq: Sequence) -> None:
        if self.ring is not None:
            self.ring.release(seq.seq_id)
        self.allocator.free(seq)

    @torch.inference_mode()
    def forward(
        self,
        seqs: list[Sequence],
        rows: list[torch.Tensor],  # per sequence int64 [n_b]
        logits_rows: list[list[int]],
        tap_layers: tuple[int, ...] = (),
        images: list[MultimodalPrefill | None] | None = None,
        prefill: bool = False,
    ) -> TargetStep:
        """Append ``rows[b]`` to sequence b; fp32 host logits of ``logits_rows[b]`` and, when
        asked, device taps [n_b, n_t * d] (views of the tap ring, valid until the sequence's
        next forward). Batches larger than the engines' max batch (or, with images, than
        one call's image rows) run in chunks.

        ``images[b]``: the prefill of a prompt with images (its image rows and embeddings,
        3-axis positions); see the module docstring. ``prefill`` (prompt rows) changes
        nothing here: the engines run their own context phase.

        Raises:
            ConfigError: taps the engine was not built with; images for a base engine
                without an ``image_embeds`` input.
            RequestError: more rows than the engines' max input length, or one prompt with
                more image rows than the engine's image table.
            CacheCapacityError: a sequence beyond the engines' KV capacity.
        """
        images = list(images) if images is not None else [None] * len(seqs)
        if any(m is not None for m in images) and not self.multimodal:
            raise ConfigError(
                "an image prompt on a base engine without an image_embeds input (a text "
                "target's bundle, or a VLM bundle built before image support); rebuild the "
                "bundle from the vision-language checkpoint with `edgebuild build`"
            )
        if tap_layers and tuple(tap_layers) != self.tap_layers:
            raise ConfigError(
                f"taps of layers {list(tap_layers)} asked for, but the base engine was built "
                f"with taps {list(self.tap_layers)} (manifest roles.base.tap_layers)"
            )
        logits, taps = [], []
        for chunk in self._chunks(images):
            out = self._forward_chunk(
                seqs[chunk], rows[chunk], logits_rows[chunk], bool(tap_layers), images[chunk]
            )
            logits += out[0]
            taps += out[1]
        return TargetStep(logits, taps if tap_layers else None)

    def _chunks(self, images: list[MultimodalPrefill | None]) -> list[slice]:
        """Consecutive calls of at most max-batch sequences and ``max_image_rows`` image rows."""
        out, start, used = [], 0, 0
        for i, m in enumerate(images):
            n = m.num_image_rows if m is not None else 0
            if n > self.max_image_rows:
                raise RequestError(
                    f"a prompt with {n} image rows; the base engine takes at most "
                    f"{self.max_image_rows} per call (build.max_image_tokens)"
                )
            if i - start == self.limits.max_batch or used + n > self.max_image_rows:
                out.append(slice(start, i))
                start, used = i, 0
            used += n
        out.append(slice(start, len(images)))
        return out

    def _inputs(self, seqs, rows, logits_rows, images) -> dict[str, torch.Tensor]:
        """Host inputs of one call; image pad rows get the ids ``vocab_size + table row``."""
        lengths = [int(r.shape[0]) for r in rows]
        width, r_max = max(lengths), max(len(r) for r in logits_rows)
        slots = torch.tensor([s.length + s.rope_delta for s in seqs], dtype=torch.int32)
        sel = [list(r) + [r[-1] if r else 0] * (r_max - len(r)) for r in logits_rows]
        ids = _pad(rows, width)  # [B, S]
        positions = slots[:, None] + torch.arange(width, dtype=torch.int32)[None, :]  # [B, S]
        inputs = {
            "input_ids": ids,
            "past_lengths": torch.tensor([s.length for s in seqs], dtype=torch.int32),
            "input_lengths": torch.tensor(lengths, dtype=torch.int32),
            "logits_rows": _pad(sel, r_max),
            "page_table": _page_table(self.allocator, seqs, self.limits.pages_per_seq),
        }
        if not self.multimodal:
            inputs["positions"] = positions
            return inputs
        mrope = positions[None].expand(3, -1, -1).clone()  # [3, B, S]: text rows t = h = w
        offset = 0
        for b, m in enumerate(images):
            if m is None:
                continue
            n = m.num_image_rows
            table_rows = torch.arange(offset, offset + n, dtype=torch.int32)
            ids[b, m.image_rows] = self.vocab_size + table_rows
            mrope[:, b, : m.positions.shape[1]] = m.positions.to(torch.int32)
            offset += n
        inputs["mrope_positions"] = mrope
        return inputs

    def _forward_chunk(self, seqs, rows, logits_rows, want_taps: bool, images):
        lengths = [int(r.shape[0]) for r in rows]
        width = max(lengths)
        if width > self.limits.max_input_len:
            raise RequestError(
                f"{width} rows in one call exceed the engines' max input length "
                f"{self.limits.max_input_len} (build.max_input_len)"
            )
        _reserve(self.allocator, self.limits, seqs, lengths)
        old = [s.length for s in seqs]
        try:
            inputs = self._inputs(seqs, rows, logits_rows, images)
            shapes = {k: tuple(v.shape) for k, v in inputs.items()}
            device_shapes = self._output_shapes(len(seqs), width, shapes)
            if self.multimodal:  # the image table: device rows, at least one
                n_img = sum(m.num_image_rows for m in images if m is not None)
                width_d = int(self.io.get(IMAGE_TABLE).dims[-1])
                shapes[IMAGE_TABLE] = device_shapes[IMAGE_TABLE] = (max(1, n_img), width_d)
            profile = choose_profile(self.profiles, shapes)
            key = (len(seqs), width, shapes["logits_rows"][1]) if profile == self.generate else None
            with _on(self.stream):
                views = self.buffers.bind(inputs, device_shapes)
                if self.multimodal:
                    _fill_image_table(views[IMAGE_TABLE], images)
                self.runner.execute(profile, views, key)
                host_logits = self.buffers.read_back("logits", views["logits"])
                taps = []
                if want_taps:
                    hidden = views[TAPS_OUTPUT]
                    taps = [
                        self.ring.write(s.seq_id, hidden[b, :n])
                        for b, (s, n) in enumerate(zip(seqs, lengths, strict=True))
                    ]
            if self.stream is not None:
                self.stream.synchronize()  # the decoder reads the logits now
        except BaseException:
            for s, length in zip(seqs, old, strict=True):
                self.allocator.truncate(s, length)
            raise
        for s, n in zip(seqs, lengths, strict=True):
            self.allocator.advance(s, n)
        logits = [host_logits[b, : len(r)].clone() for b, r in enumerate(logits_rows)]
        return logits, taps

    def _output_shapes(self, batch: int, width: int, shapes: dict) -> dict[str, tuple[int, ...]]:
        out = {"logits": (batch, shapes["logits_rows"][1], self.vocab_size)}
        if self.ring is not None:
            out[TAPS_OUTPUT] = (batch, width, self.ring.rows.shape[1])
        return out


# ----------------------------------------------------------------------------- draft
class TrtDraft:
    """DraftBackend on the ``draft`` engine (module docstring).

    Args:
        runner: the draft engine runner.
        io, profiles, plan: as for :class:`TrtTarget`.
        block_size: the draft's block size (slots of the lattice).
        target_layer_ids: the target taps it reads.
        device, stream: as for :class:`TrtTarget`.
    """

    def __init__(
        self,
        runner: EngineRunner,
        io: RoleIO,
        profiles: list[Profile],
        plan: BufferPlan,
        block_size: int,
        target_layer_ids: tuple[int, ...],
        vocab_size: int,
        device: torch.device | str = "cuda",
        stream=None,
    ):
        self.runner, self.io, self.profiles, self.stream = runner, io, profiles, stream
        self.limits = plan.limits
        self.block_size = block_size
        self.target_layer_ids = tuple(target_layer_ids)
        self.vocab_size = vocab_size
        self.buffers = RoleBuffers(plan, "draft", io, device)
        self.allocator = PageAllocator(self.limits.num_pages, self.limits.page_size)
        self.has_confidence = "draft_confidence" in io.names()
        self.pending: dict[int, torch.Tensor] = {}  # seq_id -> [m, F] device features
        self.top_k = int(io.get("draft_candidate_ids").dims[-1])

    def new_sequence(self) -> Sequence:
        return self.allocator.new_sequence()

    def free(self, seq: Sequence) -> None:
        self.pending.pop(seq.seq_id, None)
        self.allocator.free(seq)

    def update_context(self, seqs: list[Sequence], features: list[torch.Tensor]) -> None:
        """Remember the new context rows [m_b, n_t * d] (device); the next propose writes them."""
        for s, f in zip(seqs, features, strict=True):
            if s.seq_id in self.pending:
                f = torch.cat([self.pending[s.seq_id], f])
            self.pending[s.seq_id] = f

    @torch.inference_mode()
    def propose(
        self,
        seqs: list[Sequence],
        anchors: list[int],
        num_tokens: list[int],
        params: list[SamplingParams],
        generators: list[torch.Generator],
    ) -> list[Proposal]:
        """One draft call per chunk of at most max-batch sequences: context update + block."""
        out = []
        step = self.limits.max_batch
        for i in range(0, len(seqs), step):
            c = slice(i, i + step)
            out += self._propose_chunk(seqs[c], anchors[c], num_tokens[c], params[c], generators[c])
        return out

    def _inputs(self, seqs, anchors, counts) -> dict[str, torch.Tensor]:
        width = max(1, max(counts))
        past = torch.tensor([s.length for s in seqs], dtype=torch.int32)
        ar = torch.arange(width, dtype=torch.int32)[None, :]
        block = torch.arange(self.block_size, dtype=torch.int32)[None, :]
        return {
            "context_positions": past[:, None] + ar,
            "context_lengths": torch.tensor(counts, dtype=torch.int32),
            "past_lengths": past,
            "anchor_ids": torch.tensor(anchors, dtype=torch.int32),
            "block_positions": (past + torch.tensor(counts, dtype=torch.int32))[:, None] + block,
            "page_table": _page_table(self.allocator, seqs, self.limits.pages_per_seq),
        }

    def _propose_chunk(self, seqs, anchors, num_tokens, params, generators) -> list[Proposal]:
        feats = [self.pending.get(s.seq_id) for s in seqs]
        counts = [0 if f is None else int(f.shape[0]) for f in feats]
        width = max(1, max(counts))
        if width > self.limits.max_input_len:
            raise RequestError(
                f"{width} new context rows exceed the draft engine's max input length "
                f"{self.limits.max_input_len}"
            )
        _reserve(self.allocator, self.limits, seqs, counts)
        old = [s.length for s in seqs]
        try:
            inputs = self._inputs(seqs, anchors, counts)
            profile = choose_profile(self.profiles, {k: tuple(v.shape) for k, v in inputs.items()})
            key = (len(seqs), width) if width <= self.limits.verify_len else None
            with _on(self.stream):
                f_dim = self.io.get("context_features").dims[-1]
                views = self.buffers.bind(inputs, self._device_shapes(len(seqs), width, f_dim))
                ctx = views["context_features"]
                for b, f in enumerate(feats):
                    if f is not None and len(f):
                        ctx[b, : f.shape[0]].copy_(f)  # device to device (tap ring -> input)
                self.runner.execute(profile, views, key)
                lattice = [
                    self.buffers.read_back(name, views[name])
                    for name in ("draft_candidate_ids", "draft_scores", "draft_confidence")
                    if name in views
                ]
            if self.stream is not None:
                self.stream.synchronize()  # the walk needs the lattice on the host
        except BaseException:
            for s, length in zip(seqs, old, strict=True):
                self.allocator.truncate(s, length)
            raise
        for s, m in zip(seqs, counts, strict=True):
            self.allocator.advance(s, m)
            self.pending.pop(s.seq_id, None)
        conf = lattice[2] if self.has_confidence else None
        return walk_lattice(lattice[0], lattice[1], conf, num_tokens, params, generators)

    def _device_shapes(self, batch: int, width: int, f_dim: int) -> dict[str, tuple[int, ...]]:
        n, k = self.block_size, self.top_k
        out = {
            "context_features": (batch, width, f_dim),
            "draft_candidate_ids": (batch, n, k),
            "draft_scores": (batch, n, k, k),
        }
        if self.has_confidence:
            out["draft_confidence"] = (batch, n, k)
        return out


# ----------------------------------------------------------------------------- visual
class TrtVisual:
    """The ``visual`` engine as an image tower (:class:`~edgebuild.runtime.multimodal.ImageTower`).

    One engine call per request (all its images in one pass, module docstring step 1).

    Args:
        runner: the visual engine runner.
        io, profiles, plan: the role's declared I/O, optimization profile and the buffer plan.
        config: the checkpoint's vision config (patch geometry, merge size, window size).
        device, stream: as for :class:`TrtTarget`.

    Attributes:
        max_tokens: image tokens one pass accepts (``build.max_image_tokens``).
        max_images: images one pass accepts (``build.max_images``).
    """

    def __init__(
        self,
        runner: EngineRunner,
        io: RoleIO,
        profiles: list[Profile],
        plan: BufferPlan,
        config: VisionConfig,
        device: torch.device | str = "cuda",
        stream=None,
    ):
        self.runner, self.io, self.profiles, self.stream = runner, io, profiles, stream
        self.config = config
        self.buffers = RoleBuffers(plan, "visual", io, device)
        self.dtype = DTYPES[io.get("pixel_values").dtype]
        self.width = int(io.get("image_embeds").dims[-1])
        if self.width != config.out_hidden_size:
            raise EngineError(
                f"the visual engine's image_embeds are {self.width} wide but the checkpoint's "
                f"vision_config.out_hidden_size is {config.out_hidden_size}; rebuild the bundle"
            )
        # the profile's largest token axis (merge_order) and segment axis (one per image)
        self.max_tokens = max(p.shapes["merge_order"][2][0] for p in profiles)
        self.max_images = max(p.shapes["full_index"][2][0] for p in profiles)

    @torch.inference_mode()
    def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Embeddings of preprocessed images: one ``[tokens_k, out_hidden_size]`` device tensor
        per image (engine dtype), in order.

        Raises:
            ImageInputError: more image tokens or images than the engine was built for.
        """
        plan = VisionPlan.build(self.config, [im.grid_thw for im in images])
        frames = int(plan.full.index.shape[0])
        if plan.num_tokens > self.max_tokens or frames > self.max_images:
            raise ImageInputError(
                f"{len(images)} images of {plan.num_tokens} image tokens in one request; the "
                f"visual engine takes at most {self.max_images} images of {self.max_tokens} "
                "tokens (build.max_images / build.max_image_tokens): send fewer or smaller "
                "images, or rebuild the bundle with larger limits"
            )
        pixels = torch.cat([im.pixel_values for im in images]).to(self.dtype)
        inputs = plan.engine_inputs(pixels)
        profile = choose_profile(self.profiles, {k: tuple(v.shape) for k, v in inputs.items()})
        with _on(self.stream):
            views = self.buffers.bind(inputs, {"image_embeds": (plan.num_tokens, self.width)})
            self.runner.execute(profile, views, None)
            out = views["image_embeds"].clone()  # the request's copy: the buffer is reused
        if self.stream is not None:
            self.stream.synchronize()  # the host staging of this pass is reused by the next
        cu = plan.cu_tokens
        return [out[cu[k] : cu[k + 1]] for k in range(len(images))]


# ----------------------------------------------------------------------------- loading
@dataclass(frozen=True)
class TrtOptions:
    """How the TensorRT backend runs.

    plugin_library: the plugin ``.so`` (default: ``$EDGEBUILD_PLUGIN_LIB`` or plugins/build).
    cuda_graphs: capture decode / verify / draft shapes that repeat.
    """

    plugin_library: Path | None = None
    cuda_graphs: bool = True


@dataclass
class TrtRuntime:
    """The loaded TensorRT backends of a bundle, and what the LLM needs around them (the
    TensorRT side of :class:`edgebuild.runtime.torch_backend.TorchRuntime`)."""

    target: TrtTarget
    draft: TrtDraft | None
    config: object  # the target's ModelConfig
    plan: BufferPlan
    runners: dict[str, object] = field(default_factory=dict)
    vision: VisionEncoder | None = None  # the visual engine + image processor (VLM bundles)
    target_model: None = None  # no torch target model on this backend (TorchRuntime has one)

    def runtime_options(self, options):
        """RuntimeOptions clamped to the engines: the KV pool (every page of the engines'
        pools), the per-sequence capacity (build.max_kv_cache_capacity), prompt, page size,
        images per prompt."""
        from dataclasses import replace

        lim = self.plan.limits
        images = options.max_images
        if self.vision is not None:
            images = min(images, self.vision.max_images)
        return replace(
            options,
            max_kv_rows=lim.num_pages * lim.page_size,
            max_seq_rows=lim.kv_capacity,
            max_input_len=lim.max_input_len,
            page_size=lim.page_size,
            max_images=images,
        )

    def decoder(self, spec, prefill=None):
        """The decoder over these engines (`prefill`: a resolved PrefillConfig; the prefix
        cache lives in the target's page allocator, shared with the engines' pools).

        Raises:
            ConfigError: a `draft_top_k` given in the speculative config that differs from
                the candidate count the draft engine was built with (it is part of the
                engine's shapes and cannot change at run time).
        """
        from edgebuild.runtime.decoding import TargetOnlyDecoder
        from edgebuild.runtime.prefill import PrefillConfig
        from edgebuild.speculative.registry import get_method

        lim = self.plan.limits  # chunks never above the engines' max input length
        prefill = (prefill or PrefillConfig()).resolved(lim.page_size, lim.max_input_len)
        if prefill.enable_prefix_caching or prefill.enable_chunked_prefill:
            log.info(
                "tensorrt: chunked prefill %s (%d rows), prefix caching %s; cached pages are "
                "reused as the engines' context phase wrote them (bit-identity with a one-pass "
                "prefill is checked on the CPU backend only)",
                "on" if prefill.enable_chunked_prefill else "off",
                prefill.prefill_chunk,
                "on" if prefill.enable_prefix_caching else "off",
            )
        if self.draft is None:
            return TargetOnlyDecoder(self.target, prefill)
        if spec.draft_top_k_given and spec.draft_top_k != self.draft.top_k:
            raise ConfigError(
                f"--speculative-config: draft_top_k {spec.draft_top_k} cannot be honoured: the "
                f"bundle's draft engine was built for {self.draft.top_k} candidates per "
                f"position; omit draft_top_k, set it to {self.draft.top_k}, or rebuild the "
                "bundle with speculative.draft_top_k in its recipe"
            )
        return get_method(spec.method).resolve("decoder")(
            self.target, self.draft, spec.num_speculative_tokens, spec.confidence_threshold,
            prefill=prefill,
        )  # fmt: skip


def _check_spec(manifest: dict, spec, limits: EngineLimits, bundle: Path) -> bool:
    """True when the draft engine is to be loaded; refuses a spec the engines cannot run."""
    if spec is None:
        return False
    roles = manifest.get("roles") or {}
    if "draft" not in roles:
        raise ConfigError(
            f"{bundle} has no draft engine; the TensorRT backend runs the bundle's own draft "
            "only (rebuild with --draft, or use --backend torch for another draft)"
        )
    built = Path(((manifest.get("sources") or {}).get("draft") or {}).get("path", ""))
    if Path(spec.model).resolve() != built.resolve():
        raise ConfigError(
            f"--speculative-config names the draft {spec.model}, but {bundle}'s draft engine "
            f"was built from {built}; use the bundle's draft or --backend torch"
        )
    if spec.num_speculative_tokens > limits.num_speculative_tokens:
        raise ConfigError(
            f"num_speculative_tokens {spec.num_speculative_tokens} exceeds the "
            f"{limits.num_speculative_tokens} the engines were built for (verify length "
            f"{limits.verify_len}); lower it or rebuild the bundle"
        )
    return True


def _check_vision(manifest: dict, config, bundle: Path) -> bool:
    """True when the target is a VLM (the visual engine is to be loaded).

    Raises:
        ConfigError: a VLM target whose bundle has no built visual engine, or whose base
            engine has no image inputs (built before image support).
    """
    if config.vision_config is None:
        return False
    roles = manifest.get("roles") or {}
    if not (roles.get("visual") or {}).get("engine"):
        raise ConfigError(
            f"{bundle}: the target is a vision-language model but the bundle has no visual "
            "engine (manifest roles.visual); rebuild it with `edgebuild build`, or use "
            "--backend torch"
        )
    names = {e.get("name") for e in (roles.get("base") or {}).get("inputs") or ()}
    if IMAGE_TABLE not in names:
        raise ConfigError(
            f"{bundle}: the target is a vision-language model but the base engine has no "
            f"{IMAGE_TABLE} input (built before image support); rebuild the bundle with "
            "`edgebuild build`, or use --backend torch"
        )
    return True


def assemble_runtime(
    manifest: dict,
    source,
    runners: dict[str, EngineRunner],
    device: torch.device | str = "cuda",
    stream=None,
) -> TrtRuntime:
    """The backends over already loaded engine runners (``base``, and ``draft`` / ``visual``
    when present): buffers from :func:`plan_buffers`, the draft's settings from the manifest,
    the vision config and image processor from ``source`` (the target checkpoint's
    :class:`~edgebuild.checkpoint.source.WeightSource`, as on the torch backend). The CPU
    tests pass stand-in runners and ``device="cpu"``.

    Raises:
        BundleError / ConfigError / EngineError: a manifest that does not describe the roles.
    """
    from edgebuild.checkpoint.config import ModelConfig
    from edgebuild.models.image_processing import ImageProcessor

    config = ModelConfig.from_dict(source.config, str(source.config_path))
    plan = plan_buffers(manifest)
    base = manifest["roles"]["base"]
    target = TrtTarget(
        runners["base"],
        role_io(manifest, "base"),
        role_profiles(manifest, "base"),
        plan,
        tuple(base.get("tap_layers") or ()),
        config.max_position_embeddings,
        device,
        stream,
    )
    draft = None
    if "draft" in runners:
        dspark = manifest["dspark"]
        draft = TrtDraft(
            runners["draft"],
            role_io(manifest, "draft"),
            role_profiles(manifest, "draft"),
            plan,
            int(dspark["block_size"]),
            tuple(dspark["target_layer_ids"]),
            target.vocab_size,
            device,
            stream,
        )
    vision = None
    if "visual" in runners:
        vcfg = VisionConfig.from_model_config(source.config, str(source.config_path))
        tower = TrtVisual(
            runners["visual"],
            role_io(manifest, "visual"),
            role_profiles(manifest, "visual"),
            plan,
            vcfg,
            device,
            stream,
        )
        processor = ImageProcessor.from_dir(Path(source.path), vcfg)
        vision = VisionEncoder(tower, processor, tower.max_images)
    log.info("TensorRT backend: %s", plan.summary())
    return TrtRuntime(target, draft, config, plan, dict(runners), vision)


def open_trt_runtime(resolved, spec, options: TrtOptions | None = None, source=None) -> TrtRuntime:
    """Load a bundle's engines onto the GPU (``resolved``: :func:`resolve_model_path`'s result).

    ``source``: the target checkpoint's WeightSource when the caller has opened it already
    (:class:`~edgebuild.runtime.llm.LLM`; not re-read), else it is opened here.

    A VLM bundle also loads its ``visual`` engine (:class:`TrtVisual`). Not run here: this
    needs TensorRT and a CUDA GPU (the CPU tests go through :func:`assemble_runtime`).

    Raises:
        ConfigError: not a bundle, a VLM bundle without a visual engine or image inputs
            (:func:`_check_vision`), a speculative config the engines cannot run.
        MissingDependencyError: no tensorrt / CUDA torch / plugin library (how to build it).
        EngineError / BundleError: engines that do not match the manifest.
    """
    from edgebuild.checkpoint.config import ModelConfig
    from edgebuild.checkpoint.source import WeightSource
    from edgebuild.engine.plugin_library import plugin_library_path
    from edgebuild.runtime.trt_engine import (
        TrtEngineRunner,
        load_plugin_library,
        load_tensorrt_runtime,
    )

    options = options or TrtOptions()
    if resolved.bundle is None:
        raise ConfigError(f"{resolved.target}: the TensorRT backend runs bundles (edgebuild build)")
    bundle, manifest = Path(resolved.bundle), resolved.manifest
    source = source if source is not None else WeightSource(resolved.target)
    config = ModelConfig.from_dict(source.config, str(source.config_path))
    with_visual = _check_vision(manifest, config, bundle)
    trt = load_tensorrt_runtime()
    if not torch.cuda.is_available():
        raise MissingDependencyError("the TensorRT backend needs a CUDA GPU visible to torch")
    if manifest.get("graph_kind") == "plugin":
        library = options.plugin_library or plugin_library_path()
        load_plugin_library(trt.get_plugin_registry(), manifest["plugin"], library, bundle)
    limits = EngineLimits.from_manifest(manifest)
    with_draft = _check_spec(manifest, spec, limits, bundle)
    stream = torch.cuda.Stream()
    roles = ["base", *(["draft"] if with_draft else []), *(["visual"] if with_visual else [])]
    runners = {
        role: TrtEngineRunner(
            trt,
            bundle / manifest["roles"][role]["engine"],
            role_io(manifest, role),
            role_profiles(manifest, role),
            stream,
            options.cuda_graphs,
        )
        for role in roles
    }
    return assemble_runtime(manifest, source, runners, "cuda", stream)
