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

from edgebuild.errors import ConfigError
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
        model: checkpoint or bundle directory.
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
        max_queued_requests: requests that may wait beyond a full batch (then 429).
        max_request_bytes: largest accepted request body (then 413).
        allowed_local_media_path: directory `file://` images may come from (vision models).
        backend: auto | torch | tensorrt.
        threads: torch CPU threads (None = cores - 1, at least 1; runtime/cpu.py).
        dtype: CPU compute dtype: auto (bfloat16 with native CPU bf16, else float32),
            bfloat16 or float32.
        graceful_shutdown_s: on SIGTERM, how long running requests may go on; then each gets
            the documented 503 (an SSE error event and `[DONE]` on a stream).
        enable_prefix_caching: reuse the KV pages (and draft context) of full prompt pages
            that earlier requests computed (runtime/prefill.py).
        enable_chunked_prefill: prefill prompts in chunks, batched, under
            max_num_batched_tokens (False: whole prompts, one by one).
        max_num_batched_tokens: rows one decoder step may run (prompt chunks + decode rows).
    """

    model: Path
    speculative_config: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_batch_size: int = 8
    max_input_len: int = 4096
    max_kv_cache_capacity: int = 16384
    max_queued_requests: int = 64
    max_request_bytes: int = 16 * 1024 * 1024
    allowed_local_media_path: Path | None = None
    backend: str = "auto"
    threads: int | None = None
    dtype: str = "auto"
    graceful_shutdown_s: float = 30.0
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS

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
        if self.max_queued_requests < 0:
            raise ConfigError(f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")
        if self.backend not in BACKENDS:
            raise ConfigError(
                f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}"
            )
        if not self.graceful_shutdown_s >= 0:
            raise ConfigError(f"--graceful-shutdown-s must be >= 0, got {self.graceful_shutdown_s}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        resolve_dtype(self.dtype)  # ConfigError naming --dtype
        if not Path(self.model).exists():
            raise ConfigError(f"model directory {self.model} does not exist")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name


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
        spec = llm.speculative
        metrics.speculative = spec is not None
        if spec is not None and spec.confidence_scheduling:
            metrics.attach_schedule(llm.enable_confidence_scheduling(config.max_batch_size))
        scheduler = Scheduler(llm, config.max_batch_size, config.max_queued_requests, metrics)
        return cls(config, llm, scheduler, metrics, backend or BackendChoice("torch", "given"))

    @property
    def max_model_len(self) -> int:
        """Prompt + generated tokens one request may reach (the per-sequence KV limit)."""
        return min(self.llm.options.seq_capacity, self.llm.config.max_position_embeddings)

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
        return self.llm.options.max_input_len * max(MIN_CHARS_PER_TOKEN, longest)

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


def load_state(config: ServeConfig) -> ServeState:
    """Validate the settings, choose the backend (logged) and load the model.

    Raises:
        ConfigError / CheckpointError / PairingError: before serving anything.
    """
    config.validate()
    backend = select_backend(config.backend, Path(config.model))
    log.info("backend: %s (%s)", backend.name, backend.reason)
    set_cpu_threads(config.threads)
    options = RuntimeOptions(
        max_kv_rows=config.max_kv_cache_capacity,
        max_input_len=config.max_input_len,
        dtype=resolve_dtype(config.dtype),
        prefill=config.prefill,
    )
    llm = LLM(
        config.model,
        speculative=config.speculative_config,
        options=options,
        backend=backend.name,
    )
    return ServeState.from_llm(config, llm, backend)
