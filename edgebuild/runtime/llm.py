"""`LLM`: the one-object entry point of the CPU runtime (used by `edgebuild run` and the server).

Loads the target (and, with a speculative config, the DSpark draft paired with it), the
tokenizer and chat template, and runs batches of requests to completion with the chosen
decoder. The scheduler of the server drives the same decoder step by step.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from edgebuild.checkpoint.source import WeightSource
from edgebuild.errors import CheckpointError, RequestError
from edgebuild.models.llama import LlamaForCausalLM
from edgebuild.runtime.decoding import (
    DSparkDecoder,
    RequestState,
    TargetOnlyDecoder,
    run_to_completion,
)
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.runtime.speculative import SpeculativeConfig
from edgebuild.runtime.stopping import IncrementalDetokenizer
from edgebuild.runtime.torch_backend import DEFAULT_PAGE_SIZE, TorchTarget

log = logging.getLogger("edgebuild.runtime")


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer (local files only).

    Raises:
        CheckpointError: no tokenizer files in `model_dir`.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

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

    max_kv_rows: total KV capacity in tokens across all sequences.
    max_input_len: longest accepted prompt in tokens.
    page_size: KV page size in tokens.
    dtype: compute dtype of the CPU models.
    """

    max_kv_rows: int = 16384
    max_input_len: int = 4096
    page_size: int = DEFAULT_PAGE_SIZE
    dtype: torch.dtype = torch.float32


class LLM:
    """Target (+ optional DSpark draft) on the torch CPU backend.

    Args:
        model: target checkpoint directory.
        speculative: a SpeculativeConfig (or its JSON) to enable DSpark.
        options: RuntimeOptions.

    Raises:
        CheckpointError / ConfigError / PairingError: before any model runs.
    """

    def __init__(
        self,
        model: str | Path,
        speculative: SpeculativeConfig | str | dict | None = None,
        options: RuntimeOptions | None = None,
    ):
        self.model_dir = Path(model)
        self.options = options or RuntimeOptions()
        spec = speculative
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            spec = SpeculativeConfig.parse(spec)
        self.speculative = spec
        self.source = WeightSource(self.model_dir)
        draft_loader = None
        if spec is not None:  # validate the pair before loading the (large) target
            from edgebuild.runtime.dspark_backend import prepare_draft

            draft_loader = prepare_draft(spec, self.source)
        self.target_model = LlamaForCausalLM.from_source(self.source, self.options.dtype)
        self.config = self.target_model.config
        self.tokenizer = load_tokenizer(self.model_dir)
        self.target = TorchTarget(
            self.target_model, self.options.max_kv_rows, self.options.page_size
        )
        if draft_loader is not None:
            self.draft = draft_loader(self.options)
            self.decoder = DSparkDecoder(
                self.target, self.draft, spec.num_speculative_tokens, spec.confidence_threshold
            )
        else:
            self.draft = None
            self.decoder = TargetOnlyDecoder(self.target)
        self._ids = itertools.count()

    # ------------------------------------------------------------------ prompts
    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of `prompt` (through the chat template when `chat`)."""
        if chat:
            return self.encode_messages([{"role": "user", "content": prompt}])
        return list(self.tokenizer.encode(prompt, add_special_tokens=False))

    def encode_messages(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat conversation with the generation prompt appended."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(f"{self.model_dir}: the tokenizer has no chat template")
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def eos_ids(self) -> frozenset[int]:
        ids = set(self.config.eos_token_id)
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
        limit = min(self.options.max_kv_rows, self.config.max_position_embeddings)
        if total > limit:
            raise RequestError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the capacity "
                f"of {limit} tokens; shorten the prompt or lower max_tokens"
            )

    def new_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id=None
    ) -> RequestState:
        """A RequestState with its own stop checker, generator and cache sequences."""
        self.check_request(prompt_ids, params)
        eos = frozenset() if params.ignore_eos else self.eos_ids()
        detok = IncrementalDetokenizer(self.tokenizer)
        st = RequestState.create(
            request_id or f"req-{next(self._ids)}", prompt_ids, params, eos, detok
        )
        self.decoder.start(st)
        return st

    def finish(self, st: RequestState) -> None:
        """Free every per-request resource (KV pages, draft state)."""
        self.decoder.finish(st)

    def generate_ids(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestState]:
        """Run a batch of prompts to completion (continuous batching: finished ones leave)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        states = [self.new_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        run_to_completion(self.decoder, states)
        return states

    def generate(self, prompt: str, params: SamplingParams, chat: bool = False) -> RequestState:
        """Generate for one text prompt; `state.stopper.final_text()` is the answer."""
        return self.generate_ids([self.encode(prompt, chat)], params)[0]
