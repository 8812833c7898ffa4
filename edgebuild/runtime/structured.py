"""Structured outputs: a grammar (JSON, a JSON schema, a regex, a choice, EBNF) masks the
target's logits through xgrammar (the library vLLM, SGLang and TensorRT-LLM use; CPU, a token
bitmask per row).

The mask is applied in every row that chooses a token: the prefill's last row, a decode row,
and every verify row of a speculative step. Before verification the request's matcher walks
the drafts: row i's mask is the matcher's state after the committed tokens and drafts
d_1..d_i, and the first draft the grammar refuses ends the block there (no verify rows are
spent past it), after which the matcher rolls back to the committed state. After
verification it advances along the committed tokens only.

The draft is masked too (:class:`DraftMask`): during the draft's walk each slot's candidates
are filtered by the matcher's mask after the drafts chosen before it (the matcher walks the
block and then rolls back), so the drafts are grammatical and the block is not cut at the
first free-text token. A slot where no candidate is allowed ends the block there, before
anything is drawn for it (a stopping rule that depends only on the earlier drafts, like the
budget); with the draft's base logits on hand (the torch draft) that slot is first drawn from
the allowed top-k of them, as the block's last draft (:func:`edgebuild.runtime.markov_walk.rescue`). q is then the masked, renormalised draft distribution, the distribution the token was
really drawn from, and the verifier's acceptance ratio and residual use that same q
(``Proposal.q``), so the rejection sampler stays exact (Leviathan et al. 2023, section 2.3:
any q works as long as it is the one sampled from).

Exactness. Greedy: a refused draft could never match the masked argmax, so cutting it changes
nothing. Sampled: the refused draft d_{k+1} would have been rejected with certainty (its masked
p is 0), so when every kept draft is accepted the next token comes from the residual
``normalize(max(0, p_k - q_{k+1}))``, as a rejection there would give (``Proposal.rejected``),
not from p_k: the law stays the target's masked distribution.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from edgebuild.errors import RequestError

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "tool_call")


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match.

    Attributes:
        kind: ``json_object`` (any JSON object, not an array or a scalar), ``json_schema`` (``value``: the schema as
            JSON text), ``regex``, ``choice`` (``value``: a JSON list of strings) or
            ``grammar`` (``value``: EBNF in xgrammar's / vLLM's GBNF dialect) or
            ``tool_call`` (``value``: a JSON schema; the output is ``<tool_call>\n`` + JSON
            matching it + ``\n</tool_call>``, the Hermes / Qwen format).
        value: the grammar's text ("" for json_object).
    """

    kind: str
    value: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise RequestError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")


class StructuredOutputs:
    """Compiles grammars for one tokenizer (cached by xgrammar) and makes request matchers.

    Args:
        tokenizer: the HF tokenizer.
        vocab_size: V of the logits rows (the head's width; ids past the tokenizer are masked).
        stop_ids: the ids that end generation (EOS): allowed once the grammar is complete.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_ids: frozenset[int]):
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids)
        )
        self.compiler = xgr.GrammarCompiler(self.info)
        self.stop_ids = sorted(stop_ids)

    def compile(self, spec: GrammarSpec):
        """The compiled grammar of `spec`.

        Raises:
            RequestError: an invalid schema, regex or grammar (the message starts with the
                field and says what xgrammar refused).
        """
        c = self.compiler
        try:
            if spec.kind == "json_object":  # OpenAI's json_object: a JSON object
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "json_schema":
                return c.compile_json_schema(spec.value, any_whitespace=False, strict_mode=True)
            if spec.kind == "regex":
                return c.compile_regex(spec.value)
            if spec.kind == "choice":
                alts = " | ".join(json.dumps(s) for s in json.loads(spec.value))
                return c.compile_grammar(f"root ::= {alts}")
            if spec.kind == "tool_call":
                g = self.xgr.Grammar
                block = g.concat(
                    g.from_ebnf('root ::= "<tool_call>\\n"'),
                    g.from_json_schema(spec.value, any_whitespace=False, strict_mode=True),
                    g.from_ebnf('root ::= "\\n</tool_call>"'),
                )
                return c.compile_grammar(block)
            return c.compile_grammar(spec.value)
        except (RuntimeError, ValueError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RequestError(f"{spec.kind} is not a valid {spec.kind}: {first}") from None

    def matcher(self, spec: GrammarSpec) -> RequestGrammar:
        """A fresh matcher for one request (its state starts at the grammar's root)."""
        return RequestGrammar(self, self.xgr.GrammarMatcher(self.compile(spec)), self.stop_ids)


class RequestGrammar:
    """One request's grammar state: its matcher and the masks of the rows being verified.

    A row where the grammar allows no token of the vocabulary (a grammar this model's
    tokenizer cannot spell) allows the stop ids instead, so the request ends; ``dead`` is then
    set, and the server reports the request as failed instead of returning invalid text.
    """

    def __init__(self, outputs: StructuredOutputs, matcher, stop_ids: list[int] = ()):
        self.outputs = outputs
        self.matcher = matcher
        self.stop_ids = list(stop_ids)
        self.masks: torch.Tensor | None = None  # int32 [k + 1, W] of the current block
        self.dead = False  # a committed token the grammar refused (see above)

    def walk(self, drafts: list[int]) -> int:
        """Masks of rows 0..k (``self.masks``) for the drafts the grammar accepts, k of them
        (the first refused draft and those after it are cut); the matcher is left at the
        committed state."""
        xgr, m = self.outputs.xgr, self.matcher
        masks = xgr.allocate_token_bitmask(len(drafts) + 1, self.outputs.vocab_size)
        k = 0
        if not m.is_terminated():
            m.fill_next_token_bitmask(masks, 0)
        else:
            masks.fill_(-1)
        for d in drafts:
            if m.is_terminated() or not m.accept_token(int(d)):
                break
            k += 1
            if m.is_terminated():
                masks[k].fill_(-1)
            else:
                m.fill_next_token_bitmask(masks, k)
        if k:
            m.rollback(k)
        self.masks = masks[: k + 1]
        for row in (~self.masks.bool().any(-1)).nonzero().flatten().tolist():
            for t in self.stop_ids:  # nothing fits: only a stop token (the request ends)
                bit = 1 << (t % 32)
                self.masks[row, t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit
        return k

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 [R, V] logits with the tokens the grammar forbids at -inf, row i masked by
        :meth:`walk`'s row i (R <= k + 1); a new tensor."""
        out = logits.float().clone().contiguous()
        self.outputs.xgr.apply_token_bitmask_inplace(out, self.masks[: out.shape[0]])
        return out

    def draft_mask(self) -> DraftMask:
        """A mask for the draft's walk from the committed state (release it after)."""
        return DraftMask(self)

    def advance(self, tokens: list[int]) -> None:
        """Move the matcher past the committed `tokens` (each was chosen under its mask)."""
        for t in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(int(t)):
                self.dead = True
                return

    @property
    def done(self) -> bool:
        """The grammar is complete (only a stop token may follow)."""
        return self.matcher.is_terminated() or self.matcher.is_completed()


class DraftMask:
    """The grammar as the draft's walk sees it (module docstring): the tokens allowed at the
    next slot, and the matcher moved along the chosen drafts, then rolled back by
    :meth:`release` to the committed state.

    Args:
        grammar: the request's grammar, at its committed state (after the anchor).
    """

    def __init__(self, grammar: RequestGrammar):
        self.grammar = grammar
        self.accepted = 0  # drafts the matcher moved past (rolled back by release)
        self._bits = grammar.outputs.xgr.allocate_token_bitmask(1, grammar.outputs.vocab_size)

    def allowed(self, ids: torch.Tensor) -> torch.Tensor:
        """bool [K]: which of the candidate ids (int64 [K], < V) the grammar allows next;
        none once the grammar is terminated (the block ends there)."""
        m = self.grammar.matcher
        if m.is_terminated():
            return torch.zeros(ids.shape, dtype=torch.bool)
        m.fill_next_token_bitmask(self._bits, 0)
        words = self._bits[0].long()  # int32 words of 32 token bits, least significant first
        return ((words[ids // 32] >> (ids % 32)) & 1).bool()

    def accept(self, token: int) -> bool:
        """Move the matcher past draft `token` (one :meth:`allowed` said yes to)."""
        ok = self.grammar.matcher.accept_token(int(token))
        self.accepted += int(ok)
        return ok

    def release(self) -> None:
        """Roll the matcher back to the committed state (idempotent)."""
        if self.accepted:
            self.grammar.matcher.rollback(self.accepted)
        self.accepted = 0
