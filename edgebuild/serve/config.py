"""Server settings (one dataclass: the CLI flags map onto its fields by name) and loading the
model into a :class:`ServeState` on the backend :mod:`edgebuild.runtime.select` chooses.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from edgebuild.checkpoint.hub import is_hub_id, split_ref
from edgebuild.errors import ConfigError
from edgebuild.ops.linear import QUANT_MODES
from edgebuild.runtime.cpu import resolve_dtype, set_cpu_threads
from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.runtime.prefill import DEFAULT_MAX_NUM_BATCHED_TOKENS, PrefillConfig
from edgebuild.runtime.select import BACKENDS, BackendChoice, select_backend
from edgebuild.serve.metrics import ServeMetrics
from edgebuild.serve.scheduler import Scheduler

log = logging.getLogger("edgebuild.serve")

MIN_CHARS_PER_TOKEN = 16  # floor of the prompt text limit (see ServeState.prompt_char_limit)


@dataclass(frozen=True)
class ServeConfig:
    """Settings of one `edgellm-serve` process.

    Attributes:
        model: checkpoint or bundle directory, or a Hub id (``org/name[@revision]``).
        revision: the Hub revision of ``model`` (branch, tag or commit; ``--revision``).
        cache_dir: the engine cache (``--cache-dir``; None: ``$EDGEBUILD_CACHE_DIR``, else
            ``~/.cache/edgebuild``): where engines built at start-up are kept and reused.
        speculative_config: the `--speculative-config` JSON (None = target only).
        host, port: where to listen.
        api_key: required `Authorization: Bearer` key for /v1 (None = open).
        served_model_name: the `model` name clients use (default: the directory name).
        max_batch_size: most requests decoded together.
        max_input_len: longest prompt in tokens.
        max_kv_cache_capacity: KV rows (tokens) of the pool shared by all running requests
            (RuntimeOptions.max_kv_rows; one request may use all of it). On the TensorRT
            backend the bundle fixes the limits instead: its build.max_kv_cache_capacity is
            per sequence (RuntimeOptions.max_seq_rows) and the pool is max_batch_size of those.
        max_draft_kv_cache_capacity: KV rows of the DSpark draft's own context cache
            (RuntimeOptions.max_draft_kv_rows; ``--max-draft-kv-cache-capacity``). None = as
            max_kv_cache_capacity. The torch backend's: on tensorrt / onnxruntime the
            bundle's buffer plan sizes the draft's pool, and a value given there is refused.
        max_model_len: vLLM's ``--max-model-len``: most tokens (prompt + generated) one
            request may reach (RuntimeOptions.max_seq_rows; the TensorRT build's
            per-sequence capacity); prompts are then at most max_model_len - 1 tokens too.
            None = the KV limits decide.
        max_queued_requests: requests that may wait beyond a full batch (then 429).
        max_request_bytes: largest accepted request body (then 413).
        allowed_local_media_path: directory `file://` images may come from (vision models).
        backend: auto | torch | tensorrt | onnxruntime (a bundle's ONNX graphs on the CPU).
        threads: torch CPU threads (None = cores - 1, at least 1; runtime/cpu.py).
        dtype: CPU compute dtype: auto (bfloat16 with native CPU bf16, else float32),
            bfloat16 or float32.
        quant: None, "int8" or "int4": weight-only CPU linears of the torch backend (as
            ``edgebuild run --quant``; refused on the engine backends).
        graceful_shutdown_s: on SIGTERM, how long running requests may go on; then each gets
            the documented 503 (an SSE error event and `[DONE]` on a stream).
        enable_prefix_caching: reuse the KV pages (and draft context) of full prompt pages
            that earlier requests computed (runtime/prefill.py).
        enable_chunked_prefill: prefill prompts in chunks, batched, under
            max_num_batched_tokens (False: whole prompts, one by one).
        max_num_batched_tokens: rows one decoder step may run (prompt chunks + decode rows).
        batch_wait_ms: with no request running, the worker waits until no new request has
            arrived for this long (at most 5x in all) before its first step, so a burst of
            prompts shares one prefill pass (Triton's max_queue_delay; 0 = off).
    """

    model: str | Path
    speculative_config: str | None = None
    revision: str | None = None
    cache_dir: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_batch_size: int = 8
    max_input_len: int = 4096
    max_kv_cache_capacity: int = 16384
    max_draft_kv_cache_capacity: int | None = None
    max_model_len: int | None = None
    max_queued_requests: int = 64
    max_request_bytes: int = 16 * 1024 * 1024
    allowed_local_media_path: Path | None = None
    backend: str = "auto"
    threads: int | None = None
    dtype: str = "auto"
    quant: str | None = None
    graceful_shutdown_s: float = 30.0
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    batch_wait_ms: float = 10.0

    @property
    def input_len(self) -> int:
        """The prompt limit in effect: max_input_len, below max_model_len when that is set."""
        if self.max_model_len is None:
            return self.max_input_len
        return min(self.max_input_len, self.max_model_len - 1)

    @property
    def prefill(self) -> PrefillConfig:
        """The prefill settings of these flags."""
        return PrefillConfig(
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
        )

    def validate(self) -> None:
        """Check the numbers before loading anything.

        Raises:
            ConfigError: naming the flag and the accepted range.
        """
        positive = (
            "max_batch_size",
            "max_input_len",
            "max_kv_cache_capacity",
            "max_request_bytes",
            "max_num_batched_tokens",
        )
        for name in positive:
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} must be >= 1, got {getattr(self, name)}")
        draft_rows = self.max_draft_kv_cache_capacity
        if draft_rows is not None and draft_rows < 1:
            raise ConfigError(
                f"--max-draft-kv-cache-capacity must be >= 1 KV rows, got {draft_rows} (omit "
                "it to give the draft as many rows as --max-kv-cache-capacity)"
            )
        self._check_draft_flag()
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.max_model_len is not None and self.backend == "torch":
            self.check_model_len(self.max_kv_cache_capacity, "--max-kv-cache-capacity")
        if self.max_queued_requests < 0:
            raise ConfigError(f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")
        if self.backend not in BACKENDS:
            raise ConfigError(
                f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}"
            )
        if not self.graceful_shutdown_s >= 0:
            raise ConfigError(f"--graceful-shutdown-s must be >= 0, got {self.graceful_shutdown_s}")
        if not 0 <= self.batch_wait_ms <= 1000:
            raise ConfigError(f"--batch-wait-ms must be in [0, 1000], got {self.batch_wait_ms}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        resolve_dtype(self.dtype)  # ConfigError naming --dtype
        if self.quant is not None and self.quant not in QUANT_MODES:
            raise ConfigError(
                f"--quant must be one of {', '.join(QUANT_MODES)}, got {self.quant!r}"
            )
        if not Path(self.model).exists() and not is_hub_id(split_ref(str(self.model))[0]):
            raise ConfigError(
                f"model {self.model}: no such directory, and not a Hugging Face Hub id "
                "(org/name[@revision])"
            )

    def _check_draft_flag(self) -> None:
        """--max-draft-kv-cache-capacity with a local checkpoint (not a bundle, which may
        carry a draft) and no --speculative-config: refused before loading anything."""
        rows = self.max_draft_kv_cache_capacity
        model = Path(self.model)
        if rows is None or self.speculative_config is not None or not model.is_dir():
            return
        if not (model / "manifest.json").is_file():
            raise ConfigError(
                f"--max-draft-kv-cache-capacity {rows} sizes the DSpark draft's cache, but "
                f"{self.model_name} runs without a draft; add --speculative-config or omit it"
            )

    def check_model_len(self, capacity: int, what: str) -> None:
        """Refuse a --max-model-len above what one request can hold (as vLLM does, rather
        than clamping it silently).

        Raises:
            ConfigError: naming --max-model-len and ``what`` (the limit and its source).
        """
        if self.max_model_len is not None and self.max_model_len > capacity:
            raise ConfigError(
                f"--max-model-len {self.max_model_len} is more than one request can hold here: "
                f"{capacity} tokens ({what}); lower --max-model-len or raise that limit"
            )

    @property
    def is_hub_model(self) -> bool:
        """``model`` names a Hub id (no local folder of that name exists)."""
        return not Path(self.model).is_dir() and is_hub_id(split_ref(str(self.model))[0])

    @property
    def model_name(self) -> str:
        """The ``model`` clients send: --served-model-name, else the Hub id as given (vLLM's
        default), else the folder's name."""
        if self.served_model_name:
            return self.served_model_name
        if self.is_hub_model:
            return split_ref(str(self.model))[0]
        return Path(self.model).resolve().name


@dataclass
class ServeState:
    """Everything a running server shares: settings, model, scheduler, metrics."""

    config: ServeConfig
    llm: LLM
    scheduler: Scheduler
    metrics: ServeMetrics
    backend: BackendChoice
    created: int = field(default_factory=lambda: int(time.time()))
    # prompts are tokenized here, off the event loop, one at a time (the tokenizer is not
    # used concurrently from two threads for encoding)
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="edgellm-tokenizer")
    )

    @classmethod
    def from_llm(cls, config: ServeConfig, llm: LLM, backend: BackendChoice | None = None):
        """A state around an already loaded LLM (the scheduler starts with the app); the
        config's prefill flags apply to the LLM's decoder (:meth:`LLM.set_prefill`)."""
        llm.set_prefill(config.prefill)
        metrics = ServeMetrics(config.model_name)
        metrics.prefill_start(llm.decoder.stats)
        metrics.attach_kv(llm)  # target and draft pools (issue 27)
        spec = llm.speculative
        metrics.speculative = spec is not None
        if spec is not None and spec.confidence_scheduling:
            metrics.attach_schedule(llm.enable_confidence_scheduling(config.max_batch_size))
        scheduler = Scheduler(
            llm,
            config.max_batch_size,
            config.max_queued_requests,
            metrics,
            batch_wait_s=config.batch_wait_ms / 1000.0,
        )
        return cls(config, llm, scheduler, metrics, backend or BackendChoice("torch", "given"))

    @property
    def max_model_len(self) -> int:
        """Prompt + generated tokens one request may reach (:attr:`LLM.max_model_len`: the
        target's per-sequence KV limit, and a full-attention draft's pool)."""
        return self.llm.max_model_len

    @property
    def max_input_len(self) -> int:
        """Longest prompt in tokens accepted: ``--max-input-len``, and at most
        max_model_len - 1 (a prompt leaves room for one generated token)."""
        return min(self.llm.options.max_input_len, self.max_model_len - 1)

    @cached_property
    def prompt_char_limit(self) -> int:
        """Most characters of prompt text accepted, checked before tokenizing.

        ``max_input_len`` tokens times the longest token of the vocabulary in characters
        (at least MIN_CHARS_PER_TOKEN): for byte-level BPE no text longer than this fits in
        ``max_input_len`` tokens, so refusing it costs nothing that could have been served,
        and no request can keep the tokenizer busy for long.
        """
        vocab = self.llm.tokenizer.get_vocab()
        longest = max((len(k) for k in vocab), default=0)
        return self.max_input_len * max(MIN_CHARS_PER_TOKEN, longest)

    @property
    def sampling_defaults(self) -> dict:
        """temperature / top_p / top_k that the model's generation_config.json sets (only
        those): a request that leaves one out gets it (vLLM's ``--generation-config auto``)."""
        gen = getattr(self.llm, "generation", None)
        if gen is None:
            return {}
        values = {"temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k}
        return {k: v for k, v in values.items() if v is not None}

    @property
    def spec_tokens(self) -> int:
        spec = self.llm.speculative
        return spec.num_speculative_tokens if spec is not None else 0


@dataclass(frozen=True)
class ServePlan:
    """What a server loads, once references are resolved and engines built or found.

    Attributes:
        model: a checkpoint folder or a bundle folder.
        backend: the backend that runs it, and why.
        speculative: the speculative config (parsed, or its JSON; None: target only or the
            bundle's own draft).
        verify_bundle: re-hash a bundle before loading (False: the engine cache just checked
            it, so the start reads no weights).
    """

    model: Path
    backend: BackendChoice
    speculative: object = None
    verify_bundle: bool = True


def default_plan(config: ServeConfig) -> ServePlan:
    """The plan of ``edgellm-serve MODEL`` without engine building: the model reference
    resolved (a Hub id into the Hub cache) and the backend chosen by
    :func:`~edgebuild.runtime.select.select_backend` (logged).

    Raises:
        CheckpointError: a Hub id that cannot be resolved.
        ConfigError: ``--backend tensorrt`` that cannot run the model.
    """
    from edgebuild.checkpoint.hub import resolve_model_ref

    model = resolve_model_ref(config.model, config.revision).path
    backend = select_backend(config.backend, model)
    log.info("backend: %s (%s)", backend.name, backend.reason)
    return ServePlan(model, backend, config.speculative_config)


def load_state(config: ServeConfig, plan: ServePlan | None = None) -> ServeState:
    """Validate the settings, choose the backend (logged) and load the model.

    Args:
        config: the server's settings.
        plan: what to load (None: :func:`default_plan`).

    Raises:
        ConfigError / CheckpointError / PairingError: before serving anything.
    """
    config.validate()
    plan = plan or default_plan(config)
    draft_rows = config.max_draft_kv_cache_capacity
    if draft_rows is not None and plan.backend.name != "torch":
        raise ConfigError(
            f"--max-draft-kv-cache-capacity {draft_rows}: the {plan.backend.name} backend's "
            "draft pool is fixed by the bundle's buffer plan (build.max_kv_cache_capacity x "
            "max_batch_size pages, or whole rings for a sliding-window draft); omit the flag, "
            "or use --backend torch"
        )
    if config.quant is not None and plan.backend.name != "torch":
        raise ConfigError(
            f"--quant {config.quant}: weight-only CPU linears are a torch-backend option; the "
            f"{plan.backend.name} backend runs the bundle's engines as built (quantize with "
            "`edgebuild quantize` before `edgebuild build`), or use --backend torch"
        )
    set_cpu_threads(config.threads)
    options = RuntimeOptions(
        max_kv_rows=config.max_kv_cache_capacity,
        max_draft_kv_rows=draft_rows,
        max_input_len=config.input_len,
        max_seq_rows=config.max_model_len,
        dtype=resolve_dtype(config.dtype),
        quant=config.quant,
        prefill=config.prefill,
        ort_threads=config.threads or 0,
    )
    llm = LLM(
        plan.model,
        speculative=plan.speculative,
        options=options,
        backend=plan.backend.name,
        verify_bundle=plan.verify_bundle,
    )
    if draft_rows is not None and llm.draft is None:
        raise ConfigError(
            f"--max-draft-kv-cache-capacity {draft_rows} sizes the DSpark draft's cache, but "
            f"{config.model_name} runs without a draft; add --speculative-config or omit it"
        )
    config.check_model_len(llm.max_model_len, _model_len_source(llm))
    return ServeState.from_llm(config, llm, plan.backend)


def _model_len_source(llm: LLM) -> str:
    """What bounds one request of `llm` (:attr:`LLM.max_model_len`), for messages."""
    draft = llm.draft_seq_capacity
    if draft is not None and draft == llm.max_model_len:
        return "the DSpark draft's KV cache, --max-draft-kv-cache-capacity"
    if llm.config.max_position_embeddings == llm.max_model_len:
        return "the model's max_position_embeddings"
    return "the KV cache per sequence, --max-kv-cache-capacity"
