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
