"""`/openapi.json` documents what the server really takes and answers: the request bodies (the
pydantic models that validate), the responses and the errors; a schema-driven client reaches
every field (a wrong type for any documented field is a 400 naming it). `--max-model-len`
(vLLM's flag) caps one request's tokens."""

from __future__ import annotations

import httpx
import pytest
from serve_fixtures import write_tiny_chat_model

from edgebuild.serve.app import create_app, openapi_schema
from edgebuild.serve.cli import main
from edgebuild.serve.config import ServeConfig, load_state
from edgebuild.serve.errors import APIError
from edgebuild.serve.protocol import ChatCompletionRequest, CompletionRequest, parse_request

ROUTES = {
    "/v1/chat/completions": (ChatCompletionRequest, {"messages": [{"role": "user", "content": "t7"}]}),
    "/v1/completions": (CompletionRequest, {"prompt": "t7"}),
}  # fmt: skip
WRONG = {"integer": "x", "number": "x", "boolean": "x", "string": 5, "array": 5, "object": 5}


@pytest.fixture(scope="module")
def schema():
    return openapi_schema(create_app(config=ServeConfig(model="unused")))


def resolve(schema, ref: str) -> dict:
    node = schema
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def refs(node):
    if isinstance(node, dict):
        if "$ref" in node:
            yield node["$ref"]
        for v in node.values():
            yield from refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from refs(v)


def test_every_ref_resolves(schema):
    found = set(refs(schema))
    assert len(found) > 10
    for ref in found:
        assert isinstance(resolve(schema, ref), dict), ref


@pytest.mark.parametrize("path", ROUTES)
def test_post_routes_document_body_responses_and_errors(schema, path):
    model, _ = ROUTES[path]
    op = schema["paths"][path]["post"]
    body = op["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": f"#/components/schemas/{model.__name__}"}
    doc = resolve(schema, body["$ref"])
    assert set(doc["properties"]) == set(model.model_fields)  # the validating model itself
    assert {"n", "logprobs", "presence_penalty", "logit_bias", "min_p", "seed"} <= set(
        doc["properties"]
    )
    for code in ("200", "400", "401", "413", "429", "503"):
        assert code in op["responses"], code
    err = op["responses"]["400"]["content"]["application/json"]["schema"]
    assert resolve(schema, err["$ref"])["properties"]["error"]
    assert "text/event-stream" in op["responses"]["200"]["content"]


def _simple_type(prop: dict) -> str | None:
    options = prop.get("anyOf", [prop])
    kinds = {o.get("type") for o in options} - {"null"}
    return kinds.pop() if len(kinds) == 1 and None not in kinds else None


@pytest.mark.parametrize("path", ROUTES)
def test_a_wrong_type_for_any_documented_field_is_a_400_naming_it(schema, path):
    model, minimal = ROUTES[path]
    parse_request(model, dict(minimal))  # the minimal body is valid
    doc = resolve(schema, f"#/components/schemas/{model.__name__}")
    assert set(doc["required"]) == set(minimal)
    tried = 0
    for name, prop in doc["properties"].items():
        kind = _simple_type(prop)
        if kind is None or name in minimal:
            continue
        with pytest.raises(APIError) as err:
            parse_request(model, {**minimal, name: WRONG[kind]})
        assert err.value.status == 400 and name in err.value.message, name
        tried += 1
    assert tried >= 20


def test_max_model_len_caps_one_request(tmp_path):
    assert any(p.name == "max_model_len" for p in main.params)
    path = write_tiny_chat_model(tmp_path / "m")
    cfg = ServeConfig(model=path, max_model_len=48, max_kv_cache_capacity=1024)
    state = load_state(cfg)
    assert state.max_model_len == 48 and state.llm.options.max_input_len == 47
    import asyncio

    async def go():
        app = create_app(state)
        app.state.serve = state
        state.scheduler.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                ok = await c.post("/v1/completions", json={"prompt": [5] * 10, "max_tokens": 30})
                over = await c.post("/v1/completions", json={"prompt": [5] * 10, "max_tokens": 40})
                models = await c.get("/v1/models")
            return ok, over, models
        finally:
            state.scheduler.close()

    ok, over, models = asyncio.run(go())
    assert ok.status_code == 200, ok.text
    assert over.status_code == 400 and "capacity of 48 tokens" in over.json()["error"]["message"]
    assert models.json()["data"][0]["max_model_len"] == 48
    with pytest.raises(Exception, match="--max-model-len must be >= 2"):
        ServeConfig(model=path, max_model_len=1).validate()
