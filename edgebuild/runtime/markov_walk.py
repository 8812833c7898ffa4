"""The DSpark Markov walk over a top-k lattice, shared by the torch and TensorRT drafts.

A lattice (spec/draft-checkpoint-formats.md section 3, "Top-k pruning"; the form of the
exported ``draft`` graph, :mod:`edgebuild.export.graphs`) describes one proposal block per
sequence without any vocabulary-sized tensor:

- ``cand [B, n, K]``: the top-k token ids of the base logits of block row l;
- ``scores [B, n, K(i), K(j)]``: the walk's score of candidate j at slot l when the previous
  token is candidate i of slot l-1 (slot 0: the anchor, the same for every i);
- ``confidence [B, n, K(i)]``: the acceptance probability of slot l given that previous token.

The walk goes left to right: slot 0 reads row 0, slot l reads the row of the candidate chosen
at slot l-1. A greedy request takes the argmax (q one-hot on the candidates); a sampled one
draws from ``softmax(scores / T)`` by inverse CDF with uniforms drawn up front from the
request's own generator (``n`` per proposal, so a request's draws never depend on its batch).
The walk is vectorised over the batch: one small gather per slot, no per-request loop (but
for the requests with a grammar, whose candidates are filtered by its mask at each slot:
:class:`edgebuild.runtime.structured.DraftMask`, :func:`constrain`).
"""

from __future__ import annotations

import torch

from edgebuild.runtime.backend import Proposal
from edgebuild.runtime.sampling import SamplingParams


def draw_rows(
    scores: torch.Tensor,  # fp32 [B, K] scores of each row's candidates
    greedy: torch.Tensor,  # bool [B]
    temperature: torch.Tensor,  # fp32 [B] (ignored where greedy)
    uniforms: torch.Tensor,  # fp32 [B] in [0, 1) (ignored where greedy)
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw per row: (q fp32 [B, K] the distribution drawn from, choice int64 [B]).

    Greedy rows: q is one-hot at the argmax (first index on ties). Sampled rows:
    q = softmax(scores / T) and the choice is the first index whose cumulative probability
    exceeds ``u`` (inverse CDF, accumulated in float64; zero-probability candidates are never
    chosen).
    """
    choice = scores.argmax(-1)
    q = torch.nn.functional.one_hot(choice, scores.shape[-1]).to(torch.float32)
    if bool((~greedy).any()):
        rows = (~greedy).nonzero().squeeze(-1)
        t = temperature[rows].clamp_min(1e-5)[:, None]
        probs = torch.softmax(scores[rows].float() / t, dim=-1)
        choice[rows] = inverse_cdf(probs, uniforms[rows])
        q[rows] = probs
    return q, choice


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of ``probs [R, V]`` (need not sum to 1) with ``uniforms [R]``.

    Returns int64 [R]: the first index whose float64 cumulative sum exceeds ``u * total``;
    an index of zero probability is never returned.
    """
    cdf = probs.double().cumsum(-1)
    target = uniforms.double().clamp(0.0, 1.0 - 1e-12) * cdf[:, -1]
    idx = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    idx = idx.clamp_max(probs.shape[-1] - 1)
    # rounding at the very end can land on a trailing zero: step back to the last positive
    bad = probs.gather(1, idx[:, None]).squeeze(-1) <= 0
    if bool(bad.any()):
        last = (probs > 0).cumsum(-1).argmax(-1)  # the last index of positive probability
        idx = torch.where(bad, last, idx)
    return idx


def constrain(
    scores: torch.Tensor,  # fp32 [B, K] scores of slot k's candidates
    ids: torch.Tensor,  # int64 [B, K] the candidate token ids (a dense row: every column's id)
    constraints: list | None,  # per request a DraftMask or None
    limit: list[int],  # drafts per request; cut to k where the grammar allows no candidate
    k: int,
    dead: list[int] | None = None,
) -> torch.Tensor:
    """``scores`` with the candidates each request's grammar refuses at -inf (a new tensor);
    a request whose grammar allows none of them stops drafting at slot k (``limit[b] = k``;
    its index appended to ``dead``)."""
    if constraints is None:
        return scores
    scores = scores.clone()
    for b, mask in enumerate(constraints):
        if mask is None or limit[b] <= k:
            continue
        ok = mask.allowed(ids[b])
        if not bool(ok.any()):
            limit[b] = k
            if dead is not None:
                dead.append(b)
            continue
        scores[b] = scores[b].masked_fill(~ok, float("-inf"))
    return scores


def rescue(
    base: torch.Tensor,  # fp32 [V] the draft's base logits of the slot
    mask,  # the request's DraftMask
    width: int,  # K
    vocab_ids: torch.Tensor | None = None,  # int64 [V]: the token id of each column of base
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """New candidates for a slot where none of the walk's was allowed: (ids int64 [K], their
    base logits fp32 [K]), the K most likely tokens of the draft's base logits that the
    grammar allows (refused ones, when fewer are allowed, at -inf); None when it allows none.
    The slot is then the block's last (no Markov scores exist after a new candidate).
    ``vocab_ids``: a draft with a token map (:mod:`edgebuild.speculative.token_map`) has
    logits over those tokens only (default: column j is token j)."""
    cols = torch.arange(base.shape[-1]) if vocab_ids is None else vocab_ids
    ok = mask.allowed(cols)
    if not bool(ok.any()):
        return None
    top, j = base.float().masked_fill(~ok, float("-inf")).topk(width)
    return cols[j], top


def follow(tokens: torch.Tensor, constraints: list | None, limit: list[int], k: int) -> None:
    """Move each constrained request's grammar past its slot-k draft (``tokens`` int64 [B])."""
    for b, mask in enumerate(constraints or ()):
        if mask is not None and limit[b] > k and not mask.accept(int(tokens[b])):
            limit[b] = k  # not expected (the mask allowed it); the block ends before it


def _rescue_rows(
    row, cand, base, constraints, dead, limit, num_tokens, k, vocab_ids=None
) -> torch.Tensor:
    """Slot k of the `dead` requests from :func:`rescue` (their ``cand[b, k]`` replaced,
    ``row [B, K]`` their scores); each rescued request drafts slot k as its last."""
    for b in dead:
        if num_tokens[b] <= k:
            continue
        got = rescue(base[b, k], constraints[b], cand.shape[-1], vocab_ids)
        if got is not None:
            cand[b, k], row[b] = got
            limit[b] = k + 1
    return row


def walk_uniforms(
    params: list[SamplingParams], generators: list, num_tokens: list[int]
) -> torch.Tensor:
    """fp32 [B, max(num_tokens)] uniforms for the walk: ``num_tokens[b]`` drawn from each
    sampled request's own generator (zeros after them), so what a seeded request draws never
    depends on the drafts the other requests of its batch ask for."""
    u = torch.zeros(len(params), max(num_tokens, default=0))
    for b, (p, g, n) in enumerate(zip(params, generators, num_tokens, strict=True)):
        if not p.greedy and n:
            u[b, :n] = torch.rand(n, generator=g)
    return u


def walk_lattice(
    cand: torch.Tensor,  # int [B, n, K] candidate ids per block row
    scores: torch.Tensor,  # fp32 [B, n, K(i), K(j)]
    confidence: torch.Tensor | None,  # fp32 [B, n, K(i)] or None (no confidence head)
    num_tokens: list[int],
    params: list[SamplingParams],
    generators: list[torch.Generator],
    constraints: list | None = None,
    base: torch.Tensor | None = None,  # fp32 [B, n, V or V'] base logits (torch draft only)
    vocab_ids: torch.Tensor | None = None,  # int64 [V]: base's column -> token id (token map)
) -> list[Proposal]:
    """Walk every sequence's lattice (module docstring); returns one Proposal each.

    Proposal b holds ``num_tokens[b]`` drafts (fewer where its grammar allows no candidate),
    ``q [n_b, K]`` over ``q_ids = cand[b, :n_b]`` and the confidence of each drafted slot
    (ones without a confidence head). ``constraints``: per sequence a
    :class:`~edgebuild.runtime.structured.DraftMask` (or None) filtering its candidates; with
    ``base``, a slot where none is allowed draws from the allowed top-k of the base logits
    instead (:func:`rescue`) and ends the block.

    Raises:
        ValueError: more drafts asked for than the lattice has slots.
    """
    batch = cand.shape[0]
    n_max = max(num_tokens, default=0)
    if n_max > cand.shape[1]:
        raise ValueError(f"{n_max} drafts asked for, the lattice has {cand.shape[1]} slots")
    cand = cand.long()
    if constraints is None and all(p.greedy for p in params):
        return _walk_greedy(cand, scores, confidence, num_tokens)
    greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool)
    temps = torch.tensor([float(p.temperature) for p in params], dtype=torch.float32)
    uniforms = walk_uniforms(params, generators, num_tokens)
    ar = torch.arange(batch)
    prev = torch.zeros(batch, dtype=torch.long)  # slot 0 reads row 0 (the anchor)
    k_width = cand.shape[-1]
    q = torch.zeros(batch, n_max, k_width)
    conf = torch.ones(batch, n_max)
    choice = torch.zeros(batch, n_max, dtype=torch.long)
    limit = list(num_tokens)
    for k in range(n_max):
        dead: list[int] = []
        row = constrain(scores[ar, k, prev].float(), cand[:, k], constraints, limit, k, dead)
        if base is not None and dead:
            cand = cand.clone()  # [B, n, K]: the rescued slots get their own candidates
            row = _rescue_rows(row, cand, base, constraints, dead, limit, num_tokens, k, vocab_ids)
        q[:, k], choice[:, k] = draw_rows(row, greedy, temps, uniforms[:, k])
        if confidence is not None:
            conf[:, k] = confidence[ar, k, prev].float()
        prev = choice[:, k]
        follow(cand[ar, k, prev], constraints, limit, k)
    tokens = cand[:, :n_max].gather(2, choice.unsqueeze(-1)).squeeze(-1)  # [B, n_max]
    listed = tokens.tolist()
    return [
        Proposal(listed[b][:n], q[b, :n], conf[b, :n], q_ids=cand[b, :n])
        for b, n in enumerate(limit)
    ]


def _walk_greedy(
    cand: torch.Tensor,  # int64 [B, n, K]
    scores: torch.Tensor,  # fp32 [B, n, K(i), K(j)]
    confidence: torch.Tensor | None,  # fp32 [B, n, K(i)] or None
    num_tokens: list[int],
) -> list[Proposal]:
    """:func:`walk_lattice` for a batch of greedy requests without grammars, in a few ops: the
    best next candidate of every (slot, previous candidate) at once (``argmax``, first index
    on ties, as :func:`draw_rows`), then each request's path followed in Python. The same
    proposals as the slot-by-slot walk (tests/test_draft_program.py); a slot of that walk was
    ~8 small tensor ops."""
    batch, n_max = cand.shape[0], max(num_tokens, default=0)
    best = scores[:, :n_max].argmax(-1).tolist()  # [B][n][K(i)]: the choice after candidate i
    conf_rows = None if confidence is None else confidence[:, :n_max].float().tolist()
    choice = torch.zeros(batch, n_max, dtype=torch.long)
    conf = torch.ones(batch, n_max)
    for b, n in enumerate(num_tokens):
        prev, path, c = 0, [], []  # slot 0 reads row 0 (the anchor)
        for k in range(n):
            if conf_rows is not None:
                c.append(conf_rows[b][k][prev])
            prev = best[b][k][prev]
            path.append(prev)
        if n:
            choice[b, :n] = torch.tensor(path)
            if conf_rows is not None:
                conf[b, :n] = torch.tensor(c)
    return greedy_proposals(cand, choice, conf, num_tokens)


def greedy_proposals(
    cand: torch.Tensor,  # int64 [B, n, K] candidate ids per slot
    choice: torch.Tensor,  # int64 [B, >= max(num_tokens)] the candidate taken at each slot
    confidence: torch.Tensor,  # fp32 [B, >= max(num_tokens)] the confidence of each slot
    num_tokens: list[int],
) -> list[Proposal]:
    """The Proposals of greedy walks (:func:`_walk_greedy`, or the one-call walk of
    :func:`edgebuild.ops.f32_linear.markov_greedy`): request b drafts ``cand[b, s,
    choice[b, s]]`` for ``s < num_tokens[b]``, ``q`` one-hot at the choice over
    ``q_ids = cand[b, :n_b]``."""
    n_max = max(num_tokens, default=0)
    choice = choice[:, :n_max].long()
    q = torch.zeros(cand.shape[0], n_max, cand.shape[-1])
    q.scatter_(2, choice.unsqueeze(-1), 1.0)  # one-hot at the choice
    tokens = cand[:, :n_max].gather(2, choice.unsqueeze(-1)).squeeze(-1).tolist()
    return [
        Proposal(tokens[b][:n], q[b, :n], confidence[b, :n], q_ids=cand[b, :n])
        for b, n in enumerate(num_tokens)
    ]
