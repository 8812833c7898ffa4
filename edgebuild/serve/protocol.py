"""Request and response models of the OpenAI API (the subset `edgellm-serve` implements).

Requests are validated strictly (a string where a number belongs is an error, not a
coercion); unknown fields are ignored, as OpenAI clients send optional fields freely, but a
known field asking for something this server cannot do (``best_of``, ``suffix``) is refused
with a message naming it. Responses mirror the OpenAI shapes field for field.

Log-probabilities are the target model's, from its raw logits: before the penalties,
logit_bias, temperature and top-k / top-p / min-p (vLLM's default ``raw_logprobs``), one entry
per generated token (EOS included: the entries count ``usage.completion_tokens``).

Prompt log-probabilities (completions ``echo`` + ``logprobs``, OpenAI's legacy shape: the
prompt's tokens first in ``choices[i].logprobs``, the first with a null logprob; and vLLM's
``prompt_logprobs`` on both endpoints) are the same raw target numbers, from the prefill's
logits: such a request skips the prefix cache, as in vLLM, so that every prompt row is
computed (:meth:`edgebuild.runtime.decoding.TargetOnlyDecoder.start`). As in vLLM,
``prompt_logprobs`` is refused with ``stream: true``.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from edgebuild.errors import RequestError
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.runtime.schema_check import check_schema
from edgebuild.runtime.structured import GrammarSpec
from edgebuild.serve.errors import APIError, bad_request
from edgebuild.serve.tools import forced_grammar

MAX_STOP_STRINGS = 16
MAX_N = 16  # choices per request


# JSON schemas of the fields validated by hand (plain validators take any JSON value)
_TEXT_PART = {"$ref": "#/components/schemas/TextPart"}
_IMAGE_PART = {"$ref": "#/components/schemas/ImagePart"}
_CONTENT = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"anyOf": [_TEXT_PART, _IMAGE_PART]}},
            {"type": "null"},
        ],
        "title": "Content",
    }
)
_STOP = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16},
            {"type": "null"},
        ],
        "title": "Stop",
    }
)
_PROMPT = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        ],
        "title": "Prompt",
    }
)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# ---------------------------------------------------------------------- requests
class TextPart(_Strict):
    """`{"type": "text", "text": ...}` content part."""

    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    """An image content part (`image_url`, `input_image` or `image`); kept as sent."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_image", "image"]


def _content(value: Any) -> str | list[TextPart | ImagePart]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("content must be a string or a list of content parts")
    parts: list[TextPart | ImagePart] = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i}: 'text' must be a string")
            parts.append(TextPart(type="text", text=part["text"]))
        elif kind in ("image_url", "input_image", "image"):
            parts.append(ImagePart.model_validate(part))
        else:
            raise ValueError(
                f"content part {i}: 'type' must be 'text' or 'image_url', got {kind!r}"
            )
    return parts


class FunctionCall(_Strict):
    """``{"name", "arguments"}``: ``arguments`` is JSON text (OpenAI's shape)."""

    name: str
    arguments: str = "{}"


class ToolCall(_Strict):
    """An assistant message's tool call (sent back in the conversation)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Strict):
    """A tool's function: its ``name``, ``description`` and JSON-schema ``parameters``."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    """``tools[i]``: a function the model may call."""

    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(_Strict):
    """``tool_choice`` naming one function: the model must call it."""

    type: Literal["function"] = "function"
    function: dict[str, str]


class ChatMessage(_Strict):
    """One chat message; `content` is a string or a list of text / image parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Any, _CONTENT] = Field(default=None, validate_default=True)
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_required(cls, data):
        # OpenAI: content is required except on an assistant message (which may carry only
        # tool_calls); a tool result also needs the tool_call_id it answers
        if not isinstance(data, dict) or data.get("role") == "assistant":
            return data
        content = data.get("content")
        if content is None or content == []:
            raise ValueError(
                f"a {data.get('role')!r} message needs 'content' (a string or a non-empty list "
                "of content parts), got " + ("none" if content is None else "[]")
            )
        if data.get("role") == "tool" and not isinstance(data.get("tool_call_id"), str):
            raise ValueError(
                "a 'tool' message needs 'tool_call_id' (the id of the call it answers)"
            )
        return data

    @field_validator("content", mode="plain")
    @classmethod
    def _check_content(cls, value):
        return "" if value is None else _content(value)

    def num_chars(self) -> int:
        """Characters of text in the message (text parts; images not counted)."""
        if isinstance(self.content, str):
            return len(self.content)
        return sum(len(p.text) + 1 for p in self.content if isinstance(p, TextPart))

    def text(self) -> str:
        """The message text (text parts joined by newlines).

        Raises:
            APIError: 400 when an image part is present (the model has no visual component).
        """
        if isinstance(self.content, str):
            return self.content
        if any(isinstance(p, ImagePart) for p in self.content):
            raise bad_request(
                "this model has no visual component: image content parts are not supported; "
                "send text only",
                param="messages",
                code="image_input_not_supported",
            )
        return "\n".join(p.text for p in self.content)


class StreamOptions(_Strict):
    """`stream_options`: `include_usage` adds a final chunk with the token usage."""

    include_usage: bool = False


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("stop must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    if any(s == "" for s in stops):
        raise ValueError("stop strings must not be empty")
    return tuple(stops)


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: the schema the output must validate against."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``response_format``: ``text``, ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Strict):
    """vLLM's ``structured_outputs`` object (one of its fields; any other is refused by name,
    vLLM's ``structural_tag`` and whitespace options included)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _GenerationRequest(_Strict):
    """Fields shared by chat and text completions (OpenAI names, plus vLLM's top_k etc.)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Annotated[Any, _STOP] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    min_p: float | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = None
    user: str | None = None

    @field_validator("stop", mode="plain")
    @classmethod
    def _check_stop(cls, value):
        return _stop(value)

    def check_supported(self) -> None:
        """Refuse fields whose requested behaviour this server does not implement."""
        if not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be in [1, {MAX_N}], got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= 20:
                raise bad_request(
                    f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
                    "prompt_logprobs",
                )
            if self.stream:
                raise bad_request(
                    "prompt_logprobs are not available with stream=true (as in vLLM); "
                    "send stream=false",
                    "prompt_logprobs",
                )

    def requested_max_tokens(self) -> int | None:
        """The token budget the client asked for (None = server default)."""
        return self.max_tokens

    def logprob_count(self) -> int | None:
        """Alternatives per generated token (None = no logprobs)."""
        return None

    def prompt_logprob_count(self) -> int | None:
        """Alternatives per prompt token (None = no prompt logprobs)."""
        return self.prompt_logprobs

    def grammar_spec(self) -> GrammarSpec | None:
        """The structured output asked for (``response_format``, vLLM's ``guided_*`` or
        ``structured_outputs``), None for free text.

        Raises:
            APIError: 400 when more than one is given, or a json_schema has no schema.
        """
        found: list[tuple[str, GrammarSpec]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", GrammarSpec("json_object")))
        if rf is not None and rf.type == "json_schema":
            schema = None if rf.json_schema is None else rf.json_schema.schema_
            if schema is None or schema == {}:
                raise bad_request(
                    "response_format type json_schema needs json_schema.schema",
                    "response_format",
                )
            if schema is True:
                raise bad_request(
                    "response_format.json_schema.schema must be an object schema at the top "
                    "level (as in OpenAI), got true; for any JSON value send guided_json: true",
                    "response_format",
                )
            found.append(("response_format", _schema_spec(schema, "response_format")))
        so = self.structured_outputs
        pairs = [
            ("guided_json", self.guided_json, lambda v: _schema_spec(v, "guided_json")),
            ("guided_regex", self.guided_regex, lambda v: GrammarSpec("regex", v)),
            ("guided_choice", self.guided_choice, _choice_spec),
            ("guided_grammar", self.guided_grammar, lambda v: GrammarSpec("grammar", v)),
        ]
        if so is not None:
            pairs += [
                (
                    "structured_outputs.json",
                    so.json_,
                    lambda v: _schema_spec(v, "structured_outputs"),
                ),
                ("structured_outputs.regex", so.regex, lambda v: GrammarSpec("regex", v)),
                ("structured_outputs.choice", so.choice, _choice_spec),
                ("structured_outputs.grammar", so.grammar, lambda v: GrammarSpec("grammar", v)),
                (
                    "structured_outputs.json_object",
                    so.json_object or None,
                    lambda v: GrammarSpec("json_object"),
                ),
            ]
        found += [(name, make(v)) for name, v, make in pairs if v is not None]
        if len(found) > 1:
            names = ", ".join(n for n, _ in found)
            raise bad_request(
                f"ask for one structured output at a time, got several: {names} conflict; keep one",
                found[1][0].split(".")[0],
            )
        return found[0][1] if found else None

    def bias(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs.

        Raises:
            APIError: 400 when a key is not a token id.
        """
        out = []
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise bad_request(
                    f"logit_bias keys must be token ids (strings of integers), got {key!r}",
                    "logit_bias",
                ) from None
            out.append((token, value))
        return tuple(out)

    def sampling_params(
        self, default_max_tokens: int, defaults: dict | None = None
    ) -> SamplingParams:
        """SamplingParams for this request.

        A field the request leaves out takes ``defaults`` (the values the model's
        ``generation_config.json`` sets, vLLM's ``--generation-config auto``), else the OpenAI
        default (temperature 1, top_p 1, top_k off).

        Raises:
            APIError: 400 for out-of-range values (max_tokens < 1, temperature, top_p...).
        """
        max_tokens = self.requested_max_tokens()
        if max_tokens is not None and max_tokens < 1:
            raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        base = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, **(defaults or {})}
        try:
            return SamplingParams(
                max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                temperature=base["temperature"] if self.temperature is None else self.temperature,
                top_p=base["top_p"] if self.top_p is None else self.top_p,
                top_k=base["top_k"] if self.top_k is None else self.top_k,
                seed=self.seed,
                stop=self.stop or (),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0
                if self.repetition_penalty is None
                else self.repetition_penalty,
                logit_bias=self.bias(),
                min_tokens=self.min_tokens,
                min_p=self.min_p or 0.0,
                logprobs=self.logprob_count(),
                prompt_logprobs=self.prompt_logprob_count(),
                grammar=self.grammar_spec(),
            )
        except RequestError as exc:  # the message starts with the field's name
            field_name = str(exc).split(" ", 1)[0]
            param = field_name if field_name in type(self).model_fields else None
            raise APIError(400, str(exc), param, "invalid_request") from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions body."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise bad_request("'messages' must contain at least one message", "messages")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise bad_request(
                f"top_logprobs must be in [0, 20], got {self.top_logprobs}", "top_logprobs"
            )
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if self.tool_choice is not None and not self.tools and self.tool_choice != "none":
            raise bad_request("tool_choice needs tools", "tool_choice")
        self._check_tools()
        name = self.forced_tool()
        if name is not None and name not in {t.function.name for t in self.tools}:
            raise bad_request(f"tool_choice names {name!r}, which is not in tools", "tool_choice")

    def _check_tools(self) -> None:
        """Each tool has a non-empty name used once, and parameters structured outputs can
        enforce (checked always: the forced call compiles them)."""
        seen: set[str] = set()
        for i, tool in enumerate(self.tools or ()):
            fn, where = tool.function, f"tools[{i}].function"
            if not fn.name or fn.name in seen:
                raise bad_request(
                    f"{where}.name must be a non-empty name used by one tool only, got "
                    f"{fn.name!r}" + (" (already in tools)" if fn.name else ""),
                    f"{where}.name",
                )
            seen.add(fn.name)
            if fn.parameters is not None:
                try:
                    check_schema(fn.parameters, f"{where}.parameters")
                except RequestError as exc:
                    raise bad_request(str(exc), f"{where}.parameters") from None

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are given
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def uses_tools(self) -> bool:
        """Tools are offered to the model (given, and tool_choice is not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_tool_call(self) -> bool:
        """``tool_choice`` required or a named function (with tools): the output is one call."""
        return self.uses_tools and (self.tool_choice == "required" or bool(self.forced_tool()))

    def grammar_spec(self) -> GrammarSpec | None:
        """As for completions; with ``tool_choice`` required or named, the forced tool call
        (:func:`edgebuild.serve.tools.forced_grammar`).

        Raises:
            APIError: 400 for a forced call together with another structured output.
        """
        spec = super().grammar_spec()
        if self.forces_tool_call:
            if spec is not None:
                raise bad_request(
                    "tool_choice required / a named function cannot be combined with "
                    "response_format or guided decoding",
                    "tool_choice",
                )
            return forced_grammar(self.tool_dicts(), self.forced_tool())
        return spec

    def forced_tool(self) -> str | None:
        """The function ``tool_choice`` names, else None."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.get("name")
        return None

    def tool_dicts(self) -> list[dict]:
        """``tools`` as plain dicts (for the chat template and the forced-call schema)."""
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def template_messages(self) -> list[dict]:
        """Messages as the chat template expects them (`role`, text `content`; assistant
        `tool_calls` and tool `tool_call_id` when given)."""
        out = []
        for m in self.messages:
            d = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions body; `prompt` is a string or a list of token ids."""

    prompt: Annotated[Any, _PROMPT]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _check_prompt(cls, value):
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            value = value[0]  # a one-element batch
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        ):
            return value
        if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
            raise ValueError("batched prompts are not supported; send one prompt per request")
        raise ValueError("prompt must be a string or a list of token ids")

    def logprob_count(self) -> int | None:
        return self.logprobs

    @property
    def echo_logprobs(self) -> bool:
        """``echo`` with ``logprobs``: the prompt's tokens lead ``choices[i].logprobs``."""
        return self.echo and self.logprobs is not None

    def prompt_logprob_count(self) -> int | None:
        # echo + logprobs needs the prompt's logprobs with the same alternatives
        counts = [self.prompt_logprobs, self.logprobs if self.echo_logprobs else None]
        counts = [c for c in counts if c is not None]
        return max(counts) if counts else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None and not 0 <= self.logprobs <= 5:
            raise bad_request(f"logprobs must be in [0, 5], got {self.logprobs}", "logprobs")
        if self.suffix:
            raise bad_request(
                "suffix (fill-in-the-middle) is not supported by this server", "suffix"
            )
        if self.best_of not in (None, 1):
            raise bad_request(
                "best_of is not supported by this server (it ranks whole sequences); send n "
                "for several choices",
                "best_of",
            )
        if isinstance(self.prompt, str) and not self.prompt:
            raise bad_request("the prompt is empty", "prompt")
        if isinstance(self.prompt, list) and not self.prompt:
            raise bad_request("the prompt is empty (0 token ids)", "prompt")


def _schema_spec(value, field: str) -> GrammarSpec:
    """The json_schema spec of `value` (a schema, or its JSON text), checked up front.

    Raises:
        APIError: 400 (param `field`) for a keyword structured outputs would not enforce or
            an unsatisfiable schema (:func:`edgebuild.runtime.schema_check.check_schema`).
    """
    try:
        schema = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        schema = None  # not JSON: xgrammar's compile says so, naming the field
    try:
        if schema is not None:
            check_schema(schema, field)
    except RequestError as exc:
        raise bad_request(str(exc), field) from None
    return GrammarSpec("json_schema", value if isinstance(value, str) else json.dumps(value))


def _choice_spec(value: list[str]) -> GrammarSpec:
    if not value or any(not c for c in value):
        raise bad_request("guided_choice must be a list of non-empty strings", "guided_choice")
    return GrammarSpec("choice", json.dumps(value))


def parse_request(model: type[_GenerationRequest], body: dict) -> _GenerationRequest:
    """Validate a decoded JSON object into `model`.

    Raises:
        APIError: 400 naming the first invalid fields and what they should be.
    """
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    req.check_supported()
    return req


def _validation_error(exc: ValidationError) -> APIError:
    parts, first = [], None
    for err in exc.errors()[:3]:
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        first = first or loc
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "this field is required"
        parts.append(f"'{loc}': {msg}")
    return APIError(400, "invalid request: " + "; ".join(parts), first, "invalid_request")


# ---------------------------------------------------------------------- responses
class ErrorDetail(BaseModel):
    """What went wrong (``message`` says how to fix it) and which field (``param``)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error of the API: 400 bad request, 401 key, 404 model, 413 body size, 429 busy
    (``Retry-After``), 500 server, 503 starting or shutting down (``Retry-After``)."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens whose KV came from the prefix cache."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts of one request (all its choices)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class TopLogprob(BaseModel):
    """A token (its text and UTF-8 bytes) with its log-probability under the target."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    """A generated token's entry, with the ``top_logprobs`` most likely alternatives."""

    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    """Chat ``choices[i].logprobs``: one entry per generated token."""

    content: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """Text-completion ``choices[i].logprobs`` (the legacy shape): parallel lists."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class ResponseToolCall(BaseModel):
    """A tool call the model made (``arguments``: JSON text)."""

    id: str
    type: Literal["function"] = "function"
    function: dict[str, str]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    """A non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None  # {index, id, type, function: {name, arguments}}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE chunk of a streamed chat completion (the usage chunk has no choices)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob``: a token's log-probability, its rank (1 = the most likely) and
    its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's ``prompt_logprobs``: per prompt token (the first: null), the prompt token itself and
# the most likely alternatives, keyed by token id
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    """A text completion, or one chunk of a streamed one (same shape, as in OpenAI)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """An entry of GET /v1/models, with the real limits of this server."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "edgebuild"
    root: str
    max_model_len: int
    max_input_len: int
    speculative: dict | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
