"""`LLM`: the one-object entry point of the CPU runtime (used by `edgebuild run` and the server).

Loads the target (and, with a speculative config, the DSpark draft paired with it), the
tokenizer and chat template, and runs batches of requests to completion with the chosen
decoder. The scheduler of the server drives the same decoder step by step.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edgebuild.checkpoint.generation import read_generation_defaults
from edgebuild.checkpoint.source import WeightSource
from edgebuild.errors import CheckpointError, ConfigError, RequestError
from edgebuild.models.image_processing import ImageInput
from edgebuild.runtime.decoding import (
    RequestState,
    TargetOnlyDecoder,
    run_to_completion,
)
from edgebuild.runtime.multimodal import (
    ImageInputError,
    count_image_parts,
    template_messages,
)
from edgebuild.runtime.prefill import PrefillConfig
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.runtime.stopping import IncrementalDetokenizer
from edgebuild.runtime.structured import GrammarSpec, StructuredOutputs
from edgebuild.runtime.torch_backend import DEFAULT_PAGE_SIZE, open_torch_runtime
from edgebuild.speculative.config import SpeculativeConfig

log = logging.getLogger("edgebuild.runtime")


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer (local files only).

    Raises:
        CheckpointError: no tokenizer files in `model_dir`.
    """
    from transformers import AutoTokenizer  # local files only: never a Hub call

    if not any(
        (model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")
    ):
        raise CheckpointError(
            f"{model_dir}: no tokenizer files (tokenizer.json / tokenizer.model / vocab.json)"
        )
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


@dataclass
class RuntimeOptions:
    """Runtime limits (server flags map onto these).

    Two KV limits, never to be confused:

    max_kv_rows: KV rows (tokens) of the whole pool, shared by all running sequences.
    max_seq_rows: KV rows one sequence may hold (prompt + generated + one verify block);
        None = max_kv_rows (the CPU backend). On the TensorRT backend both come from the
        bundle: ``build.max_kv_cache_capacity`` is the per-sequence limit and the pool holds
        ``build.max_batch_size`` such sequences.
    max_input_len: longest accepted prompt in tokens.
    page_size: KV page size in tokens.
    dtype: compute dtype of the CPU models; None = the CPU's default: bf16 with AMX-BF16 or
        Arm bf16, else fp32 (:func:`edgebuild.runtime.cpu.default_compute_dtype`).
    max_images: most images in one prompt (vision-language targets).
    quant: None, ``"int8"`` or ``"int4"``: weight-only int8 (per channel) or int4 (groups of
        32) linears on the CPU (opt-in: faster, but the outputs are the quantized model's, not
        the checkpoint's; DSpark still equals target-only).
    prefill: chunked / batched prefill and prefix caching (:mod:`edgebuild.runtime.prefill`).
    max_draft_kv_rows: context rows of the DSpark draft's own paged cache (a full-attention
        draft holds one row per target position); None = max_kv_rows. Admission and
        preemption count the draft's pages beside the target's (:meth:`LLM.step_pages`): a
        request whose next step fits the target's pages but not the draft's waits or is
        preempted like one that does not fit the target.
    ort_threads: intra-op threads of the ``onnxruntime`` backend's sessions (0: its default).
    """

    max_kv_rows: int = 16384
    max_input_len: int = 4096
    page_size: int = DEFAULT_PAGE_SIZE
    dtype: torch.dtype | None = None
    max_images: int = 8
    quant: str | None = None
    max_seq_rows: int | None = None
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    max_draft_kv_rows: int | None = None
    ort_threads: int = 0  # the onnxruntime backend's intra-op threads (0: its default)

    def prefill_config(self) -> PrefillConfig:
        """The prefill settings fitted to the page size and max_input_len.

        Raises:
            ConfigError: a bad value, naming its flag.
        """
        return self.prefill.resolved(self.page_size, self.max_input_len)

    @property
    def seq_capacity(self) -> int:
        """KV rows one sequence may hold (max_seq_rows, else the whole pool)."""
        if self.max_seq_rows is None:
            return self.max_kv_rows
        return min(self.max_seq_rows, self.max_kv_rows)


def open_runtime(backend: str, resolved, spec, options: RuntimeOptions, source: WeightSource):
    """The loaded backends for `backend` (a runtime record: target, draft, config, vision,
    target_model, ``runtime_options()``, ``decoder(spec)``).

    ``tensorrt``: the bundle's engines (:func:`edgebuild.runtime.trt_backend.open_trt_runtime`;
    no torch weights are loaded, limits come from the bundle); ``onnxruntime``: the bundle's
    ONNX graphs through the same code (:func:`edgebuild.runtime.ort_engine.open_ort_runtime`);
    anything else: the torch CPU
    backend over the source checkpoints (:func:`open_torch_runtime`).
    """
    if backend == "tensorrt":
        from edgebuild.runtime.trt_backend import open_trt_runtime

        return open_trt_runtime(resolved, spec, source=source)
    if backend == "onnxruntime":  # the bundle's ONNX graphs on the CPU, through runtime/trt/
        from edgebuild.runtime.ort_engine import open_ort_runtime

        return open_ort_runtime(resolved, spec, options.ort_threads, source=source)
    return open_torch_runtime(resolved, spec, options, source)


class LLM:
    """Target (+ optional DSpark draft) on the torch CPU backend or a bundle's engines.

    Args:
        model: target checkpoint directory or Hub id (``org/name[@revision]``, resolved
            through the Hub cache, :mod:`edgebuild.checkpoint.hub`), or a bundle
            (``manifest.json``): verified, then run from its source checkpoints, with its
            draft unless ``speculative`` is given.
        speculative: a SpeculativeConfig (or its JSON) to enable DSpark.
        options: RuntimeOptions.
        backend: ``torch`` (CPU, the source checkpoints) or ``tensorrt`` (the bundle's engines;
            limits from the bundle's build settings; see :mod:`edgebuild.runtime.select`).
        verify_bundle: re-hash a bundle and its sources before loading (False: the caller
            just checked it, e.g. an engine-cache hit).

    Raises:
        CheckpointError / ConfigError / PairingError: before any model runs.
        BundleError: a bundle that does not verify (changed or missing file, wrong format
            version, a source checkpoint whose hash changed).
    """

    def __init__(
        self,
        model: str | Path,
        speculative: SpeculativeConfig | str | dict | None = None,
        options: RuntimeOptions | None = None,
        backend: str = "torch",
        verify_bundle: bool = True,
    ):
        from edgebuild.bundle.manifest import resolve_model_path
        from edgebuild.checkpoint.hub import resolve_model_ref

        model = resolve_model_ref(model).path  # a folder as is; a Hub id from the Hub cache
        resolved = resolve_model_path(model, verify=verify_bundle)  # a bundle: its sources
        self.bundle = resolved.bundle
        self.model_dir = resolved.target
        self.options = dataclasses.replace(options or RuntimeOptions())
        spec = speculative if speculative is not None else resolved.speculative
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            spec = SpeculativeConfig.parse(spec)
        self.speculative = spec
        self.source = WeightSource(self.model_dir)
        # default stop ids and sampling settings (HF semantics: generation_config.json first)
        self.generation = read_generation_defaults(self.model_dir, self.source.config)
        self.backend = backend
        rt = open_runtime(backend, resolved, spec, self.options, self.source)  # opened once
        self.options, self.config = rt.runtime_options(self.options), rt.config
        self.target_model, self.vision = rt.target_model, rt.vision  # torch: None on TensorRT
        self.target, self.draft = rt.target, rt.draft
        self.decoder = rt.decoder(spec, self.options.prefill_config())
        self.tokenizer, self._ids = load_tokenizer(self.model_dir), itertools.count()
        # confidence scheduling profiles its step costs once, for the batch it will see: the
        # server calls enable_confidence_scheduling(--max-batch-size) at start-up, and
        # generate_ids profiles on first use for its own batch
        self._schedule_pending = spec is not None and spec.confidence_scheduling

    def without_draft(self) -> LLM:
        """A target-only LLM over this one's loaded target: the same target backend (weights
        and KV pool), tokenizer, vision encoder, options and request-id counter, with no draft
        and a :class:`TargetOnlyDecoder`. ``edgebuild run --compare`` times it against the
        speculative one; this LLM is left as it was.

        Requests of the two share the target's KV pool, so run them one after the other.
        """
        base = LLM.__new__(LLM)
        base.bundle, base.model_dir, base.backend = self.bundle, self.model_dir, self.backend
        base.options, base.source, base.generation = self.options, self.source, self.generation
        base.speculative = None
        base.target_model, base.config, base.vision = self.target_model, self.config, self.vision
        base.tokenizer, base._ids = self.tokenizer, self._ids
        base.target, base.draft = self.target, None
        base.decoder = TargetOnlyDecoder(self.target, self.decoder.prefill_config)
        return base

    def enable_confidence_scheduling(self, max_batch: int, repeats: int = 2):
        """Profile this backend's step costs up to `max_batch` requests and turn on
        load-aware confidence scheduling (:mod:`edgebuild.runtime.spec_schedule`).

        The profile runs dummy passes over a context of up to 128 rows per sequence (fewer
        when the KV pool is small) and takes a few seconds; the server calls this once at
        start-up with its ``--max-batch-size``. Returns the scheduler.

        Raises:
            ConfigError: no draft is loaded.
        """
        from edgebuild.runtime.backend import propose_after_context
        from edgebuild.runtime.kv_cache import RingSequence
        from edgebuild.runtime.spec_schedule import (
            ConfidenceScheduler,
            profile_step_costs,
            reference_step_costs,
        )

        self._schedule_pending = False

        if self.draft is None or not hasattr(self.decoder, "scheduler"):
            raise ConfigError("confidence scheduling needs a speculative draft")
        n = self.decoder.n
        limits = getattr(self.target, "limits", None)  # TensorRT: the engines' batch
        batch, ctx = self._profile_shape(min(max_batch, getattr(limits, "max_batch", max_batch)))
        taps = tuple(self.draft.target_layer_ids)
        seqs, dseqs = [], []
        params = SamplingParams(max_tokens=n + 2)
        try:
            for _ in range(batch):
                seq, dseq = self.target.new_sequence(), self.draft.new_sequence()
                seqs.append(seq)
                dseqs.append(dseq)
                ids = torch.arange(ctx, dtype=torch.int64) % self.config.vocab_size
                out = self.target.forward([seq], [ids], [[ctx - 1]], taps)
                self.draft.update_context([dseq], [out.taps[0].clone()])
                # engines (TensorRT, onnxruntime) run pending context with the next block:
                # run it now, so each profiled draft pass carries only its own two rows
                self.draft.propose([dseq], [int(ids[-1])], [1], [params], [torch.Generator()])
            anchor = int(ids[-1])

            def verify_pass(lens: list[int]) -> None:
                ss = seqs[: len(lens)]
                new = [torch.full((k,), anchor, dtype=torch.int64) for k in lens]
                self.target.forward(ss, new, [list(range(k)) for k in lens], taps)
                for s, k in zip(ss, lens, strict=True):
                    self.target.rollback(s, k)

            # A drafting step first extends the draft's context by the rows the last verify
            # committed (about tau of them), then drafts: the profiled pass pays both (two
            # context rows, rolled back after), as the step it predicts does.
            context_rows = out.taps[0][-2:].clone()

            def draft_pass(b: int, drafted: int) -> None:
                ds = dseqs[:b]
                lengths = [d.length for d in ds]
                gens = [torch.Generator() for _ in range(b)]
                propose_after_context(  # as the decoder's step does
                    self.draft, ds, [context_rows] * b, ds, [anchor] * b, [drafted] * b,
                    [params] * b, gens,
                )  # fmt: skip
                for d, n in zip(ds, lengths, strict=True):
                    if not isinstance(d, RingSequence):  # a ring keeps a fixed set of pages
                        self.draft.allocator.truncate(d, n)

            costs = profile_step_costs(verify_pass, draft_pass, batch, n, repeats)
        finally:
            for s in seqs:
                self.target.free(s)
            for d in dseqs:
                self.draft.free(d)
        ref = reference_step_costs(self.backend, self.options.dtype, self.options.quant)
        self.decoder.scheduler = ConfidenceScheduler(costs, n, reference=ref)
        return self.decoder.scheduler

    def _profile_shape(self, max_batch: int) -> tuple[int, int]:
        """(sequences, context rows) of the start-up step-cost profile that both KV pools hold
        in whole pages: the most sequences (up to ``max_batch``), then the longest context of
        128, 64, 32, 16 or 8 rows (at most the engines' ``max_input_len``). Each sequence
        holds its context plus a verify of n + 1 drafts in the target's pool, and its context
        plus two blocks in the draft's (or one ring for a sliding-window draft). Never more than the pools hold, so a small
        ``--max-kv-cache-capacity`` or ``--max-draft-kv-cache-capacity`` cannot fail the
        start-up; at worst one sequence of 8 rows is profiled."""
        t, d = self.target.allocator, self.draft.allocator
        ring, n, block = getattr(self.draft, "ring", None), self.decoder.n, self.draft.block_size
        widest = min(  # engines (TensorRT, onnxruntime) take at most max_input_len rows a call
            getattr(getattr(m, "limits", None), "max_input_len", 128)
            for m in (self.target, self.draft)
        )
        sizes = [c for c in (128, 64, 32, 16, 8) if c <= widest] or [max(1, widest)]
        for batch in range(max(1, max_batch), 0, -1):
            for ctx in sizes:
                d_pages = ring.pages if ring else d.pages_for(ctx + 2 * block)
                t_pages = t.pages_for(ctx + n + 2)
                if batch * t_pages <= t.num_pages and batch * d_pages <= d.num_pages:
                    return batch, ctx
        return 1, 8  # the pools cannot hold even that: the profile's own error says so

    # ------------------------------------------------------------------ prompts
    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of `prompt` (through the chat template when `chat`)."""
        if chat:
            return self.encode_messages([{"role": "user", "content": prompt}])
        return list(self.tokenizer.encode(prompt, add_special_tokens=False))

    def encode_messages(
        self,
        messages: list[dict],
        images: list[ImageInput] | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Token ids of a chat conversation with the generation prompt appended.

        Image content parts (`image_url` / `image` / `input_image`) are rendered by the chat
        template as one image pad token each, which is expanded to `images[k].num_tokens`
        pads (`images` from :meth:`process_images`, one per image part, in order).
        ``tools`` (OpenAI function definitions) go to the template, which renders them.

        Raises:
            RequestError: no chat template; ImageInputError: image parts for a model without
                a vision tower, or image parts and `images` that do not match.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(f"{self.model_dir}: the tokenizer has no chat template")
        n_parts = count_image_parts(messages)
        if (n_parts or images) and self.vision is None:
            raise ImageInputError(
                f"{self.model_dir} has no vision tower: image content parts are not supported"
            )
        if n_parts != len(images or []):
            raise ImageInputError(f"{n_parts} image content parts but {len(images or [])} images")
        extra = {"tools": tools} if tools else {}
        ids = self.tokenizer.apply_chat_template(
            template_messages(messages), add_generation_prompt=True, tokenize=True, **extra
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        ids = list(ids)
        if self.vision is not None:
            ids = self.vision.expand_placeholders(ids, images or [])
        return ids

    def process_images(self, images: list) -> list[ImageInput]:
        """Preprocess PIL images for this model (ImageInputError without a vision tower)."""
        if self.vision is None:
            raise ImageInputError(f"{self.model_dir} has no vision tower: images are not supported")
        return self.vision.process(images)

    def eos_ids(self) -> frozenset[int]:
        """Ids that end generation: the checkpoint's default EOS ids plus the tokenizer's.

        The default ids are ``generation_config.json``'s ``eos_token_id`` when it has one (HF
        semantics; chat models list more ids there), else ``config.json``'s.
        """
        ids = set(self.generation.eos_token_ids or self.config.eos_token_id)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # ------------------------------------------------------------------ requests
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Reject empty or over-long prompts before any model work (token counts in the message)."""
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty (0 tokens)")
        if n > self.options.max_input_len:
            raise RequestError(
                f"the prompt has {n} tokens, more than the max input length "
                f"{self.options.max_input_len}"
            )
        total = (
            n
            + params.max_tokens
            + (self.speculative.num_speculative_tokens if self.speculative else 0)
        )
        limit = self.max_model_len
        if total > limit:
            draft = self.draft_seq_capacity
            where = (
                " (the DSpark draft's KV cache, --max-draft-kv-cache-capacity)"
                if draft is not None
                and draft < min(self.options.seq_capacity, self.config.max_position_embeddings)
                else ""
            )
            raise RequestError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the capacity "
                f"of {limit} tokens{where}; shorten the prompt or lower max_tokens"
            )

    @property
    def draft_seq_capacity(self) -> int | None:
        """Target positions one request may reach on a full-attention DSpark draft's pool.

        The draft holds one context row per target position, plus one block (block_size
        rows) reserved during its pass, so one request may reach the pool's rows minus one
        block, and at most ``max_draft_kv_rows`` (the flag's number). None without a draft
        or with a windowed draft (its per-request ring does not limit the length).
        """
        d = self.draft
        if d is None or getattr(d, "ring", None) is not None:
            return None
        alloc = d.allocator
        rows = alloc.num_pages * alloc.page_size - d.block_size
        if self.options.max_draft_kv_rows is not None:
            rows = min(rows, self.options.max_draft_kv_rows)
        return rows

    @property
    def max_model_len(self) -> int:
        """Prompt + generated tokens (+ one verify block) one request may reach: the
        smallest of the target's per-sequence KV capacity, max_position_embeddings and
        :attr:`draft_seq_capacity` (vLLM's ``max_model_len``)."""
        limit = min(self.options.seq_capacity, self.config.max_position_embeddings)
        draft = self.draft_seq_capacity
        return limit if draft is None else min(limit, draft)

    def new_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id=None,
        images: list[ImageInput] | None = None,
    ) -> RequestState:
        """A RequestState with its own stop checker, generator and cache sequences.

        With `images` (prompt from :meth:`encode_messages`), the vision tower (the visual
        engine on the TensorRT backend) runs here: the state gets `prompt_images` (image rows,
        their embeddings, 3-axis positions and `rope_delta`).
        """
        self.check_request(prompt_ids, params)
        eos = frozenset() if params.ignore_eos else self.eos_ids()
        detok = IncrementalDetokenizer(self.tokenizer)
        st = RequestState.create(
            request_id or f"req-{next(self._ids)}", prompt_ids, params, eos, detok
        )
        if images and self.vision is None:
            raise ImageInputError(f"{self.model_dir} has no vision tower: images are not supported")
        if self.vision is not None and (images or self.vision.image_token_id in prompt_ids):
            st.prompt_images = self.vision.prepare(prompt_ids, images or [])
        if params.grammar is not None:
            st.grammar = self.structured.matcher(params.grammar)
        self.decoder.start(st)
        return st

    @functools.cached_property
    def structured(self) -> StructuredOutputs:
        """The grammar compiler of this tokenizer (xgrammar; built on first use)."""
        return StructuredOutputs(self.tokenizer, self.config.vocab_size, self.eos_ids())

    def check_grammar(self, spec: GrammarSpec) -> None:
        """Compile `spec` (cached for the request that follows).

        Raises:
            RequestError: an invalid schema, regex or grammar.
        """
        self.structured.compile(spec)

    def set_prefill(self, prefill: PrefillConfig) -> None:
        """Use `prefill` (fitted to the page size and max_input_len) from the next step on;
        pages cached so far stay cached (and are used again when caching is on).

        Raises:
            ConfigError: a bad value, naming its flag.
        """
        self.options.prefill = prefill
        self.decoder.prefill_config = self.options.prefill_config()

    def finish(self, st: RequestState) -> None:
        """Free every per-request resource (KV pages, draft state)."""
        self.decoder.finish(st)

    # ------------------------------------------------------------------ KV pages (scheduler)
    def free_pages(self) -> tuple[int, int]:
        """Free KV pages of the target pool and of the draft pool (0 without a draft)."""
        draft = self.draft.allocator.free_pages if self.draft is not None else 0
        return self.target.allocator.free_pages, draft

    def kv_usage(self) -> dict[str, dict]:
        """Each KV pool's pages: ``{"target": ..., "draft": ...}`` (draft only with one), each
        ``{"pages", "free_pages", "page_size", "bytes_per_token"}``; ``bytes_per_token`` is
        K + V of every layer for one row (None where the backend's pools are not host
        tensors, e.g. TensorRT device buffers). For ``/metrics``."""
        out = {}
        for name, backend in (("target", self.target), ("draft", self.draft)):
            if backend is None:
                continue
            alloc, pools = backend.allocator, getattr(backend, "pools", None)
            per_token = (
                sum(p[0, :, :, 0].numel() * p.element_size() for p in pools) if pools else None
            )
            out[name] = {
                "pages": alloc.num_pages,
                "free_pages": alloc.free_pages,
                "page_size": alloc.page_size,
                "bytes_per_token": per_token,
            }
        return out

    def first_step_pages(
        self, prompt_ids: list[int], images=None, prompt_logprobs: bool = False
    ) -> tuple[int, int]:
        """KV pages (target, draft) the first step of a new request may take: its first
        prefill chunk beyond its cached prompt prefix (``prompt_logprobs``: the request
        skips the cache), plus the evictable cached pages it attaches (they count as free
        until then); nothing on the draft."""
        has_images = bool(images) or (
            self.vision is not None and self.vision.image_token_id in prompt_ids
        )
        return self.decoder.first_step_pages(prompt_ids, has_images, prompt_logprobs), 0

    def step_pages(self, st: RequestState) -> tuple[int, int]:
        """KV pages (target, draft) that the next decoder step of `st` may newly take.

        A request in prefill takes its next prompt chunk (a preempted one, without a
        sequence, its first step again); a preempted one with output takes its recompute
        (:meth:`resume`) plus one step; a running one takes one verify block on the target
        (anchor + drafts) and, with a draft, its pending context rows plus one draft block
        (reserved during the draft pass).
        """
        target_alloc = self.target.allocator
        spec = self.speculative.num_speculative_tokens if self.speculative else 0
        if st.anchor is None and st.seq is None:  # preempted before its first token
            return self.first_step_pages(
                st.prompt_ids, st.prompt_images, st.params.prompt_logprobs is not None
            )
        if st.anchor is None:  # in prefill: its next chunk
            return self.decoder.prefill_step_pages(st), 0
        if st.seq is None:  # preempted: recompute prompt + output[:-1], then a step
            cached = len(st.prompt_ids) + len(st.output_ids) - 1
            draft = self._draft_pages(None, cached) if self.draft else 0
            return target_alloc.pages_for(cached + 1 + spec), draft
        t = target_alloc.pages_for(st.seq.length + 1 + spec) - len(st.seq.pages)
        if self.draft is None or st.draft_seq is None:
            return max(t, 0), 0
        pending = len(st.pending_features) if st.pending_features is not None else 0
        return max(t, 0), self._draft_pages(st.draft_seq, pending)

    def _draft_pages(self, dseq, rows: int) -> int:
        """Draft pages a step adding ``rows`` context rows (and a block) may take: the
        backend's own count (a windowed draft's ring, all at once), else one row per row."""
        grow = getattr(self.draft, "pages_to_grow", None)
        if grow is not None:
            return grow(dseq, rows)
        alloc, block = self.draft.allocator, self.draft.block_size
        have, length = (len(dseq.pages), dseq.length) if dseq is not None else (0, 0)
        return max(alloc.pages_for(length + rows + block) - have, 0)

    def preempt(self, st: RequestState) -> None:
        """Give back the request's KV pages and draft state, keeping its output and
        generator: :meth:`resume` recomputes the cache (recompute preemption, as in vLLM)."""
        self.decoder.finish(st)
        st.seq = st.draft_seq = None
        st.pending_features = st.pending_buffer = None

    def resume(self, st: RequestState) -> None:
        """New cache sequences for a preempted request, refilled with its prompt and all but
        the last output token (the anchor), and, with a draft, the target features of those
        rows as pending draft context: the state a decoder step would have left.

        Rows go through the target in calls of at most max_input_len rows (the rest of the
        prompt after its cached prefix first, with its images; its full pages are cached
        again); the draft takes its context (the cached taps of the prefix pages first) in
        pieces of at most max_input_len rows too (each piece through a draft pass that
        proposes nothing, since the TensorRT draft engine writes context only as part of a
        pass), the last piece left pending.
        """
        self.decoder.start(st)  # attaches the cached prefix of the prompt
        if st.anchor is None:  # preempted before its first token: the next steps prefill
            return
        taps = tuple(self.draft.target_layer_ids) if self.draft is not None else ()
        images = st.prompt_images
        st.seq.rope_delta = images.rope_delta if images is not None else 0
        out_ids = st.output_ids[:-1]
        step = max(1, self.options.max_input_len)
        chunks = [st.prompt_ids[st.seq.length :]]
        chunks += [out_ids[i : i + step] for i in range(0, len(out_ids), step)]
        features = list(st.prefill_features) if taps else []
        st.prefill_features = []
        for i, chunk in enumerate(chunks):
            if not chunk:
                continue
            out = self.target.forward(
                [st.seq],
                [torch.tensor(chunk, dtype=torch.int64)],
                [[len(chunk) - 1]],
                taps,
                [images] if i == 0 and images is not None else None,
                prefill=True,
            )
            if taps:  # a copy: the TensorRT taps live in a ring the next call may reuse
                features.append(out.taps[0].clone())
            if i == 0:
                self.decoder.register_prompt(st, torch.cat(features) if taps else None)
        if taps:
            self._refill_draft(st, torch.cat(features), step)

    def _refill_draft(self, st: RequestState, features: torch.Tensor, step: int) -> None:
        """Give the draft `features` [rows, n_t * d] as context, `step` rows per pass; the
        last at most `step` rows stay pending for the next decoder step."""
        head = max(0, int(features.shape[0]) - step)
        for i in range(0, head, step):
            piece = features[i : min(i + step, head)]
            self.draft.update_context([st.draft_seq], [piece])
            self.draft.propose([st.draft_seq], [st.anchor], [0], [st.params], [st.generator])
        st.pending_features = features[head:]

    def generate_ids(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        images: list[list[ImageInput] | None] | None = None,
    ) -> list[RequestState]:
        """Run a batch of prompts to completion (continuous batching: finished ones leave).

        `images[i]`: the preprocessed images of prompt i (None / [] for text prompts).
        """
        if getattr(self, "_schedule_pending", False):
            self.enable_confidence_scheduling(len(prompts))
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ilist = images if images is not None else [None] * len(prompts)
        states = [
            self.new_request(p, sp, images=im)
            for p, sp, im in zip(prompts, plist, ilist, strict=True)
        ]
        run_to_completion(self.decoder, states)
        return states

    def generate(self, prompt: str, params: SamplingParams, chat: bool = False) -> RequestState:
        """Generate for one text prompt; `state.stopper.final_text()` is the answer."""
        return self.generate_ids([self.encode(prompt, chat)], params)[0]
