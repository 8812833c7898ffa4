"""The torch (CPU) backend: runs the checkpoint's models eagerly over paged KV pools.

This is the embedded default wherever TensorRT or a GPU is missing, and the reference the
TensorRT backend is checked against. :func:`open_torch_runtime` loads it (target, optional
draft, vision tower) as :func:`edgebuild.runtime.trt_backend.open_trt_runtime` loads engines:
both return a runtime record with the same fields and methods, which
:class:`~edgebuild.runtime.llm.LLM` takes as it comes.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from edgebuild.errors import ConfigError
from edgebuild.models.common import PagedBatch
from edgebuild.models.llama import LlamaForCausalLM
from edgebuild.ops import attention_kernel
from edgebuild.ops.linear import QUANT_MODES
from edgebuild.runtime.backend import DraftBackend, MultimodalPrefill, TargetStep
from edgebuild.runtime.cpu import describe_cpu, resolve_dtype
from edgebuild.runtime.kv_cache import PageAllocator, Sequence, allocate_pools
from edgebuild.runtime.multimodal import VisionEncoder

log = logging.getLogger("edgebuild.runtime")

DEFAULT_PAGE_SIZE = 32


def pad_rows(rows: list[torch.Tensor], fill: int = 0) -> torch.Tensor:
    """Stack unequal 1-D / 2-D row tensors into [B, S_max, ...] padded with `fill`."""
    width = max(int(r.shape[0]) for r in rows)
    out = torch.full((len(rows), width, *rows[0].shape[1:]), fill, dtype=rows[0].dtype)
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
    return out


SMALL_BATCH_ROWS = 256  # make_batch builds the positions of up to this many rows from lists


def make_batch(
    allocator: PageAllocator,
    seqs: list[Sequence],
    lengths: list[int],
    positions=None,
    prefill: bool = False,
) -> PagedBatch:
    """Reserve pages for `lengths[b]` new rows of each sequence and describe the batch.

    Positions default to the cache slots (seq.length + i); `prefill`: prompt rows (the
    chunk-invariant attention path, :class:`PagedBatch`).
    """
    for s, n in zip(seqs, lengths, strict=True):
        allocator.reserve(s, n)
    width = max(lengths)
    pasts = [s.length for s in seqs]
    past = torch.tensor(pasts, dtype=torch.int32)
    if positions is None and len(seqs) * width <= SMALL_BATCH_ROWS:  # one tensor from lists
        positions = torch.tensor(
            [[p + i for i in range(width)] for p in pasts], dtype=torch.int32
        ).view(len(seqs), width)
    elif positions is None:
        positions = past[:, None] + torch.arange(width, dtype=torch.int32)[None, :]
    return PagedBatch(
        page_table=allocator.page_table(seqs),
        past_lengths=past,
        input_lengths=torch.tensor(lengths, dtype=torch.int32),
        positions=positions.to(torch.int32),
        prefill=prefill,
    )


class TorchTarget:
    """TargetBackend over a :class:`LlamaForCausalLM` on the CPU.

    Args:
        model: the target model (eval mode).
        max_kv_rows: KV capacity in rows (tokens), shared by all sequences.
        page_size: rows per page.
        pack: pack the model's linears once for the CPU (:meth:`LlamaForCausalLM.pack_for_cpu`;
            fused, faster, row-invariant).
        quant: None, ``"int8"`` or ``"int4"`` (weight-only packing, opt-in; ops/linear.py).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        max_kv_rows: int = 16384,
        page_size: int = DEFAULT_PAGE_SIZE,
        pack: bool = True,
        quant: str | None = None,
    ):
        cfg = model.config
        if pack and model.packed_lm_head is None:
            model.pack_for_cpu(quant)
        self.model, self.config = model, cfg
        self.vocab_size = cfg.vocab_size
        self.max_model_len = cfg.max_position_embeddings
        num_pages = -(-max_kv_rows // page_size)
        self.allocator = PageAllocator(num_pages, page_size)
        dtype = next(model.parameters()).dtype
        self.pools = allocate_pools(
            cfg.num_hidden_layers,
            num_pages,
            page_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype,
        )
        attention_kernel.available()  # build / load the decode kernel now, not in a request

    def new_sequence(self) -> Sequence:
        return self.allocator.new_sequence()

    def can_fit(self, rows: int) -> bool:
        return self.allocator.pages_for(rows) <= self.allocator.num_pages

    @torch.inference_mode()
    def forward(
        self,
        seqs: list[Sequence],
        rows: list[torch.Tensor],
        logits_rows: list[list[int]],
        tap_layers: tuple[int, ...] = (),
        images: list[MultimodalPrefill | None] | None = None,
        prefill: bool = False,
    ) -> TargetStep:
        """Append `rows[b]` to sequence b and return logits of `logits_rows[b]` (+ taps).

        `prefill`: the rows are prompt rows; a row's bits then do not depend on how the
        prompt is cut into calls nor on the other prompts of the call (chunked, batched
        prefill and the prefix cache rely on it; ops/attention_fast.py).

        rows[b]: int64 [n_b]; logits_rows[b]: indices in [0, n_b). Returns fp32 logits
        [len(logits_rows[b]), V] per sequence and taps [n_b, n_t * d] when asked for.
        RoPE positions: cache slot + `seq.rope_delta`; with `images[b]` (the prefill of a
        prompt with images, multimodal-RoPE target) its 3-axis positions, and its image
        embeddings replace the token embeddings of its image rows.
        """
        lengths = [int(r.shape[0]) for r in rows]
        width = max(lengths)
        slots = torch.tensor([s.length + s.rope_delta for s in seqs], dtype=torch.int64)
        flat = slots[:, None] + torch.arange(width)[None, :]  # [B, S]
        batch = make_batch(self.allocator, seqs, lengths, positions=flat, prefill=prefill)
        ids = pad_rows(rows)
        mrope, embeds = None, None
        if images is not None and any(m is not None for m in images):
            mrope = flat[None].expand(3, -1, -1).clone()  # [3, B, S]
            embeds = self.model.embed(ids)  # [B, S, d]
            for b, m in enumerate(images):
                if m is not None:
                    mrope[:, b, : m.positions.shape[1]] = m.positions
                    embeds[b, m.image_rows] = m.image_embeds.to(embeds.dtype)
        r_max = max(len(r) for r in logits_rows)
        sel = torch.zeros(len(seqs), r_max, dtype=torch.int64)
        for b, r in enumerate(logits_rows):
            sel[b, : len(r)] = torch.tensor(r, dtype=torch.int64)
            sel[b, len(r) :] = r[-1] if r else 0
        logits, taps = self.model(
            self.pools,
            batch,
            input_ids=ids,
            inputs_embeds=embeds,
            logits_rows=sel,
            tap_layers=tap_layers,
            mrope_positions=mrope,
        )
        for s, n in zip(seqs, lengths, strict=True):
            self.allocator.advance(s, n)
        return TargetStep(
            logits=[logits[b, : len(r)] for b, r in enumerate(logits_rows)],
            taps=[taps[b, :n] for b, n in enumerate(lengths)] if taps is not None else None,
        )

    def rollback(self, seq: Sequence, rows: int) -> None:
        self.allocator.rollback(seq, rows)

    def free(self, seq: Sequence) -> None:
        self.allocator.free(seq)


# ----------------------------------------------------------------------------- loading
@dataclass
class TorchRuntime:
    """The loaded torch backends of a checkpoint (the torch side of
    :class:`edgebuild.runtime.trt_backend.TrtRuntime`: the same fields and methods).

    target_model: the target :class:`LlamaForCausalLM` the target backend runs.
    options: the RuntimeOptions the models were loaded with (compute dtype resolved).
    vision: the vision tower + image processor (vision-language targets), else None.
    """

    target: TorchTarget
    draft: DraftBackend | None
    config: object  # the target's ModelConfig
    options: object  # RuntimeOptions
    target_model: LlamaForCausalLM
    vision: VisionEncoder | None = None

    def runtime_options(self, options):
        """The options the models were loaded with: on the CPU the caller's limits hold as
        given (``options`` is what was passed to :func:`open_torch_runtime`)."""
        return self.options

    def decoder(self, spec, prefill=None):
        """The decoder over these backends: the speculative method's (the registry's
        ``decoder``) with a draft, else :class:`TargetOnlyDecoder` (`prefill`: a resolved
        PrefillConfig; the prefix cache lives in the target's page allocator)."""
        from edgebuild.runtime.decoding import TargetOnlyDecoder
        from edgebuild.speculative.registry import get_method

        if self.draft is None:
            return TargetOnlyDecoder(self.target, prefill)
        return get_method(spec.method).resolve("decoder")(
            self.target,
            self.draft,
            spec.num_speculative_tokens,
            spec.confidence_threshold,
            prefill=prefill,
        )


def open_torch_runtime(resolved, spec, options, source) -> TorchRuntime:
    """Load a checkpoint's models on the CPU (``resolved``: :func:`resolve_model_path`'s
    result; its target checkpoint is run, a bundle's source checkpoints included).

    Args:
        resolved: the resolved model (``target``: the target checkpoint directory).
        spec: a parsed SpeculativeConfig, or None (target-only).
        options: RuntimeOptions (``dtype`` None: the CPU's default compute dtype).
        source: the target checkpoint's opened WeightSource (not re-read).

    The draft is validated against the target (the registry's ``torch_loader``: one
    DraftPlan) before the (large) target is loaded, and loaded after it.

    Raises:
        ConfigError: an unsupported ``options.quant``.
        PairingError / CheckpointError / ConfigError: a draft that does not fit the target.
    """
    from edgebuild.speculative.registry import get_method

    options = dataclasses.replace(options, dtype=resolve_dtype(options.dtype))
    if options.quant not in (None, *QUANT_MODES):
        raise ConfigError(
            f"--quant {options.quant!r} is not supported; choose one of {QUANT_MODES}"
        )
    log.info(
        "torch CPU runtime: compute dtype %s, weights %s, %d intra-op threads (%s)",
        str(options.dtype).removeprefix("torch."),
        options.quant or "as in the checkpoint",
        torch.get_num_threads(),
        describe_cpu(),
    )
    draft_loader = None
    if spec is not None:  # validate the pair before loading the (large) target
        draft_loader = get_method(spec.method).resolve("torch_loader")(spec, source)
    model = LlamaForCausalLM.from_source(source, options.dtype)
    vision = None
    if model.config.vision_config is not None:  # a VLM checkpoint: visual.* + processor
        vision = VisionEncoder.from_source(
            source, resolved.target, options.dtype, options.max_images
        )
    target = TorchTarget(model, options.max_kv_rows, options.page_size, quant=options.quant)
    draft = draft_loader(options) if draft_loader is not None else None
    return TorchRuntime(target, draft, model.config, options, model, vision)
