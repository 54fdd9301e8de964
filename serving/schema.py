"""The HTTP contract of the endpoint: strict pydantic request models, the checks that need the
model (context length, policy knobs), errors in OpenAI's shape, and the response bodies.

Every client error is a 4xx JSON body ``{"error": {"message", "type", "param", "code"}}`` whose
message names the field and the problem: the body is read, size-checked, UTF-8-decoded and
JSON-parsed here (not by FastAPI, whose errors for these cases are generic), then validated
with strict types ("max_tokens": "5" is an error, not 5). Anything unexpected becomes a 500
with the same shape and no traceback.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline import policies
from pipeline.policies import POLICIES, make_policy

log = logging.getLogger("ray.serve")

# A step drafts and verifies on the order of the policy's integer knobs (k, depth, gamma...);
# beyond this a single request could monopolise a replica or exhaust its memory.
MAX_INT_KNOB = 64
MAX_STOP_SEQUENCES = 4  # as OpenAI
DEFAULT_POLICY = "fixed"  # chain of 4: the best greedy speedup in jobs.bench_online
DEFAULT_KNOBS: dict[str, Any] = {"k": 4}


class RequestError(Exception):
    """A request the endpoint refuses, with the HTTP status and the offending field."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = (
            message, param, status, code, kind,
        )  # fmt: skip

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.kind)


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    kind: str = "invalid_request_error",
) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(message, param, code, kind))


def error_body(
    message: str,
    param: str | None = None,
    code: str | None = None,
    kind: str = "invalid_request_error",
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# --- request models -------------------------------------------------------------------------


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
    """``{"policy": name, **knobs}``; the knobs go to pipeline.policies.make_policy."""

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


def _param(loc: tuple) -> str | None:
    if not loc:
        return None
    if loc[0] == "speculation" and len(loc) > 1 and isinstance(loc[1], str):
        return f"speculation.{loc[1]}"
    return str(loc[0])


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One message (OpenAI reports one problem) naming the field, and the field."""
    err = errors[0]
    loc = tuple(err.get("loc", ()))
    if loc and loc[0] in ("body", "query", "path", "header", "cookie"):  # FastAPI's prefixes
        loc = loc[1:]
    param = _param(loc)
    kind = err.get("type", "")
    if kind == "missing":
        return f"'{param}' is required", param
    if kind == "extra_forbidden":
        return f"unsupported field '{param}'", param
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if kind.endswith("_type") or kind in ("model_type", "model_attributes_type"):
        msg = f"{msg}, got {_describe(err.get('input'))}"
    elif "input" in err and kind != "value_error":
        msg = f"{msg}, got {err['input']!r}"
    return f"{param}: {msg}" if param else msg, param


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


# make_policy(name, [artifacts,] **knobs): a knob with one of these names would not reach the
# policy (or would raise TypeError).
_MAKE_POLICY_PARAMS = frozenset(
    p.name for p in inspect.signature(make_policy).parameters.values()
    if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
)  # fmt: skip


def _int_knob_defaults(name: str) -> dict[str, bool]:
    """knob -> whether it is an int knob, from the policy class's dataclass defaults (when it
    is a dataclass; other policies are left to make_policy)."""
    cls = POLICIES.get(name)
    if cls is None or not dataclasses.is_dataclass(cls):
        return {}
    return {f.name: isinstance(f.default, int) and not isinstance(f.default, bool)
            for f in dataclasses.fields(cls)}  # fmt: skip


def build_policy(name: str, knobs: dict[str, Any]):
    """The policy for a request: knob sanity here (types, the step-size bound), then
    make_policy, whose ValueError (unknown name or knob, out of range) becomes a 400."""
    int_knobs = _int_knob_defaults(name)
    for key, value in knobs.items():
        param = f"speculation.{key}"
        if not isinstance(value, bool | int | float | str):
            raise RequestError(
                f"knob '{key}' must be a number, string or boolean, got {_describe(value)}", param
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise RequestError(f"knob '{key}' must be finite, got {value}", param)
        if int_knobs.get(key) and not (isinstance(value, int) and not isinstance(value, bool)):
            raise RequestError(f"knob '{key}' must be an integer, got {_describe(value)}", param)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_INT_KNOB:
            raise RequestError(
                f"knob '{key}' = {value} is too large: integer knobs must be <= {MAX_INT_KNOB} "
                "(one step would draft or verify too many tokens)",
                param,
            )
    reserved = [k for k in knobs if k in _MAKE_POLICY_PARAMS]
    if reserved:  # would bind to make_policy's own parameters, not to the policy
        raise RequestError(f"unknown knob '{reserved[0]}'", f"speculation.{reserved[0]}")
    try:
        return make_policy(name, **knobs)
    except ValueError as exc:
        raise RequestError(str(exc), "speculation") from None
    except Exception as exc:  # e.g. a cost-aware policy's artifacts missing on this server
        log.warning("cannot build policy %r: %s: %s", name, type(exc).__name__, exc)
        raise RequestError(
            f"policy '{name}' is unavailable on this server: {type(exc).__name__}: {exc}",
            "speculation", status=500, kind="server_error",
        ) from None  # fmt: skip


def policy_names() -> list[str]:
    """The names make_policy accepts, for listing (cost-aware ones included when known)."""
    return list(getattr(policies, "POLICY_NAMES", POLICIES))


# --- responses ------------------------------------------------------------------------------

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


# --- error handlers -------------------------------------------------------------------------


class CatchAll:
    """ASGI middleware: an exception escaping a route becomes a logged 500 JSON error (no
    traceback to the client). Starlette's own last-resort handler re-raises after replying."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except TaskCancelledError:
            # Serve's receive() raises this when the client went away (e.g. mid-stream); the
            # generation has been told to stop and there is no one left to answer.
            log.debug("client disconnected: %s %s", scope.get("method"), scope.get("path"))
        except Exception:
            if started:  # a stream is under way: nothing left to send
                raise
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            response = error_response(500, "internal server error", kind="server_error")
            await response(scope, receive, send)


def install_error_handlers(api: FastAPI) -> None:
    @api.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return exc.response()

    @api.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return error_response(400, message, param)

    @api.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(exc.status_code, message)

    api.add_middleware(CatchAll)
