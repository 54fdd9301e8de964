"""The vLLM app's refusals: the ingress's middleware reads the body of each POST to
/v1/completions and /v1/chat/completions and checks it against its model's limits
(vllm_serving.limits) before FastAPI parses it or an engine replica sees it; errors vLLM or
Ray Serve raise are rewritten to the same OpenAI shape (``{"error": {"message", "type",
"param", "code"}}``) in the client's words: no request ids, exception names or internal
module paths. Every client error is one log line (no traceback)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.middleware import Middleware
from starlette.requests import Request

from serving.errors import RequestError, error_response, validation_message
from vllm_serving.limits import ModelLimits, check_request, show

log = logging.getLogger("ray.serve")

ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


# The models this process's ingress serves: the middleware reads them per request (the
# ingress's FastAPI app is built and copied before the replica knows its arguments, like the
# API key, serving.auth).
_models: dict[str, ModelLimits] = {}


def set_models(models: Mapping[str, ModelLimits]) -> None:
    global _models
    _models = dict(models)


def served_models() -> dict[str, ModelLimits]:
    return _models


def model_limits(
    model_cards: Mapping[str, Any], speculation: Mapping[str, Any] | None
) -> dict[str, ModelLimits]:
    """Each model id's limits from ray.serve.llm's model cards (``metadata`` holds the engine's
    max_model_len as ``max_request_context_length``) and the app's speculation per model
    (``{name: {"speculation": ..., "k": ...}}``, vllm_serving.llm_configs.describe)."""
    out = {}
    for name, card in model_cards.items():
        metadata = card.metadata if hasattr(card, "metadata") else card.get("metadata", {})
        length = metadata.get("max_request_context_length")
        if not isinstance(length, int) or length < 1:
            raise ValueError(f"model {name!r}: its card has no max_model_len")
        info = (speculation or {}).get(name) or {}
        out[name] = ModelLimits(
            name, length, str(info.get("speculation", "none")), int(info.get("k", 0))
        )
    return out


def resolve_model(body: Mapping[str, Any], models: Mapping[str, ModelLimits]) -> ModelLimits:
    """The limits of the model the request names (the only one when it names none)."""
    model = body.get("model")
    if model is None:
        if len(models) == 1:
            return next(iter(models.values()))
        raise RequestError(
            f"model is required: this app serves {', '.join(sorted(models))}", "model"
        )
    if not isinstance(model, str):
        raise RequestError(
            f"model must be a string, got {show(model)}", "model", code="invalid_type"
        )
    if model not in models:
        raise RequestError(
            f'the model "{model}" does not exist here; the models are '
            f"{', '.join(sorted(models))} (GET /v1/models)",
            "model",
            status=404,
            code="model_not_found",
            kind="not_found_error",
        )
    return models[model]


def parse_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a RequestError saying what it is instead."""
    if not raw.strip():
        raise _not_an_object("; it is empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_an_object(f"; it is not valid UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        where = f"(line {exc.lineno} column {exc.colno})"
        raise _not_an_object(f"; it is not valid JSON: {exc.msg} {where}") from None
    except ValueError as exc:  # NaN, Infinity
        raise _not_an_object(f"; {exc}") from None
    if not isinstance(data, dict):
        kinds = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
        raise _not_an_object(f", got {kinds.get(type(data), 'a number')}")
    return data


def _not_an_object(why: str) -> RequestError:
    return RequestError(f"the body must be a JSON object{why}", None, code="invalid_json")


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def check_raw(route: str, raw: bytes, models: Mapping[str, ModelLimits]) -> None:
    """The whole check of one POST body to ``route`` ("completions" or "chat")."""
    body = parse_body(raw)
    if not models:  # no ingress in this process set them: vLLM's checks alone
        return
    check_request(route, body, resolve_model(body, models))


# -- errors from vLLM and Ray Serve, in the client's words ---------------------------------

KINDS = {404: "not_found_error", 408: "timeout_error", 429: "rate_limit_error"}
# vLLM's names for the prompt's length (its parameter=...), as the request names it.
PROMPT_PARAMS = {"input_tokens", "input_text", "prompt_embeds"}
# Text that must not reach a client: Ray Serve's wrapping of errors, tracebacks, module paths.
INTERNAL = ("ray.llm._internal", "Traceback", "Internal exception", "original exception", 'File "')
_REQUEST_ID = re.compile(r"\s*\(Request ID: [^)]*\)")
_DETAILS = re.compile(r"\s*\((?:parameter=(?P<param>[^,)]+))?(?:, )?(?P<value>value=.*)?\)\s*$")
_SUBJECT = re.compile(r"^`?([a-z][a-z_]*)`? must ")
_ENV_ADVICE = re.compile(r"\s*To increase this limit, set the \w+ environment variable\.?")


def kind_of(status: int) -> str:
    if status >= 500:
        return "server_error" if status != 504 else "timeout_error"
    return KINDS.get(status, "invalid_request_error")


def clean_message(message: str, chat: bool = False) -> tuple[str, str | None]:
    """vLLM's or Ray Serve's error text as the client's words, and the field it names:
    "max_tokens must be at least 1, got -1. (parameter=max_tokens, value=-1)" becomes
    ("max_tokens must be at least 1, got -1.", "max_tokens"); Ray Serve's "Message: ...,
    Internal exception: ... (Request ID: ...)" wrapping goes, as does advice on the server's
    environment variables."""
    text = str(message).removeprefix("Message: ")
    text = text.split(", Internal exception: ")[0]
    text = _REQUEST_ID.sub("", text).strip()
    text = text.splitlines()[0].strip() if text else ""
    param = None
    details = _DETAILS.search(text)
    if details and (details.group("param") or details.group("value")):
        param = details.group("param")
        text = text[: details.start()].rstrip()
    text = _ENV_ADVICE.sub("", text).strip()
    if param is None and (named := _SUBJECT.match(text)):
        param = named.group(1)  # "temperature must be in [0, 2], got 3.0."
    if param is None and text.startswith("Token id "):
        param = "prompt"  # "Token id 999999 is out of vocabulary" (vLLM names no field)
    if param in PROMPT_PARAMS:
        param = "messages" if chat else "prompt"
    if not text or any(marker in text for marker in INTERNAL):
        text = "the engine refused the request"
    return text, param


def log_client_error(request: Request | None, status: int, message: str, param: str | None):
    """One line per refused request: status, route, field, message (no traceback)."""
    where = f"{request.method} {request.url.path}" if request is not None else "request"
    rid = getattr(request.state, "request_id", None) if request is not None else None
    log.warning(
        "client error %d %s%s: %s%s",
        status,
        where,
        f" ({param})" if param else "",
        message,
        f" [request {rid}]" if rid else "",
    )


def refusal(request: Request | None, exc: RequestError) -> JSONResponse:
    log_client_error(request, exc.status, exc.message, exc.param)
    return exc.response()


def engine_error(
    request: Request | None, status: int, message: str, code: str | None = None
) -> JSONResponse:
    """An error vLLM or Ray Serve raised (OpenAIHTTPException, HTTPException), in OpenAI's
    shape and the client's words; logged as one line when it is the client's."""
    chat = request is not None and request.url.path.endswith("/chat/completions")
    text, param = clean_message(message, chat)
    if status >= 500:
        log.error("server error %d: %s", status, message)
    else:
        log_client_error(request, status, text, param)
    return error_response(status, text, param, code, kind_of(status))


async def validation_refusal(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body vLLM's request model refuses (FastAPI's validation): a 400 naming the field."""
    message, param = validation_message(list(exc.errors()))
    text, named = clean_message(message, request.url.path.endswith("/chat/completions"))
    return refusal(request, RequestError(text, param or named))


# -- the middleware -------------------------------------------------------------------------


class RequestLimits:
    """ASGI middleware: the body of each POST to a generation route is read, checked against
    its model's limits (``served_models``) and handed on unchanged; a refused one is answered
    here, before FastAPI parses it or an engine replica sees it."""

    def __init__(self, app: Any, models: Any = served_models):
        self.app = app
        self.models = models

    async def __call__(self, scope, receive, send) -> None:
        route = _route(scope)
        if route is None:
            return await self.app(scope, receive, send)
        models = self.models()
        limit = max((m.max_body_bytes for m in models.values()), default=64 << 20)
        request = Request(scope)
        try:
            raw = await _read_body(scope, receive, limit)
            if raw is None:  # the client left
                return
            check_raw(route, raw, models)
        except RequestError as exc:
            await refusal(request, exc)(scope, receive, send)
            return
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()  # a disconnect, later

        await self.app(scope, replay, send)


def _route(scope) -> str | None:
    if scope["type"] != "http" or scope.get("method") != "POST":
        return None
    path = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :] or "/"
    return ROUTES.get(path.rstrip("/") or "/")


async def _read_body(scope, receive, limit: int) -> bytes | None:
    declared = next((v for k, v in scope.get("headers", []) if k == b"content-length"), None)
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if len(body) > limit:
            raise _too_large(None, limit)
        if not message.get("more_body", False):
            return bytes(body)


def _too_large(size: int | None, limit: int) -> RequestError:
    said = f"is {size} bytes" if size is not None else "is larger"
    return RequestError(
        f"the body {said}; the limit is {limit} bytes (max_body_bytes)",
        None,
        status=413,
        code="request_too_large",
    )


def install_limits(app: FastAPI) -> None:
    """RequestLimits as the innermost middleware: inside ray.serve.llm's request ids, HTTP
    metrics and CORS (a refusal has them too) and the API key (checked first). Before
    @serve.ingress copies the app."""
    app.user_middleware.append(Middleware(RequestLimits))
