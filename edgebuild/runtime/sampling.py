"""Sampling parameters and the target distribution p used by decoding and verification.

`target_probs` turns logits into the distribution the request samples from (temperature,
top-k, top-p). Greedy (temperature 0) is the one-hot argmax, so that the rejection rule of
speculative decoding reduces to exact matching (Leviathan et al. 2023, section 2.3).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from edgebuild.errors import RequestError

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
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
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
        if self.seed is not None and (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise RequestError(
                f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}; "
                "send a smaller seed or none"
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


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from fp32 probs [V] (argmax for a one-hot vector)."""
    return int(torch.multinomial(probs, 1, generator=generator).item())
