"""Structured outputs (xgrammar) through the official `openai` client on the real SmolLM2,
DSpark (the shipped draft) and target-only: `client.chat.completions.parse` returns a parsed
object on 10 prompts, constrained greedy DSpark == constrained greedy target-only, guided
choice / regex / json_object always match, bad grammars are a 400 naming the field; and the
exactness rule of a draft cut by the grammar (hand-built p / q tables)."""

from __future__ import annotations

import json
import re

import openai
import pydantic
import pytest
import torch
from openai.lib.streaming.chat import ChatCompletionStreamState
from serve_fixtures import serving, torch_threads

from edgebuild.runtime.backend import Proposal
from edgebuild.runtime.llm import LLM
from edgebuild.runtime.rejection import verify_batch
from edgebuild.runtime.sampling import SamplingParams
from tests.conftest import ROOT

MODEL = "smollm2"
DRAFT = ROOT / "edgebuild" / "data" / "smollm2-135m-dspark"
PROMPTS = [f"Describe a person called {n} as JSON." for n in
           ("Ann", "Bob", "Chen", "Dana", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jo")]  # fmt: skip


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int


@pytest.fixture(scope="module")
def dspark_llm(smollm2_dir):
    spec = {"method": "dspark", "model": str(DRAFT), "num_speculative_tokens": 7}
    spec["confidence_scheduling"] = False  # fixed lengths: every step drafts (the tests check it)
    return LLM(smollm2_dir, speculative=spec)


@pytest.fixture(scope="module")
def clients(smollm2_llm, dspark_llm):
    with (
        torch_threads(1),
        serving(smollm2_llm, served_model_name=MODEL) as plain,
        serving(dspark_llm, served_model_name=MODEL) as spec,
    ):
        yield {
            name: openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
            for name, srv in (("target-only", plain), ("dspark", spec))
        }


def ask(client, content, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], temperature=0.0, **kw
    )


def test_parse_returns_a_parsed_object_on_10_prompts_dspark_equals_target_only(clients):
    texts = {}
    for name, client in clients.items():
        texts[name] = []
        for prompt in PROMPTS:
            r = client.chat.completions.parse(
                model=MODEL,
                messages=[{"role": "user", "content": prompt}],
                response_format=Person,
                max_tokens=48,
                temperature=0.0,
            )
            msg = r.choices[0].message
            assert isinstance(msg.parsed, Person), msg.content
            texts[name].append(msg.content)
    assert texts["dspark"] == texts["target-only"]


@pytest.mark.parametrize("name", ["target-only", "dspark"])
def test_guided_choice_regex_and_json_object_always_match(clients, name):
    client = clients[name]
    choices = ["red", "green", "blue"]
    r = ask(client, "Pick a colour.", max_tokens=8, extra_body={"guided_choice": choices})
    assert r.choices[0].message.content in choices
    r = ask(client, "A date?", max_tokens=16, extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]", r.choices[0].message.content)
    r = ask(client, "A JSON object", max_tokens=40, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix of a JSON object
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_bad_grammars_are_a_400_naming_the_field(clients):
    client = clients["target-only"]
    with pytest.raises(openai.BadRequestError, match="regex") as err:
        ask(client, "x", max_tokens=4, extra_body={"guided_regex": "(unclosed"})
    assert err.value.body["param"] == "guided_regex"
    with pytest.raises(openai.BadRequestError, match="one structured output") as err:
        ask(client, "x", max_tokens=4, extra_body={"guided_regex": "a", "guided_choice": ["b"]})
    with pytest.raises(openai.BadRequestError, match="json_schema needs") as err:
        ask(client, "x", max_tokens=4, response_format={"type": "json_schema"})


def test_a_draft_cut_by_the_grammar_counts_as_rejected():
    """p (rows 0, 1) and the draft's q: the 2nd draft (token 2) was refused by the grammar and
    cut. With it kept as ``rejected``, the token after the accepted 1st draft comes from the
    residual max(0, p_1 - q_2) = token 1 only; as a plain 1-draft block it would be a bonus
    from p_1 (tokens 0 and 1)."""
    p_logits = torch.log(torch.tensor([[1e-9, 1e-9, 1.0], [0.5, 0.5, 1e-12]]))
    q = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])  # draft 1 = token 2, draft 2 refused
    full = Proposal([2, 0], q, torch.ones(2))
    cut = full.cut(1)
    assert cut.tokens == [2] and cut.rejected.tokens == [0]
    params = SamplingParams(temperature=1.0, max_tokens=4)
    seen_cut, seen_plain = set(), set()
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        (v,) = verify_batch([p_logits], [cut], [params], [g])
        assert v.accepted == 1
        seen_cut.add(v.next_token)
        g = torch.Generator().manual_seed(seed)
        (v,) = verify_batch([p_logits], [full.truncated(1)], [params], [g])
        seen_plain.add(v.next_token)
    assert seen_cut == {1} and seen_plain == {0, 1}


class _StubMask:
    """A grammar over V = 5 for the draft's walk: first {1, 2, 4}; after 1: {2, 3}, else
    {3, 4} (a DraftMask's interface)."""

    def __init__(self):
        self.path: list[int] = []

    @staticmethod
    def allowed_after(path: list[int]) -> set[int]:
        return {1, 2, 4} if not path else ({2, 3} if path[0] == 1 else {3, 4})

    def allowed(self, ids):
        return torch.tensor([int(i) in self.allowed_after(self.path) for i in ids])

    def accept(self, token):
        self.path.append(int(token))
        return True


def _masked_logits(path: list[int], raw: torch.Tensor) -> torch.Tensor:
    """Target logits [3, 5] of a block after `path` (drafts), the grammar's -inf applied."""
    out = raw.clone()
    for i in range(3):
        ban = [t for t in range(5) if t not in _StubMask.allowed_after(path[:i])]
        out[i, ban] = float("-inf")
    return out


@pytest.mark.parametrize("rescued", [False, True])
def test_the_masked_draft_is_grammatical_and_sampled_output_keeps_the_target_law(rescued):
    """Draft-side masking (runtime/structured.py DraftMask): the walk draws only allowed
    candidates, q is the softmax over them (hand-computed), and with that q the verifier's
    first two committed tokens follow the masked target chain p0(x1) p1(x2 | x1).
    ``rescued``: no slot-0 candidate is allowed, so slot 0 draws from the allowed top-k of
    the base logits (markov_walk.rescue) and is the block's only draft."""
    from edgebuild.runtime.markov_walk import walk_lattice

    batch, g0 = 6000, torch.Generator().manual_seed(0)
    cand = torch.tensor([[0, 3, 0, 3] if rescued else [0, 1, 2, 3], [1, 2, 3, 4]])  # [n, K]
    scores = torch.randn(2, 4, 4, generator=g0)  # [n, K(prev), K]
    base = torch.randn(2, 5, generator=g0)  # [n, V] the draft's base logits
    raw = torch.randn(3, 5, generator=g0)  # the target's raw rows (the same for every path)
    params = [SamplingParams(temperature=1.0, max_tokens=8)] * batch
    gens = [torch.Generator().manual_seed(i) for i in range(batch)]
    masks = [_StubMask() for _ in range(batch)]
    props = walk_lattice(
        cand.expand(batch, -1, -1), scores.expand(batch, -1, -1, -1), None, [2] * batch,
        params, gens, masks, base.expand(batch, -1, -1) if rescued else None,
    )  # fmt: skip
    first = torch.full((5,), float("-inf"))  # q of slot 0 over the vocabulary
    if rescued:  # the allowed tokens {1, 2, 4} by their base logits (4 is now a candidate)
        first[[1, 2, 4]] = base[0, [1, 2, 4]]
    else:  # the allowed candidates {1, 2} by their lattice scores (4 is no candidate)
        first[[1, 2]] = scores[0, 0, [1, 2]]
    for p, m in zip(props[:50], masks, strict=False):
        assert p.tokens == m.path and p.tokens[0] in {1, 2, 4}
        assert len(p.tokens) == (1 if rescued else 2)
        assert p.tokens[1:] == [] or p.tokens[1] in _StubMask.allowed_after(p.tokens[:1])
        torch.testing.assert_close(p.dense_q(5)[0], torch.softmax(first, -1))
    logits = [_masked_logits(p.tokens, raw)[: len(p) + 1] for p in props]  # [n_b + 1, V]
    verdicts = verify_batch(logits, props, params, gens)
    committed = [v.tokens(p.tokens) for v, p in zip(verdicts, props, strict=True)]
    p0 = torch.softmax(_masked_logits([], raw)[0], -1)
    x1 = torch.bincount(torch.tensor([c[0] for c in committed]), minlength=5) / batch
    assert (x1 - p0).abs().sum() < 0.05  # total variation (n = 6000: ~0.02 expected)
    for a in (1, 2):  # given the first draft a accepted, the next token ~ p1(. | a)
        nxt = [c[1] for c in committed if len(c) > 1 and c[0] == a]
        p1 = torch.softmax(_masked_logits([a], raw)[1], -1)
        got = torch.bincount(torch.tensor(nxt), minlength=5) / len(nxt)
        assert len(nxt) > 500 and (got - p1).abs().sum() < 0.1


def test_constrained_dspark_drafts_only_grammatical_tokens(dspark_llm, smollm2_llm, monkeypatch):
    """With the draft masked, the matcher never cuts a DSpark block (every draft is allowed)
    and the output equals constrained target-only (tau: bench/grammar_mask.py)."""
    from edgebuild.runtime.structured import GrammarSpec, RequestGrammar

    walks = []
    real = RequestGrammar.walk

    def spy(self, drafts):
        k = real(self, drafts)
        walks.append((len(drafts), k))
        return k

    monkeypatch.setattr(RequestGrammar, "walk", spy)
    schema = json.dumps(Person.model_json_schema())
    params = SamplingParams(max_tokens=24, grammar=GrammarSpec("json_schema", schema))
    ids = dspark_llm.encode_messages([{"role": "user", "content": PROMPTS[0]}])
    st = dspark_llm.generate_ids([ids], params)[0]
    assert walks and all(k == n for n, k in walks)
    assert sum(st.metrics.proposed_at) > 0  # drafts were made (and were all grammatical)
    assert st.output_ids == smollm2_llm.generate_ids([ids], params)[0].output_ids


# ---------------------------------------------------------------------- tool calls
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("name", ["target-only", "dspark"])
def test_tool_round_trip_call_result_answer(clients, name):
    client = clients[name]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=MODEL, tools=[WEATHER, TIME], temperature=0.0, max_tokens=40)
    r = client.chat.completions.create(messages=messages, tool_choice="required", **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict)
    named = client.chat.completions.create(
        messages=messages,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **kw,
    )
    (wcall,) = named.choices[0].message.tool_calls
    assert wcall.function.name == "get_weather" and "city" in json.loads(wcall.function.arguments)
    # streamed: OpenAI's tool-call deltas add up to the same call
    chunks = list(
        client.chat.completions.create(
            messages=messages,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            stream=True,
            **kw,
        )
    )
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == wcall.function.arguments
    assert len([d for d in deltas if d.function.arguments]) > 1  # pieces, as generated
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    state = ChatCompletionStreamState()  # the openai client's own accumulation
    for c in chunks:
        state.handle_chunk(c)
    (acc,) = state.get_final_completion().choices[0].message.tool_calls
    assert acc.function.name == "get_weather" and acc.id == deltas[0].id
    assert json.loads(acc.function.arguments) == json.loads(wcall.function.arguments)
    assert acc.function.arguments == wcall.function.arguments
    # the result goes back as role "tool"; the model answers in text
    messages += [
        named.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": wcall.id, "content": '{"temperature_c": 21}'},
    ]
    final = client.chat.completions.create(messages=messages, **kw)
    assert final.choices[0].message.content
    assert final.choices[0].finish_reason in ("stop", "length")
    none = client.chat.completions.create(messages=messages[:1], tool_choice="none", **kw)
    assert none.choices[0].message.tool_calls is None


def test_a_forced_call_cut_by_max_tokens_returns_no_markup(clients):
    client = clients["target-only"]
    kw = dict(model=MODEL, tools=[WEATHER], tool_choice="required", temperature=0.0, max_tokens=3)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = client.chat.completions.create(messages=messages, **kw).choices[0]
    assert (choice.message.content, choice.message.tool_calls) == (None, None)
    assert choice.finish_reason == "length"
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **kw))
    assert not any(c.choices and c.choices[0].delta.content for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_tool_call_parsing_and_incremental_stream():
    from edgebuild.serve.tools import ToolCallStream, parse_tool_calls

    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "g"}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"x": 1}),
        ("g", {}),
    ]
    assert parse_tool_calls("<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>",
        [],
    )
    # the stream: content as it comes, the call's name once complete, then its arguments
    # in the pieces the model wrote; concatenated == parse_tool_calls of the whole text
    text = 'Hi <tool_call>\n{"name": "f", "arguments": {"x": [1, "}"], "y": 2}}\n</tool_call> ok'
    s = ToolCallStream()
    pieces = [p for i in range(0, len(text), 3) for p in s.feed(text[i : i + 3])] + s.finish()
    content = "".join(p.get("content", "") for p in pieces)
    deltas = [d for p in pieces for d in p.get("tool_calls", [])]
    assert content == "Hi  ok" and deltas[0]["function"]["name"] == "f"
    args = "".join(d["function"]["arguments"] for d in deltas)
    assert len([d for d in deltas if d["function"]["arguments"]]) > 3
    assert (
        args == parse_tool_calls(text)[1][0]["function"]["arguments"] == '{"x": [1, "}"], "y": 2}'
    )
    assert {d["index"] for d in deltas} == {0}
    # no arguments key: the whole call at the block's end; not JSON: content, as non-streamed
    s = ToolCallStream()
    out = s.feed('<tool_call>{"name": "g"}</tool_call><tool_call>nope</tool_call> <tool_c')
    assert [d["function"]["arguments"] for d in out[0]["tool_calls"]] == ["", "{}"]
    assert out[1] == {"content": "<tool_call>nope</tool_call> "}
    assert s.finish() == [{"content": "<tool_c"}] and s.calls == 1
    s = ToolCallStream()
    assert s.feed("a <t") == [{"content": "a "}] and s.feed("x> d") == [{"content": "<tx> d"}]
