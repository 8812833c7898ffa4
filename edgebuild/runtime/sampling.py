"""Sampling parameters and the target distribution p used by decoding and verification.

`target_probs` turns logits into the distribution the request samples from (temperature,
min-p, top-k, top-p, in vLLM's order). The logits it gets have been through the request's
logits processors first (:mod:`edgebuild.runtime.processors`: logit_bias, min_tokens and the
presence / frequency / repetition penalties). Greedy (temperature 0) is the one-hot argmax, so that the rejection rule of
speculative decoding reduces to exact matching (Leviathan et al. 2023, section 2.3).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from edgebuild.errors import RequestError
from edgebuild.runtime.structured import GrammarSpec

GREEDY_EPS = 1e-5  # temperatures below this are greedy (DeepSpec utils/sampling.py)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (OpenAI / vLLM names).

    Attributes:
        max_tokens: generated-token budget (>= 1).
        temperature: 0 = greedy.
        top_p: nucleus mass in (0, 1].
        top_k: 0 = off.
        seed: seeds the request's own generator, an integer in [-2**63, 2**64 - 1]
            (None = nondeterministic).
        stop: stop strings (not included in the output text).
        stop_token_ids: extra token ids that end generation (like EOS).
        ignore_eos: keep going past EOS.
        presence_penalty: subtracted once from the logit of every token already generated,
            in [-2, 2] (OpenAI).
        frequency_penalty: subtracted from a token's logit per time it was generated, in
            [-2, 2] (OpenAI).
        repetition_penalty: > 0; the logit of a token seen in the prompt or the output is
            divided by it when positive, multiplied when negative (HF / vLLM; 1 = off).
        logit_bias: ((token id, bias in [-100, 100]), ...) added to the logits (OpenAI).
        min_tokens: EOS and stop token ids are masked, and stop strings ignored, until this
            many tokens were generated (vLLM).
        min_p: drop tokens whose probability is below min_p x the most likely one's, in
            [0, 1] (vLLM; after temperature, before top-k / top-p).
        logprobs: None = no log-probabilities; k >= 0 = the chosen token's log-probability
            and the k most likely alternatives, per generated token (target model, raw
            logits: before any processor, vLLM's default ``raw_logprobs``).
        prompt_logprobs: None = none; k >= 0 = per prompt token after the first, its
            log-probability under the target given the tokens before it, its rank and the
            k most likely alternatives (vLLM's ``prompt_logprobs``; the request skips the
            prefix cache, as vLLM's does, so every prompt row is computed).
        grammar: structured output the text must match (:mod:`edgebuild.runtime.structured`);
            None = free text.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: GrammarSpec | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k!r}")
        self._check_processors()
        if self.seed is not None and (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise RequestError(
                f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}; "
                "send a smaller seed or none"
            )

    def _check_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= float(getattr(self, name)) <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < float(self.repetition_penalty) <= 100.0:
            raise RequestError(
                f"repetition_penalty must be in (0, 100] (1 = off), got {self.repetition_penalty!r}"
            )
        bad = [(t, b) for t, b in self.logit_bias if not -100.0 <= float(b) <= 100.0]
        if bad:
            raise RequestError(f"logit_bias values must be in [-100, 100], got {bad[:3]}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        if not 0.0 <= float(self.min_p) <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= 20:
                raise RequestError(f"{name} must be in [0, 20], got {k!r}")

    @property
    def has_processors(self) -> bool:
        """Whether logits go through a processor (penalty, bias, min_tokens) before sampling."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def generator(self) -> torch.Generator:
        """A CPU generator seeded from `seed` (or from the global RNG)."""
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else int(torch.randint(2**62, ()).item()))
        return g


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution to sample from.

    Args:
        logits: fp32 [..., V].
    Returns:
        fp32 [..., V] probabilities (one-hot argmax when greedy).
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.min_p > 0.0:
        logits = apply_min_p(logits, params.min_p)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop = cum - sorted_p > params.top_p  # keep the smallest prefix with mass >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def apply_min_p(logits: torch.Tensor, min_p) -> torch.Tensor:
    """Logits fp32 [..., V] (already divided by the temperature) with every token whose
    probability is below ``min_p`` times the largest one's set to -inf; ``min_p`` a float
    or an fp32 tensor [...] (one per row)."""
    probs = torch.softmax(logits, dim=-1)
    if isinstance(min_p, torch.Tensor):
        min_p = min_p[..., None]
    keep = probs >= min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(~keep, float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from fp32 probs [V] (argmax for a one-hot vector)."""
    return int(torch.multinomial(probs, 1, generator=generator).item())
