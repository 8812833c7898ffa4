"""The FastAPI application: OpenAI routes, health, metrics, auth and request-body limits.

Every check that can fail on the request (body size and JSON, field types, model name,
sampling values, prompt length against the limits) runs here, on the event loop, before the
request reaches the scheduler, so an invalid request never costs model work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import re
import sys
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import jinja2
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic.json_schema import models_json_schema

from edgebuild.checkpoint.hub import split_ref
from edgebuild.errors import RequestError
from edgebuild.runtime.sampling import SEED_MAX, SamplingParams
from edgebuild.serve import media
from edgebuild.serve.config import ServeConfig, ServeState
from edgebuild.serve.errors import APIError, bad_request, from_request_error, install_handlers
from edgebuild.serve.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ImagePart,
    ModelCard,
    ModelList,
    TextPart,
    parse_request,
)
from edgebuild.serve.startup import RETRY_AFTER_S, Startup
from edgebuild.serve.streaming import (
    chat_response,
    chat_stream,
    collect,
    completion_response,
    completion_stream,
)
from edgebuild.serve.tools import hermes_messages, template_supports_tools, template_tool_calls

log = logging.getLogger("edgebuild.serve")

# a UTF-16 surrogate, escaped (\\ud800) or as raw bytes, which json accepts but no tokenizer can
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/health",
    "/health/live",
    "/metrics",
)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _state(request: Request) -> ServeState:
    """The loaded server state; 503 (``model_not_ready``, ``Retry-After``) while the server
    is still starting (downloading, building engines, loading: :mod:`edgebuild.serve.startup`)."""
    state = request.app.state.serve
    if state is None:
        startup = request.app.state.startup
        info = startup.snapshot() if startup is not None else {"stage": "starting"}
        raise APIError(
            503,
            f"the model is not ready yet: {info['stage']} ({info.get('elapsed_s', 0)} s so far); "
            "retry later (GET /health reports the progress)",
            None,
            "model_not_ready",
            retry_after=RETRY_AFTER_S,
        )
    return state


# ---------------------------------------------------------------------- request checks
async def require_api_key(request: Request) -> None:
    """401 unless `Authorization: Bearer <key>` matches --api-key (constant-time compare).

    With --api-key every route needs the key except `/health` (a liveness probe that says
    only ok / unavailable): `/v1/*`, `/metrics`, `/docs`, `/redoc` and `/openapi.json`.
    """
    key = request.app.state.config.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(
            401, "missing API key: send 'Authorization: Bearer <key>'", None, "missing_api_key"
        )
    if not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "invalid API key", None, "invalid_api_key")


async def read_json(request: Request, limit: int) -> dict:
    """The request body as a JSON object.

    Raises:
        APIError: 413 over `limit` bytes; 400 for invalid JSON or a non-object body.
    """
    declared = request.headers.get("content-length")
    too_big = APIError(
        413,
        f"request body larger than {limit} bytes (--max-request-bytes)",
        None,
        "request_too_large",
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(
            f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    except RecursionError:
        raise bad_request(
            "the request body is nested too deeply (JSON arrays / objects more than about "
            f"{sys.getrecursionlimit()} levels deep); flatten it",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise bad_request(
            f"the request body must be a JSON object, got {type(body).__name__}",
            code="invalid_json",
        )
    if _MAYBE_SURROGATE.search(raw):
        where = lone_surrogate(body)
        if where is not None:
            raise bad_request(
                f"'{where}' contains a lone UTF-16 surrogate (such as \\ud800), which is not "
                "valid Unicode text; send valid UTF-8 / escape surrogate pairs together",
                where.split(".", 1)[0],
                "invalid_text",
            )
    return body


def lone_surrogate(value) -> str | None:
    """Path (``messages.0.content``) of the first string or key of a decoded JSON value that
    is not valid Unicode (a lone surrogate), else None. Iterative: any depth json accepted."""
    stack = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(v, dict):
            for k, item in v.items():
                key = json.dumps(k)[1:-1]  # ASCII-escaped: the path goes into the message
                stack.append((f"{path}.{key}" if path else key, k))
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(v, list):
            stack.extend((f"{path}.{i}" if path else str(i), item) for i, item in enumerate(v))
    return None


def check_model(state: ServeState, model: str | None) -> str:
    """The served model name; 404 when the request names another model."""
    name = state.config.model_name
    if model is not None and model != name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {name!r}",
            "model",
            "model_not_found",
        )
    return name


def sampling_for(state: ServeState, req, prompt_ids: list[int]) -> SamplingParams:
    """SamplingParams with the limits checked (prompt length, prompt + max_tokens)."""
    room = state.max_model_len - len(prompt_ids) - state.spec_tokens
    default = 16 if isinstance(req, CompletionRequest) else max(1, room)
    params = req.sampling_params(default, state.sampling_defaults)
    vocab = state.llm.config.vocab_size
    if any(not 0 <= t < vocab for t in params.stop_token_ids):
        raise bad_request(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
    bad = [t for t, _ in params.logit_bias if not 0 <= t < vocab]
    if bad:
        raise bad_request(
            f"logit_bias keys must be token ids in [0, {vocab}), got {bad[:5]}", "logit_bias"
        )
    try:
        state.llm.check_request(prompt_ids, params)
    except RequestError as exc:
        raise from_request_error(
            exc, "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        ) from None
    return params


async def check_grammar(state: ServeState, req, params: SamplingParams) -> None:
    """Compile the request's grammar on the tokenizer thread (xgrammar caches it for the
    worker); 400 naming the field when it is invalid."""
    if params.grammar is None:
        return
    try:
        await tokenize(state, state.llm.check_grammar, params.grammar)
    except RequestError as exc:
        raise bad_request(str(exc), _grammar_param(req)) from None


def _grammar_param(req) -> str:
    """The request field that asked for the structured output (for error messages)."""
    for name in ("response_format", "guided_json", "guided_regex", "guided_choice"):
        if getattr(req, name) is not None:
            return name
    return "guided_grammar" if req.guided_grammar is not None else "structured_outputs"


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling parameters of the ``n`` choices: with a seed, choice i uses seed + i
    (seed - i past the top of the seed range), so each choice has its own reproducible
    stream; without one, each its own random seed."""
    if params.seed is None:
        return [params] * n
    out = []
    for i in range(n):
        seed = params.seed + i if params.seed + i <= SEED_MAX else params.seed - i
        out.append(dataclasses.replace(params, seed=seed))
    return out


async def chat_prompt(state: ServeState, req: ChatCompletionRequest) -> tuple[list[int], list]:
    """Token ids of the conversation through the chat template (400 on template errors), and
    the preprocessed images (a vision-language model). Images are decoded and the text is
    tokenized off the event loop; over-long text is refused before tokenizing."""
    images: list = []
    check_prompt_chars(state, sum(m.num_chars() for m in req.messages), "messages")
    try:
        if state.llm.vision is not None and media.has_image_parts(req.messages):
            limits = media.MediaLimits(
                max_images=state.llm.options.max_images,
                allowed_local_media_path=state.config.allowed_local_media_path,
            )
            messages, urls = media.chat_messages(req.messages)
            images = await asyncio.to_thread(_load_images, state, urls, limits)
        else:
            messages = req.template_messages()
        tools = None
        if req.uses_tools:
            if template_supports_tools(getattr(state.llm.tokenizer, "chat_template", None)):
                tools = req.tool_dicts()
                for m in messages:
                    if m.get("tool_calls"):
                        m["tool_calls"] = template_tool_calls(m["tool_calls"])
            else:
                messages = hermes_messages(messages, req.tool_dicts())
        ids = await tokenize(state, state.llm.encode_messages, messages, images or None, tools)
        return ids, images
    except RequestError as exc:
        raise from_request_error(exc, "messages") from None
    except jinja2.TemplateError as exc:
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None


def check_prompt_chars(state: ServeState, n_chars: int, param: str) -> None:
    """400 when the prompt text is longer than any text that fits in --max-input-len tokens
    (:attr:`ServeState.prompt_char_limit`), before any tokenizer work."""
    limit = state.prompt_char_limit
    if n_chars > limit:
        raise bad_request(
            f"the prompt text has {n_chars} characters, more than the {limit} that can fit in "
            f"the max input length of {state.max_input_len} tokens; shorten it",
            param,
            "prompt_too_long",
        )


async def tokenize(state: ServeState, fn, *args):
    """Run a tokenizer call on the server's tokenizer thread (never on the event loop)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(state.tokenizer_pool, lambda: fn(*args))


def _load_images(state: ServeState, urls: list[str], limits) -> list:
    """Decode and preprocess the request's images (worker thread: no tokenizer, no model)."""
    return state.llm.process_images(media.load_images(urls, limits))


async def completion_prompt(state: ServeState, req: CompletionRequest) -> list[int]:
    """Token ids of a string prompt (tokenized off the event loop, over-long text refused
    first), or the given ids after a range check."""
    if isinstance(req.prompt, str):
        check_prompt_chars(state, len(req.prompt), "prompt")
        return await tokenize(state, state.llm.encode, req.prompt)
    vocab = state.llm.config.vocab_size
    bad = [t for t in req.prompt if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}", "prompt")
    return list(req.prompt)


# ---------------------------------------------------------------------- routes
v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])

# The routes read and validate their bodies by hand (size limit first, then JSON, then the
# models), so the schema of each body is declared here: the same pydantic models validate.
_ERRORS = {
    400: "invalid request: the message names the field and the fix",
    401: "missing or invalid API key",
    404: "the model named does not exist",
    413: "request body over --max-request-bytes",
    429: "the server is busy (Retry-After)",
    500: "internal error",
    503: "starting (model not ready) or shutting down (Retry-After)",
}
ERROR_RESPONSES = {
    code: {"model": ErrorResponse, "description": text} for code, text in _ERRORS.items()
}
REQUEST_MODELS = (ChatCompletionRequest, CompletionRequest, TextPart, ImagePart)


def _body(model, response, chunk) -> dict:
    """``openapi_extra`` and ``responses`` of a POST route whose body is `model`."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    sse = {"schema": {"type": "string", "description": f"SSE: data: {chunk.__name__} JSON"}}
    return {
        "openapi_extra": {
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}
        },
        "responses": {
            200: {
                "model": response,
                "description": "the completion; with stream: true, server-sent events of "
                f"{chunk.__name__}, then data: [DONE]",
                "content": {"text/event-stream": sse},
            },
            **ERROR_RESPONSES,
        },
    }


def model_root(config: ServeConfig) -> str:
    """What ``/v1/models`` shows as ``root``: the Hub id, else the model folder's name."""
    if config.is_hub_model:
        return split_ref(str(config.model))[0]
    return Path(config.model).name


@v1.get(
    "/models", response_model=None, responses={200: {"model": ModelList}, 401: ERROR_RESPONSES[401]}
)
async def list_models(request: Request):
    """The served model with its real limits."""
    state = _state(request)
    spec = state.llm.speculative
    card = ModelCard(
        id=state.config.model_name,
        created=state.created,
        root=model_root(state.config),  # the Hub id, or the folder's name: never its path
        max_model_len=state.max_model_len,
        max_input_len=state.max_input_len,
        speculative=None
        if spec is None
        else {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens},
    )
    return ModelList(data=[card]).model_dump()


@v1.post(
    "/chat/completions", **_body(ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk)
)
async def chat_completions(request: Request):
    """OpenAI chat completions (streamed as SSE with `stream: true`)."""
    state = _state(request)
    req = parse_request(
        ChatCompletionRequest, await read_json(request, state.config.max_request_bytes)
    )
    model = check_model(state, req.model)
    ids, images = await chat_prompt(state, req)
    if images and req.prompt_logprobs is not None:  # image rows are not prompt tokens
        raise bad_request(
            "prompt_logprobs is not supported for prompts with images; send text only",
            "prompt_logprobs",
        )
    params = sampling_for(state, req, ids)
    await check_grammar(state, req, params)
    params = choice_params(params, req.n)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    tickets = state.scheduler.submit_choices(ids, params, rid, images=images)
    if req.stream:
        stream = chat_stream(tickets, request, rid, model, req)
        return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
    events = await collect(tickets, request)
    return chat_response(events, rid, model, req).model_dump(exclude_none=False)


@v1.post("/completions", **_body(CompletionRequest, CompletionResponse, CompletionResponse))
async def completions(request: Request):
    """OpenAI text completions: `prompt` is a string or a list of token ids."""
    state = _state(request)
    req = parse_request(CompletionRequest, await read_json(request, state.config.max_request_bytes))
    model = check_model(state, req.model)
    ids = await completion_prompt(state, req)
    params = sampling_for(state, req, ids)
    await check_grammar(state, req, params)
    params = choice_params(params, req.n)
    rid = f"cmpl-{uuid.uuid4().hex}"
    echo = ""
    if req.echo:
        echo = (
            req.prompt
            if isinstance(req.prompt, str)
            else await tokenize(state, state.llm.tokenizer.decode, ids)
        )
    tickets = state.scheduler.submit_choices(ids, params, rid)
    if req.stream:
        stream = completion_stream(tickets, request, rid, model, req, echo)
        return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
    events = await collect(tickets, request)
    return completion_response(events, rid, model, req, echo).model_dump()


async def health(request: Request):
    """Readiness: 200 while the scheduler's worker runs; 503 while starting (with the stage,
    elapsed seconds and ``Retry-After``: :mod:`edgebuild.serve.startup`) or shutting down."""
    state = request.app.state.serve
    if state is None:
        startup = request.app.state.startup
        body = startup.snapshot() if startup is not None else {"status": "starting"}
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
    if state.scheduler.alive:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable"}, status_code=503)


async def live(request: Request):
    """Liveness: 200 while the process runs, also while it builds or loads the model."""
    return JSONResponse({"status": "alive"})


async def metrics(request: Request):
    """Prometheus text exposition."""
    state = _state(request)
    return Response(state.metrics.render(), media_type=state.metrics.content_type)


class HTTPMetricsMiddleware:
    """Counts responses by route and status (pure ASGI: streaming passes through untouched)."""

    def __init__(self, app, holder):
        self.app, self.holder = app, holder  # holder.serve: the ServeState once loaded

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else "other"
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            state = self.holder.serve
            if state is not None:  # responses while starting are not counted
                state.metrics.http_responses.labels(route, str(status)).inc()


def _add_docs(app: FastAPI, dependencies: list) -> None:
    """/openapi.json, /docs and /redoc behind the same key as the API."""

    async def openapi():
        return JSONResponse(openapi_schema(app))

    async def docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title="edgellm-serve")

    async def redoc():
        return get_redoc_html(openapi_url="/openapi.json", title="edgellm-serve")

    for path, endpoint in (("/openapi.json", openapi), ("/docs", docs), ("/redoc", redoc)):
        app.add_api_route(
            path, endpoint, methods=["GET"], dependencies=dependencies, include_in_schema=False
        )


def openapi_schema(app: FastAPI) -> dict:
    """FastAPI's schema plus the request models (:data:`REQUEST_MODELS`, validation mode)
    under ``components.schemas``, where the routes' ``requestBody`` refers to them."""
    if app.openapi_schema is None:
        schema = app.openapi()
        _, defs = models_json_schema(
            [(m, "validation") for m in REQUEST_MODELS],
            ref_template="#/components/schemas/{model}",
        )
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        app.openapi_schema = schema
    return app.openapi_schema


def _begin_serving(app: FastAPI, state: ServeState) -> None:
    """Start the scheduler's worker, then let requests in (``app.state.serve``)."""
    state.scheduler.start()
    app.state.serve = state
    cfg = state.config
    log.info(
        "serving %s (%s backend%s), max batch %d, max model len %d",
        cfg.model_name,
        state.backend.name,
        f", {state.llm.speculative.method}" if state.llm.speculative else "",
        cfg.max_batch_size,
        state.max_model_len,
    )


def create_app(
    state: ServeState | None = None,
    startup: Startup | None = None,
    config: ServeConfig | None = None,
    on_startup_error=None,
) -> FastAPI:
    """The application over a loaded ``state``, or over a ``startup`` that loads it on a thread
    while the app already answers (``/health`` 503 ``building`` ..., ``/health/live`` 200;
    :mod:`edgebuild.serve.startup`); ``on_startup_error(exc)`` is called if that load fails.
    Its lifespan starts the scheduler and, on shutdown, joins it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if startup is not None:
            startup.run(lambda st: _begin_serving(app, st), on_startup_error or (lambda exc: None))
        else:
            _begin_serving(app, state)
        try:
            yield
        finally:
            st = app.state.serve
            if st is not None:
                await asyncio.to_thread(st.scheduler.close)
                st.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="edgellm-serve", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None
    )
    app.state.serve = None
    app.state.startup = startup
    app.state.config = config if config is not None else state.config
    install_handlers(app)
    app.include_router(v1)
    keyed = [Depends(require_api_key)]  # see require_api_key for which routes need the key
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/health/live", live, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"], dependencies=keyed)
    _add_docs(app, keyed)
    app.add_middleware(HTTPMetricsMiddleware, holder=app.state)
    return app
