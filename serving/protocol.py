"""The HTTP contract of the endpoint: strict pydantic request models for /v1/completions and
/v1/chat/completions, the request body read and checked here (size, UTF-8, JSON: FastAPI's
errors for these cases are generic), with the checks that need the model in serving.checks
and the response bodies in serving.responses. Strict types:
"max_tokens": "5" is an error, not 5. Every refusal is a RequestError (400) whose message and
param name the offending item, down to "prompt[1]" or "messages[0].content[2].text"."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, TypeVar

from fastapi import Request
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from serving.errors import RequestError, validation_message
from serving.fields import (
    FieldError,
    check_content,
    check_prompt,
    check_stop,
    check_text,
    param_name,
)
from serving.speculation import DEFAULT_KNOBS, DEFAULT_POLICY

MAX_STOP_SEQUENCES = 4  # as OpenAI
MAX_N = 16  # choices per prompt; the server's max_choices bounds n * prompts


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = True  # usage always comes in the final chunk
    include_obfuscation: bool | None = None  # newer clients may send it; nothing to pad here


class Speculation(BaseModel):
    """``{"policy": name, **knobs}``; serving.speculation builds the policy from them."""

    model_config = ConfigDict(strict=True, extra="allow")
    policy: str = DEFAULT_POLICY

    @property
    def knobs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class ChatMessage(BaseModel):
    """One message; ``content`` arrives as a string or a list of text parts (check_content),
    a string here."""

    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None

    @field_validator("content", mode="plain")
    @classmethod
    def _content(cls, value: Any) -> str:
        return check_content(value)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        return None if value is None else check_text(value)


class _Request(BaseModel):
    """The fields both endpoints share. OpenAI fields some clients always send are accepted at
    their neutral values only (_NEUTRAL: field -> accepted values)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    _NEUTRAL: ClassVar[dict[str, tuple]] = {
        "frequency_penalty": (0,),
        "presence_penalty": (0,),
        "logit_bias": (None, {}),
    }

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    user: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    speculation: Speculation | None = None
    # Extension: this request's own deadline in seconds (the server clamps it to its limit);
    # past it the generation ends with finish_reason "deadline".
    timeout_s: float | None = Field(None, gt=0)

    @field_validator("*")
    @classmethod
    def _neutral(cls, value: Any, info: ValidationInfo) -> Any:
        allowed = cls._NEUTRAL.get(info.field_name or "")
        if allowed is not None and value not in allowed:
            raise ValueError("not supported here; leave it at its default")
        return value

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, value: Any) -> list[str] | None:
        return check_stop(value, MAX_STOP_SEQUENCES)

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])  # the validator made it a list

    @property
    def speculation_spec(self) -> tuple[str, dict[str, Any]]:
        if self.speculation is None:
            return DEFAULT_POLICY, dict(DEFAULT_KNOBS)
        return self.speculation.policy, self.speculation.knobs


class CompletionRequest(_Request):
    """POST /v1/completions. Defaults follow OpenAI (max_tokens 16, temperature 1)."""

    _NEUTRAL: ClassVar[dict[str, tuple]] = {
        **_Request._NEUTRAL,
        "echo": (False,),
        "logprobs": (None,),
        "best_of": (None, 1),
        "suffix": (None, ""),
    }

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[str] | list[int] | list[list[int]]:
        return check_prompt(value)

    @property
    def _single(self) -> bool:
        return isinstance(self.prompt, str) or isinstance(self.prompt[0], int)

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a string, or token ids."""
        return [self.prompt] if self._single else list(self.prompt)  # type: ignore[list-item]

    def prompt_param(self, i: int) -> str:
        """The param naming prompts[i] in errors: "prompt", or "prompt[i]" in a list."""
        return "prompt" if self._single else f"prompt[{i}]"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions. max_tokens / max_completion_tokens (its newer name) are
    optional, as at OpenAI: without them the server's default applies."""

    _NEUTRAL: ClassVar[dict[str, tuple]] = {
        **_Request._NEUTRAL,
        "logprobs": (None, False),
        "top_logprobs": (None,),
        "response_format": (None, {"type": "text"}),
        "tools": (None, []),
        "tool_choice": (None, "none"),
        "parallel_tool_calls": (None,),
    }

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("must contain at least one message")
        return value

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_tokens")
        if value is not None and other is not None and value != other:
            raise ValueError(f"{value} differs from max_tokens {other}; send one of them")
        return value

    @property
    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as render_chat takes them: role, content (a string), name if given."""
        return [m.model_dump(exclude_none=True) for m in self.messages]

    @property
    def requested_max_tokens(self) -> int | None:
        """The client's token limit, None: the server's default (resolve_max_tokens)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"


M = TypeVar("M", bound=BaseModel)


def _validate(model: type[M], data: Any) -> M:
    """The request, or a RequestError naming the first problem and where it is."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = dict(exc.errors(include_url=False)[0])
    loc = tuple(err.get("loc", ()))
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        loc += cause.path
    err["loc"] = (param_name(loc),) if loc else ()
    message, param = validation_message([err])
    raise RequestError(message, param)


def parse_request(data: Any) -> CompletionRequest:
    return _validate(CompletionRequest, data)


def parse_chat_request(data: Any) -> ChatCompletionRequest:
    return _validate(ChatCompletionRequest, data)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int) -> Any:
    """The request body as JSON: at most ``limit`` bytes (413), UTF-8, a JSON object."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise RequestError(f"invalid Content-Length header {declared!r}")
        if int(declared) > limit:
            raise RequestError(
                f"request body is {int(declared)} bytes; the limit is {limit} bytes",
                status=413,
                code="request_too_large",
            )
    body = bytearray()
    async for chunk in request.stream():  # chunked bodies have no Content-Length
        body += chunk
        if len(body) > limit:
            raise RequestError(
                f"request body exceeds the limit of {limit} bytes",
                status=413,
                code="request_too_large",
            )
    if not body:
        raise RequestError("request body is empty; send a JSON object")
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise RequestError(
            f"request body is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})"
        ) from None
    except ValueError as exc:  # NaN / Infinity
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError(f"request body must be a JSON object, got {type(data).__name__}")
    return data
