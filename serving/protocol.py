"""The HTTP contract of the endpoint: strict pydantic request models, the request body read
and checked here (size, UTF-8, JSON: FastAPI's errors for these cases are generic), the checks
that need the model (context length), and the response bodies. Strict types: "max_tokens": "5"
is an error, not 5."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

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
from serving.speculation import DEFAULT_KNOBS, DEFAULT_POLICY

MAX_STOP_SEQUENCES = 4  # as OpenAI


def _utf8_encodable(value: str) -> str:
    # JSON may carry lone surrogates ("\ud800"), which no tokenizer can take.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains an unpaired surrogate at index {exc.start}") from exc
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = True  # usage always comes in the final chunk


class Speculation(BaseModel):
    """``{"policy": name, **knobs}``; serving.speculation builds the policy from them."""

    model_config = ConfigDict(strict=True, extra="allow")
    policy: str = DEFAULT_POLICY

    @property
    def knobs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


_NEUTRAL: dict[str, tuple] = {
    "echo": (False,),
    "logprobs": (None,),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logit_bias": (None, {}),
}


class CompletionRequest(BaseModel):
    """POST /v1/completions. Defaults follow OpenAI (max_tokens 16, temperature 1)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    prompt: str
    model: str | None = None
    max_tokens: int = 16
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)  # one completion per request
    user: str | None = None
    # OpenAI fields some clients always send: accepted at their neutral values only.
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    speculation: Speculation | None = None

    @field_validator(*_NEUTRAL)
    @classmethod
    def _neutral(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in _NEUTRAL[info.field_name]:
            raise ValueError("not supported here; leave it at its default")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str) -> str:
        if not value:
            raise ValueError("must not be empty")
        return _utf8_encodable(value)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
        return [_utf8_encodable(s) for s in stops]

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])  # the validator made it a list

    @property
    def speculation_spec(self) -> tuple[str, dict[str, Any]]:
        if self.speculation is None:
            return DEFAULT_POLICY, dict(DEFAULT_KNOBS)
        return self.speculation.policy, self.speculation.knobs


def parse_request(data: Any) -> CompletionRequest:
    try:
        return CompletionRequest.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc.errors(include_url=False))
        raise RequestError(message, param) from None


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
                status=413, code="request_too_large",
            )  # fmt: skip
    body = bytearray()
    async for chunk in request.stream():  # chunked bodies have no Content-Length
        body += chunk
        if len(body) > limit:
            raise RequestError(
                f"request body exceeds the limit of {limit} bytes",
                status=413, code="request_too_large",
            )  # fmt: skip
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


# --- checks that need the model ------------------------------------------------------------


def check_lengths(prompt_tokens: int, max_tokens: int, context: int, max_tokens_limit: int) -> None:
    limit = min(max_tokens_limit, context - 1)
    if max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    if max_tokens > limit:
        raise RequestError(f"max_tokens must be <= {limit}, got {max_tokens}", "max_tokens")
    if prompt_tokens == 0:
        raise RequestError("prompt has no tokens", "prompt")
    if prompt_tokens + max_tokens > context:
        raise RequestError(
            f"prompt is {prompt_tokens} tokens and max_tokens is {max_tokens}: together they "
            f"exceed the context of {context} tokens (at most {context - max_tokens} prompt "
            f"tokens with this max_tokens)",
            "prompt", code="context_length_exceeded",
        )  # fmt: skip


FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    cid: str,
    created: int,
    model: str,
    text: str | None,
    finish_reason: str | None,
    *,
    chunk: bool = False,
    usage: dict | None = None,
    speculation: dict | None = None,
) -> dict:
    """A text_completion object (a stream chunk has the same shape, text being the delta)."""
    body: dict[str, Any] = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "text": text or "",
            "logprobs": None,
            "finish_reason": FINISH_REASONS.get(finish_reason, finish_reason),
        }],
    }  # fmt: skip
    if usage is not None or not chunk:
        body["usage"] = usage
    if speculation is not None:
        body["speculation"] = speculation
    return body


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def now() -> int:
    return int(time.time())
