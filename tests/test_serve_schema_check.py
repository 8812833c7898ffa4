"""Request validation of structured outputs and tools, before any model work: JSON Schema
keywords xgrammar would not enforce, unsatisfiable schemas, unknown structured_outputs
fields, lax tool and message fields are a 400 naming the field; and the allow-list of
:mod:`edgebuild.runtime.schema_check` holds against xgrammar itself (each allowed keyword
really refuses a string that violates it). No model is loaded."""

from __future__ import annotations

import json

import pytest

from edgebuild.runtime.schema_check import FORMATS, check_schema
from edgebuild.serve.errors import APIError
from edgebuild.serve.protocol import ChatCompletionRequest, parse_request

USER = [{"role": "user", "content": "Hi"}]


def grammar_of(body: dict):
    """The GrammarSpec of a chat request (validation as the server does it, no model)."""
    req = parse_request(ChatCompletionRequest, {"messages": USER, **body})
    return req.sampling_params(16).grammar


def refused(body: dict) -> APIError:
    with pytest.raises(APIError) as info:
        grammar_of(body)
    assert info.value.status == 400
    return info.value


def schema_format(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}


# (schema, words of the message): each silently gave unconstrained output before
UNENFORCED = [
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf"),
    ({"not": {}}, "'not'"),
    ({"type": "integer", "const": "zz"}, "const value 'zz' is not of type integer"),
    ({"type": "string", "enum": ["a", 1]}, "enum value 1"),
    (
        {"properties": {"a": {"type": "string"}}, "required": ["b"], "additionalProperties": False},
        "required names ['b']",
    ),
    ({"type": "number", "multipleOf": 7}, "multipleOf"),
    ({"type": "string", "format": "bogus"}, "format 'bogus'"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
    ({"type": "object", "properties": {"a": {"if": {}, "then": {}}}}, "schema.properties.a.if"),
    ({"type": "bogus"}, "type must be one of"),
    (False, "matches nothing"),
]


@pytest.mark.parametrize("schema,words", UNENFORCED)
@pytest.mark.parametrize("field", ["response_format", "guided_json", "structured_outputs"])
def test_an_unenforced_or_unsatisfiable_schema_is_a_400_naming_the_field(schema, words, field):
    if field == "response_format":
        body = schema_format(schema)
    elif field == "guided_json":
        body = {"guided_json": schema}
    else:
        body = {"structured_outputs": {"json": json.dumps(schema)}}
    err = refused(body)
    assert err.param == field and words in err.message and field in err.message


def test_schema_true_is_any_json_for_guided_json_and_refused_by_name_for_response_format():
    assert grammar_of({"guided_json": True}).kind == "json_schema"
    err = refused(schema_format(True))
    assert err.param == "response_format" and "object schema at the top level" in err.message


def test_unknown_and_conflicting_structured_outputs_fields_are_named():
    err = refused({"structured_outputs": {"bogus": 1}})
    assert "structured_outputs.bogus" in err.message
    err = refused({"structured_outputs": {"regex": "a", "choice": ["a"]}})
    assert "structured_outputs.regex, structured_outputs.choice conflict" in err.message


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "tools,param",
    [
        ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
        ([TOOL, TOOL], "tools[1].function.name"),
        (
            [
                TOOL,
                {"type": "function", "function": {"name": "g", "parameters": {"type": "bogus"}}},
            ],
            "tools[1].function.parameters",
        ),
    ],
)
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_bad_tools_are_a_400_naming_the_tool_field(tools, param, choice):
    err = refused({"tools": tools, "tool_choice": choice})
    assert err.param == param and param in err.message


@pytest.mark.parametrize(
    "message,words",
    [
        ({"role": "user"}, "needs 'content'"),
        ({"role": "user", "content": None}, "needs 'content'"),
        ({"role": "user", "content": []}, "got []"),
        ({"role": "tool", "content": "4"}, "tool_call_id"),
        ({"role": "tool", "tool_call_id": "c1", "content": None}, "needs 'content'"),
    ],
)
def test_a_message_without_its_required_fields_is_a_400(message, words):
    with pytest.raises(APIError) as info:
        parse_request(ChatCompletionRequest, {"messages": [*USER, message]})
    assert info.value.param == "messages.1" and words in info.value.message


def test_an_assistant_message_may_carry_only_tool_calls():
    call = {"id": "c1", "function": {"name": "f", "arguments": "{}"}}
    msgs = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert parse_request(ChatCompletionRequest, {"messages": msgs}).messages[1].content == ""


# the allow-list against xgrammar: (schema, a string it must refuse, one it must accept)
ENFORCED = [
    ({"type": "integer", "minimum": 3, "maximum": 5}, "1", "4"),
    ({"type": "integer", "exclusiveMinimum": 3}, "3", "4"),
    ({"type": "number", "exclusiveMaximum": 3}, "3", "2.5"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, "[1, 2]", "[1]"),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, '"x"', "null"),
    ({"$ref": "#/definitions/a", "definitions": {"a": {"type": "null"}}}, "1", "null"),
    ({"type": "integer", "multipleOf": 7}, "10", "14"),
    ({"type": "string", "minLength": 3, "maxLength": 4}, '"a"', '"abc"'),
    ({"type": "string", "pattern": "^a+$"}, '"b"', '"aa"'),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1]", "[1, 2]"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, "[1, 2]", "[1]"),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        "{}",
        '{"a": 1}',
    ),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, '{"a": "x"}', '{"a": 1}'),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, '{"b": 1}', '{"a": 1}'),
    (
        {
            "type": "object",
            "patternProperties": {"^a": {"type": "integer"}},
            "additionalProperties": False,
        },
        '{"a": "x"}',
        '{"a": 1}',
    ),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1},
        "{}",
        '{"a": 1}',
    ),
    ({"enum": [1, "a"]}, "2", '"a"'),
    ({"const": "zz"}, '"y"', '"zz"'),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "null", "1"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"type": "integer"}}}, '"x"', "1"),
    ({"allOf": [{"type": "integer"}], "title": "t", "default": 1}, '"x"', "1"),
    ({"type": "string", "format": "email"}, '"2023-01-21"', '"a@b.co"'),
    ({"type": "string", "format": "date-time"}, '"x"', '"2023-01-21T12:00:00Z"'),
]


@pytest.mark.parametrize("schema,bad,good", ENFORCED)
def test_every_allowed_keyword_is_enforced_by_xgrammar(schema, bad, good):
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    check_schema(schema, "guided_json")  # allowed
    g = Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    assert not _is_grammar_accept_string(g, bad) and _is_grammar_accept_string(g, good)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_allowed_format_refuses_a_plain_word(fmt):
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    g = Grammar.from_json_schema(json.dumps({"type": "string", "format": fmt}))
    assert not _is_grammar_accept_string(g, '"not valid!"')


def test_json_object_means_an_object_not_any_json_value():
    import xgrammar as xgr

    from edgebuild.runtime.structured import GrammarSpec, StructuredOutputs

    outputs = object.__new__(StructuredOutputs)  # no tokenizer: a vocabulary of JSON pieces
    outputs.compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(["{", "}", "[", "]", "null", '"a"']))
    for text, ok in [("[null]", False), ("null", False), ('{"a": null}', True)]:
        matcher = xgr.GrammarMatcher(outputs.compile(GrammarSpec("json_object")))
        assert (matcher.accept_string(text) and matcher.is_completed()) == ok, text


@pytest.mark.parametrize("text", ["<tool_", '<tool_call>\n{"na'])
def test_a_forced_tool_call_cut_by_max_tokens_leaks_no_markup(text):
    from edgebuild.serve.scheduler import Event
    from edgebuild.serve.streaming import chat_response
    from edgebuild.serve.tools import ToolCallStream

    body = {"messages": USER, "tools": [TOOL], "tool_choice": "required", "max_tokens": 3}
    req = parse_request(ChatCompletionRequest, body)
    ev = Event("done", text=text, final_text=text, finish_reason="length", completion_tokens=3)
    choice = chat_response([ev], "id", "m", req).choices[0]
    assert choice.message.content is None and choice.message.tool_calls is None
    assert choice.finish_reason == "length"
    stream = ToolCallStream(req.forces_tool_call)
    assert stream.feed(text) + stream.finish() == []
    auto = ToolCallStream()  # tool_choice auto: the text was the model's own, kept as content
    assert auto.feed(text) + auto.finish() == [{"content": text}]
