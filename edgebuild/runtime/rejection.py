"""Batched speculative verification: accept / resample / bonus for every request in one go.

The words are those of :mod:`edgebuild.runtime.decoding` (Leviathan et al. 2023; DSpark
section 3). This module does for a whole batch what the per-request parts ``accept``,
``resample`` and ``bonus`` there do for one request (they stay as the test oracle), in the
layout of vLLM's ``RejectionSampler``: the target rows of all requests flattened to
``[sum(n_b + 1), V]`` with ``cu_num_draft_tokens``, and the uniforms of each sampled request
drawn up front from its own generator (``n_b + 1``: one per draft, one for the correction or
bonus token), so a request's randomness never depends on the batch it shares.

Greedy requests never build a probability tensor: the target's argmax of every row is taken
once and compared with the drafts (exact match). Sampled requests: p is the request's target
distribution (temperature, top-k, top-p, as :func:`edgebuild.runtime.sampling.target_probs`);
draft i is kept when ``u_i * q_i(d_i) < p_i(d_i)`` (i.e. ``u < min(1, p/q)``; a draft with
``q = 0`` is rejected); the correction after a rejection is drawn from
``normalize(max(0, p_a - q_a))`` (``p_a`` if that mass is <= ``RESIDUAL_EPS``), the bonus from
``p_n``, both by inverse CDF with the request's last uniform.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgebuild.ops import f32_linear
from edgebuild.runtime.backend import Proposal
from edgebuild.runtime.markov_walk import inverse_cdf
from edgebuild.runtime.sampling import SamplingParams, apply_min_p

RESIDUAL_EPS = 1e-8


@dataclass
class Verdict:
    """What one request commits after verification: ``accepted`` drafts, then ``next_token``."""

    accepted: int
    next_token: int

    def tokens(self, drafts: list[int]) -> list[int]:
        """The committed tokens: the accepted drafts and the correction / bonus token."""
        return [*drafts[: self.accepted], self.next_token]


def probs_rows(
    logits: torch.Tensor,  # fp32 [R, V]
    temperature: torch.Tensor,  # fp32 [R] (> 0)
    top_k: torch.Tensor,  # int64 [R] (0 = off)
    top_p: torch.Tensor,  # fp32 [R] in (0, 1]
    min_p: torch.Tensor | None = None,  # fp32 [R] in [0, 1] (0 = off)
) -> torch.Tensor:
    """Row-wise :func:`edgebuild.runtime.sampling.target_probs` for sampled rows: fp32 [R, V].

    Each row has its own temperature, min-p, top-k and top-p (the same rules: min-p first; the
    k largest logits
    kept, ties at the k-th included; the smallest prefix of the sorted distribution with mass
    >= top_p kept; renormalized).
    """
    z = logits.float() / temperature[:, None]
    if min_p is not None and bool((min_p > 0).any()):
        z = apply_min_p(z, min_p)
    need_k = bool((top_k > 0).any())
    need_p = bool((top_p < 1.0).any())
    if need_k or need_p:
        sorted_z, idx = z.sort(dim=-1, descending=True)
        if need_k:
            k = top_k.clamp(min=1, max=z.shape[-1])
            kth = sorted_z.gather(1, (k - 1)[:, None])
            kth = torch.where(top_k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
            z = z.masked_fill(z < kth, float("-inf"))
        if need_p:
            probs = torch.softmax(z, dim=-1)
            sorted_p = probs.gather(1, idx)
            drop = sorted_p.cumsum(-1) - sorted_p > top_p[:, None]
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
            return probs / probs.sum(-1, keepdim=True)
    return torch.softmax(z, dim=-1)


def verify_batch(
    logits: list[torch.Tensor],  # per request fp32 [n_b + 1, V]: target rows for anchor, d_1..d_n
    proposals: list[Proposal],
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> list[Verdict]:
    """Accept, resample or bonus for every request (module docstring); one Verdict each."""
    counts = [len(p) for p in proposals]
    batch = len(proposals)
    if all(p.greedy for p in params):  # greedy: the rows' argmax on Python ints (the rule
        # below, without its batch ops; f32_linear.argmax opens no OpenMP region, whose
        # spinning worker at two threads took the core the next pass's kernel pool needed)
        return [_greedy_verdict(lg, p.tokens) for lg, p in zip(logits, proposals, strict=True)]
    flat = torch.cat([lg.float() for lg in logits]) if batch > 1 else logits[0].float()
    cu = torch.tensor([n + 1 for n in counts]).cumsum(0)  # cu_num_draft_tokens, bonus rows in
    starts = cu - torch.tensor(counts) - 1  # row of each request's anchor
    n_max = max(counts, default=0)
    drafts = torch.tensor([p.tokens + [-1] * (n_max - len(p)) for p in proposals], dtype=torch.long)
    drafts = drafts.reshape(batch, n_max)
    valid = drafts >= 0
    rows = (starts[:, None] + torch.arange(n_max)[None, :]).clamp_max(flat.shape[0] - 1)
    greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool)
    argmax = f32_linear.argmax(flat)  # [R]: also the greedy correction / bonus of every row
    ok = argmax[rows] == drafts  # greedy rule: exact match with the target's argmax
    sampled = (~greedy).nonzero().squeeze(-1).tolist()
    probs, uniforms = {}, {}
    if sampled:
        probs, uniforms = _sampled_rows(flat, starts, counts, params, generators, sampled)
        for b in sampled:
            n = counts[b]
            if n:
                pd = probs[b][torch.arange(n), drafts[b, :n]]
                qd = proposals[b].token_q()
                ok[b, :n] = (qd > 0) & (uniforms[b][:n] * qd < pd)
    ok &= valid
    accepted = torch.cumprod(ok.to(torch.int64), dim=1).sum(1)  # leading accepted drafts
    nxt = argmax[starts + accepted].tolist()
    acc = accepted.tolist()
    for b in sampled:
        nxt[b] = _correction(probs[b], proposals[b], acc[b], uniforms[b][counts[b]])
    return [Verdict(a, t) for a, t in zip(acc, nxt, strict=True)]


def _greedy_verdict(logits: torch.Tensor, drafts: list[int]) -> Verdict:
    """The greedy rule of :func:`verify_batch` for one request: drafts accepted while each
    equals the target's argmax (first index on ties) of the row before it, then that row's
    argmax (the correction, or the bonus after all n); ``logits`` fp32 ``[>= n + 1, V]``."""
    n = len(drafts)
    best = f32_linear.argmax(logits[: n + 1].float()).tolist()
    a = 0
    while a < n and best[a] == drafts[a]:
        a += 1
    return Verdict(a, best[a])


def _sampled_rows(flat, starts, counts, params, generators, sampled):
    """Target distributions (fp32 [n_b + 1, V]) and up-front uniforms of sampled requests."""
    idx = torch.cat([torch.arange(int(starts[b]), int(starts[b]) + counts[b] + 1) for b in sampled])
    per_row = [(params[b], counts[b] + 1) for b in sampled]
    temps = torch.tensor([float(p.temperature) for p, r in per_row for _ in range(r)])
    top_k = torch.tensor([int(p.top_k) for p, r in per_row for _ in range(r)], dtype=torch.long)
    top_p = torch.tensor([float(p.top_p) for p, r in per_row for _ in range(r)])
    min_p = torch.tensor([float(p.min_p) for p, r in per_row for _ in range(r)])
    p_all = probs_rows(flat[idx], temps, top_k, top_p, min_p)
    probs, uniforms, at = {}, {}, 0
    for b in sampled:
        r = counts[b] + 1
        probs[b] = p_all[at : at + r]
        uniforms[b] = torch.rand(r, generator=generators[b])
        at += r
    return probs, uniforms


def _correction(p: torch.Tensor, prop: Proposal, a: int, u: torch.Tensor) -> int:
    """The token after ``a`` accepted drafts: from the residual (rejection) or p_n (bonus)."""
    row = p[a]
    if a < len(prop) or prop.rejected is not None:
        src, i = (prop, a) if a < len(prop) else (prop.rejected, 0)
        if src.q_ids is None:
            q_row = src.q[i].float()
        else:
            q_row = torch.zeros_like(row).scatter_(0, src.q_ids[i].long(), src.q[i].float())
        residual = (row - q_row).clamp_min(0.0)
        if float(residual.sum()) > RESIDUAL_EPS:
            row = residual
    return int(inverse_cdf(row[None], u.reshape(1))[0])
