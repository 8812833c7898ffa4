"""Logits processors and log-probabilities, applied identically to decode and verify rows.

A speculative verify pass gives the target's logits for rows 0..n over [anchor, d_1..d_n];
row i predicts the token after the request's committed tokens plus the drafts d_1..d_i. The
processors here take that context row by row (``drafts[:i]`` appended to the output), so a
verify row sees exactly what a one-token decode row at the same position would see, and greedy
DSpark stays equal to greedy target-only with penalties on.

Order (vLLM's sampler): ``logit_bias``, ``min_tokens`` (EOS / stop ids masked to -inf), then
the penalties: repetition (HF: over prompt + output, ``logit / r`` when positive, ``logit * r``
when negative), frequency (``- f * count`` over the output) and presence (``- p`` per token in
the output). Temperature, min-p, top-k and top-p follow in
:func:`edgebuild.runtime.sampling.target_probs` / :func:`edgebuild.runtime.rejection.probs_rows`.

Log-probabilities (:func:`token_logprobs`) are the target's ``log_softmax`` of the *raw* logits,
before every processor and before temperature (vLLM's default ``logprobs_mode``
``raw_logprobs``), so they do not depend on the sampling settings, and a verify row gives the
same numbers as the decode row of target-only decoding (the row-invariant kernels, see
tests/test_batch_invariance.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgebuild.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and its most likely alternatives.

    Attributes:
        token_id: the committed token.
        logprob: its natural-log probability under the target (raw logits).
        top: ((token id, logprob), ...) the ``params.logprobs`` most likely tokens, descending.
        rank: 1 + the number of tokens more likely than it (vLLM's ``rank``); None when not
            asked for.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


def apply_processors(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: list[int],
    output_ids: list[int],
    drafts: list[int] = (),
    stop_ids: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """The request's logits processors over its rows.

    Args:
        logits: fp32 [R, V] target logits; row i follows ``output_ids + drafts[:i]``
            (R <= len(drafts) + 1).
        params: the request's settings (penalties, logit_bias, min_tokens).
        prompt_ids: the prompt (repetition penalty only).
        output_ids: tokens generated so far.
        drafts: the verified drafts (a decode row: none).
        stop_ids: ids masked until ``min_tokens`` are generated (EOS unless ignore_eos, and
            ``stop_token_ids``).
    Returns:
        fp32 [R, V] processed logits (a new tensor; ``logits`` is not changed).
    """
    z = logits.float().clone()
    rows, vocab = z.shape
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        z[:, ids] += torch.tensor([float(b) for _, b in params.logit_bias])
    if params.min_tokens and stop_ids:
        produced = len(output_ids) + torch.arange(rows)
        early = (produced < params.min_tokens).nonzero().squeeze(-1)
        if len(early):
            ids = torch.tensor(sorted(stop_ids), dtype=torch.long)
            z[early[:, None], ids[None, :]] = float("-inf")
    if not (params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1):
        return z
    counts = output_counts(output_ids, list(drafts)[: rows - 1], rows, vocab)
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        if prompt_ids:
            seen |= torch.bincount(torch.tensor(prompt_ids), minlength=vocab)[None, :] > 0
        r = float(params.repetition_penalty)
        z = torch.where(seen, torch.where(z > 0, z / r, z * r), z)
    if params.frequency_penalty:
        z -= float(params.frequency_penalty) * counts
    if params.presence_penalty:
        z -= float(params.presence_penalty) * (counts > 0).float()
    return z


def output_counts(output_ids: list[int], drafts: list[int], rows: int, vocab: int) -> torch.Tensor:
    """fp32 [rows, V]: row i counts each token in ``output_ids + drafts[:i]``."""
    base = torch.zeros(vocab)
    if output_ids:
        base = torch.bincount(torch.tensor(output_ids), minlength=vocab).float()
    counts = base.repeat(rows, 1)
    if rows > 1 and drafts:
        steps = torch.zeros(rows, vocab)
        idx = torch.tensor(drafts, dtype=torch.long)
        steps[torch.arange(1, len(drafts) + 1), idx] = 1.0
        counts += steps.cumsum(0)
    return counts


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], top: int, ranks: bool = False
) -> list[TokenLogprob]:
    """Log-probabilities of ``tokens[i]`` under raw logits row i.

    Args:
        logits: fp32 [>= len(tokens), V] raw target logits.
        tokens: the committed (or, for prompt logprobs, the next prompt) tokens, one per row.
        top: number of alternatives per token (0..20).
        ranks: also give each token's rank (1 = the most likely).
    """
    n = len(tokens)
    if n == 0:
        return []
    lp = torch.log_softmax(logits[:n].float(), dim=-1)
    chosen_t = lp[torch.arange(n), torch.tensor(tokens, dtype=torch.long)]
    chosen = chosen_t.tolist()
    rank: list = [None] * n
    if ranks:
        rank = ((lp > chosen_t[:, None]).sum(-1) + 1).tolist()
    alts: list[tuple] = [()] * n
    if top:
        vals, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)
        alts = [
            tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)
        ]
    return [TokenLogprob(t, c, a, r) for t, c, a, r in zip(tokens, chosen, alts, rank, strict=True)]
