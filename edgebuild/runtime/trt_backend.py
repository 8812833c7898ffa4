"""The TensorRT backend: :class:`TrtTarget` and :class:`TrtDraft` over a bundle's engines.

Both implement the protocols of :mod:`edgebuild.runtime.backend`, so the decoders of
:mod:`edgebuild.runtime.decoding` drive them exactly as they drive the torch backend.

The code lives in :mod:`edgebuild.runtime.trt`, in parts: ``buffers`` (:class:`RoleBuffers`,
:class:`TapRing`, page tables), ``target`` (:class:`TrtTarget`), ``draft``
(:class:`TrtDraft`), ``visual`` (:class:`TrtVisual`) and ``runtime`` (loading:
:func:`open_trt_runtime`, :func:`assemble_runtime`, :class:`TrtRuntime`). This module
describes the backend as a whole and re-exports those names.

Memory (all sized by :func:`edgebuild.runtime.trt_plan.plan_buffers` and allocated once, at
load): every engine input/output at its largest shape (a call binds contiguous prefix views
of these), host staging for what the host writes and reads back, and per layer a device KV
page pool for the base and for the draft. The pools are addressed through the same
:class:`~edgebuild.runtime.kv_cache.PageAllocator` page tables as the CPU backend ("one
allocator, two storage backends"): the allocator hands out page ids, the engine's
``page_table`` input carries them, the plugin reads and writes the pool in place. A
sliding-window draft's pool is whole fixed rings, one per request, whose page table is a
rotation of the same pages (:mod:`edgebuild.runtime.trt.draft`).

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

from edgebuild.runtime.markov_walk import walk_lattice
from edgebuild.runtime.trt.buffers import EngineRunner, RoleBuffers, TapRing
from edgebuild.runtime.trt.draft import TrtDraft
from edgebuild.runtime.trt.runtime import TrtOptions, TrtRuntime, assemble_runtime, open_trt_runtime
from edgebuild.runtime.trt.target import IMAGE_TABLE, TrtTarget
from edgebuild.runtime.trt.visual import TrtVisual

__all__ = [
    "EngineRunner",
    "RoleBuffers",
    "TapRing",
    "IMAGE_TABLE",
    "TrtTarget",
    "TrtDraft",
    "TrtVisual",
    "TrtOptions",
    "TrtRuntime",
    "assemble_runtime",
    "open_trt_runtime",
    "walk_lattice",
]
