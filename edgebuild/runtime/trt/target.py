"""The TensorRT target: :class:`TrtTarget`, the TargetBackend over the ``base`` engine (prefill,
decode and verify passes; taps into the tap ring; the multimodal prefill's image table).
The overview is :mod:`edgebuild.runtime.trt_backend`'s docstring."""

from __future__ import annotations

import torch

from edgebuild.errors import ConfigError, RequestError
from edgebuild.runtime.backend import MultimodalPrefill, TargetStep
from edgebuild.runtime.kv_cache import PageAllocator, Sequence
from edgebuild.runtime.trt.buffers import (
    EngineRunner,
    RoleBuffers,
    TapRing,
    _on,
    _pad,
    _page_table,
    _reserve,
)
from edgebuild.runtime.trt_plan import (
    TAP_RING,
    TAPS_OUTPUT,
    BufferPlan,
    Profile,
    RoleIO,
    choose_profile,
)

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
    """TargetBackend on the ``base`` engine (:mod:`edgebuild.runtime.trt_backend`).

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
        3-axis positions); see :mod:`edgebuild.runtime.trt_backend`. ``prefill`` (prompt rows) changes
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
