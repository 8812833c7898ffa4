"""How prompts are prefilled: chunked, batched prefill under a per-step token budget, and the
prefix cache switch (the decoders run it; :mod:`edgebuild.runtime.decoding`).

Chunked prefill (vLLM's ``--enable-chunked-prefill``): a prompt that is not yet in the cache is
run ``prefill_chunk`` rows per step, its chunk boundaries fixed from where its prefill starts
(a multiple of the page size, never above ``max_input_len``, the TensorRT profile limit), and
the chunks of several waiting prompts (first come, first served) share one target pass as
long as the step's rows stay within ``max_num_batched_tokens`` (decode / verify rows of the
running requests included; at least one chunk always runs). So one long prompt costs the
running streams one chunk per step, and many new prompts share a pass. Off: every new prompt
is prefilled whole, alone, one after the other (the behaviour before chunking).

Prefix caching (vLLM's ``--enable-prefix-caching``): full prompt pages are registered in the
target's page allocator under the chained hash of their tokens
(:mod:`edgebuild.runtime.kv_cache`) and reused by later prompts that start the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from edgebuild.errors import ConfigError

DEFAULT_PREFILL_CHUNK = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256  # TTFT p50 at 16 clients: 0.54 s at 256, 0.9 s at 512+ (bench)


@dataclass(frozen=True)
class PrefillConfig:
    """Prefill settings (``edgellm-serve`` flags of the same names).

    Attributes:
        enable_chunked_prefill: chunked, batched prefill (False: whole prompts one by one).
        prefill_chunk: rows of one prompt per step (rounded down to a multiple of the page
            size and capped at max_input_len by :meth:`resolved`).
        max_num_batched_tokens: rows one step may run (prefill chunks + decode / verify rows).
        enable_prefix_caching: reuse cached full prompt pages across requests.
    """

    enable_chunked_prefill: bool = True
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    enable_prefix_caching: bool = True

    def validate(self) -> None:
        """Raises ConfigError naming the flag of a bad value."""
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")

    def resolved(self, page_size: int, max_input_len: int) -> PrefillConfig:
        """This config with the chunk fitted to the cache and the engines: a multiple of
        `page_size` when at least one page fits, and at most `max_input_len` rows."""
        self.validate()
        chunk = min(self.prefill_chunk, max_input_len)
        if chunk >= page_size:
            chunk -= chunk % page_size
        return dataclasses.replace(self, prefill_chunk=max(1, chunk))


@dataclass
class PrefillStats:
    """Counters of one decoder (the server exports them; tokens as vLLM counts them).

    prefix_queries: prompt tokens looked up in the prefix cache; prefix_hits: those found.
    chunks: prompt chunks run; passes: target passes that ran prefill chunks.
    """

    prefix_queries: int = 0
    prefix_hits: int = 0
    chunks: int = 0
    passes: int = 0

    def copy(self) -> PrefillStats:
        """A snapshot of these counters (the server diffs two snapshots)."""
        return dataclasses.replace(self)
