"""Request and response models of the OpenAI API (the subset `edgellm-serve` implements).

Requests are validated strictly (a string where a number belongs is an error, not a
coercion); unknown fields are ignored, as OpenAI clients send optional fields freely, but a
known field asking for something this server cannot do (n > 1, logprobs, tools, penalties)
is refused with a message naming it. Responses mirror the OpenAI shapes field for field.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from edgebuild.errors import RequestError
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.serve.errors import APIError, bad_request

MAX_STOP_STRINGS = 16


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


class ChatMessage(_Strict):
    """One chat message; `content` is a string or a list of text / image parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any
    name: str | None = None

    @field_validator("content", mode="plain")
    @classmethod
    def _check_content(cls, value):
        return _content(value)

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


class _GenerationRequest(_Strict):
    """Fields shared by chat and text completions (OpenAI names, plus vLLM's top_k etc.)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Any = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None

    @field_validator("stop", mode="plain")
    @classmethod
    def _check_stop(cls, value):
        return _stop(value)

    def check_supported(self) -> None:
        """Refuse fields whose requested behaviour this server does not implement."""
        if self.n != 1:
            raise bad_request(f"n must be 1 (got {self.n}); send one request per choice", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                raise bad_request(f"{name} is not supported by this server", name)
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by this server", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")

    def requested_max_tokens(self) -> int | None:
        """The token budget the client asked for (None = server default)."""
        return self.max_tokens

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
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise bad_request("'messages' must contain at least one message", "messages")
        if self.logprobs or self.top_logprobs:
            raise bad_request("logprobs are not supported by this server", "logprobs")
        if self.tools:
            raise bad_request("tool calling is not supported by this server", "tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise bad_request(
                "response_format other than 'text' is not supported", "response_format"
            )

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are given
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def template_messages(self) -> list[dict]:
        """Messages as the chat template expects them (`role`, text `content`)."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions body; `prompt` is a string or a list of token ids."""

    prompt: Any
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

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo is not supported by this server", "echo")
        if self.logprobs is not None:
            raise bad_request("logprobs are not supported by this server", "logprobs")
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if self.best_of not in (None, 1):
            raise bad_request("best_of must be 1", "best_of")
        if isinstance(self.prompt, str) and not self.prompt:
            raise bad_request("the prompt is empty", "prompt")
        if isinstance(self.prompt, list) and not self.prompt:
            raise bad_request("the prompt is empty (0 token ids)", "prompt")


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
class Usage(BaseModel):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    """A non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    """One SSE chunk of a streamed chat completion (the usage chunk has no choices)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


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
