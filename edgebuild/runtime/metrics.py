"""Decoding metrics: accepted length per step (tau), acceptance by draft position, time split.

tau = mean over speculative steps of (accepted drafts + 1): the tokens each target pass
commits, bonus / correction token included (DSpark paper section 5, "accepted length").
Acceptance at draft position i = P(draft i accepted | draft i proposed).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Counters of one request (or an aggregate of several: see :meth:`merge`)."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt rows taken from the prefix cache
    generated: int = 0
    steps: int = 0
    committed: int = 0  # sum of (accepted + 1) over steps
    proposed_at: list[int] = field(default_factory=list)  # [i] = steps proposing position i+1
    accepted_at: list[int] = field(default_factory=list)  # [i] = steps accepting position i+1
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0

    def record_step(self, proposed: int, accepted: int) -> None:
        """One target pass that checked `proposed` drafts and accepted the first `accepted`."""
        self.steps += 1
        self.committed += accepted + 1
        grow = proposed - len(self.proposed_at)
        if grow > 0:
            self.proposed_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(proposed):
            self.proposed_at[i] += 1
            if i < accepted:
                self.accepted_at[i] += 1

    @property
    def tau(self) -> float:
        """Mean accepted length per target pass (bonus included); 1.0 without drafts."""
        return self.committed / self.steps if self.steps else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [
            a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at, strict=True)
        ]

    @property
    def decode_s(self) -> float:
        return self.draft_s + self.verify_s

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: tokens after the first over decode time."""
        return (
            (self.generated - 1) / self.decode_s
            if self.decode_s > 0 and self.generated > 1
            else 0.0
        )

    def merge(self, other: RequestMetrics) -> RequestMetrics:
        """Sum of two metric sets (for aggregates over requests)."""
        out = RequestMetrics()
        for name in ("prompt_tokens", "cached_prompt_tokens", "generated", "steps", "committed"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        for name in ("prefill_s", "draft_s", "verify_s"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        n = max(len(self.proposed_at), len(other.proposed_at))
        pad = lambda v: v + [0] * (n - len(v))  # noqa: E731
        out.proposed_at = [
            a + b for a, b in zip(pad(self.proposed_at), pad(other.proposed_at), strict=True)
        ]
        out.accepted_at = [
            a + b for a, b in zip(pad(self.accepted_at), pad(other.accepted_at), strict=True)
        ]
        return out

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "generated_tokens": self.generated,
            "steps": self.steps,
            "tau": round(self.tau, 4),
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position],
            "prefill_s": round(self.prefill_s, 4),
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "decode_tokens_per_s": round(self.tokens_per_s, 2),
        }
