"""Errors in OpenAI's shape: every client error is a 4xx JSON body ``{"error": {"message",
"type", "param", "code"}}`` whose message names the field and the problem; anything
unexpected becomes a logged 500 with the same shape and no traceback."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.decode.policies.knobs import describe

log = logging.getLogger("ray.serve")


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
            message,
            param,
            status,
            code,
            kind,
        )

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


def _param(loc: tuple) -> str | None:
    if not loc:
        return None
    if loc[0] == "speculation" and len(loc) > 1 and isinstance(loc[1], str):
        return f"speculation.{loc[1]}"
    return str(loc[0])


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
        msg = f"{msg}, got {describe(err.get('input'))}"
    elif "input" in err and kind != "value_error":
        msg = f"{msg}, got {err['input']!r}"
    return f"{param}: {msg}" if param else msg, param


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


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that fails validation: a 400 naming the field (both endpoints)."""
    message, param = validation_message(list(exc.errors()))
    return error_response(400, message, param)


def install_error_handlers(api: FastAPI) -> None:
    @api.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return exc.response()

    api.add_exception_handler(RequestValidationError, validation_error)

    @api.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(exc.status_code, message)

    api.add_middleware(CatchAll)
