"""The vLLM app's ingress: ray.serve.llm's OpenAI router (``OpenAiIngress``: /v1/models,
/v1/completions, /v1/chat/completions, each request handed to the engine replica of its
``model``) with what the research endpoint has around it: GET /healthz, the optional API key
(serving.auth) and a deadline on every request (vllm_serving.deadline)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException
from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS
from ray.llm._internal.serve.core.ingress.ingress import init as init_router_app
from ray.serve.llm.ingress import OpenAiIngress
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.auth import install_auth, set_api_key
from serving.errors import error_response
from vllm_serving.cancellation import CALLS, TrackedHandle, cancel
from vllm_serving.deadline import FINISH_REASON, deadline_chunk, guarded
from vllm_serving.health import ModelHealth
from vllm_serving.refusals import (
    engine_error,
    install_limits,
    model_limits,
    set_models,
    validation_refusal,
)

# The generation routes (embeddings, scores, audio and tokenizer routes are not served: the
# target is a generator and the research endpoint has none of them).
ROUTES = ("models", "model_data", "completions", "chat")
ENDPOINTS = {name: DEFAULT_ENDPOINTS[name] for name in ROUTES} | {
    "healthz": lambda app: app.get("/healthz"),
}


def router_app() -> FastAPI:
    """ray.serve.llm's FastAPI app (its error handling, CORS, request ids, HTTP metrics) with
    the API key in front, installed before @serve.ingress copies the app."""
    app = init_router_app()

    # ray.serve.llm's own handler answers a body that is not JSON with a 500 (it puts the
    # raw bytes in its reply): a bad body is the client's error, named like the research
    # endpoint names it (vllm_serving.refusals refuses most before vLLM's model parses them).
    app.add_exception_handler(RequestValidationError, validation_refusal)

    # ray.serve.llm raises fastapi's HTTPException (an unknown model: 404, no model named
    # with several served: 400), which FastAPI answers as {"detail": ...}: OpenAI's shape.
    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        response = engine_error(request, exc.status_code, message)
        response.headers.update(exc.headers or {})
        return response

    # vLLM's refusals (its 400s: "max_tokens must be at least 1, ... (parameter=max_tokens,
    # value=-1)") and ray.serve.llm's own (an unknown model card: 404), which its middleware
    # would answer with "Message: ..., Internal exception: ... (Request ID: ...)" and a logged
    # traceback: the client's words, the field as param, one log line.
    @app.exception_handler(OpenAIHTTPException)
    async def _engine(request: Request, exc: OpenAIHTTPException) -> JSONResponse:
        return engine_error(request, exc.status_code, exc.message)

    install_limits(app)  # request limits, inside the key's check (vllm_serving.refusals)
    install_auth(app)
    return app


class SpecboundIngress(OpenAiIngress):
    def __init__(
        self,
        llm_deployments: dict[str, Any],
        model_cards: dict[str, Any],
        *,
        request_timeout_s: float,
        api_key: str | None = None,
        speculation: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        super().__init__(llm_deployments, model_cards, **kwargs)
        set_api_key(api_key)  # the middleware reads the process's key per request
        # Each model's request limits (vllm_serving.limits), checked per request by the
        # middleware and stated in GET /v1/models (metadata.limits of each model).
        limits = model_limits(model_cards, speculation)
        set_models(limits)
        for name, card in self._model_cards.items():
            card.metadata["limits"] = limits[name].describe()
        self.request_timeout_s = request_timeout_s
        self.speculation = speculation or {}
        # Each model id's state from Serve's own status (vllm_serving.health).
        self.health = ModelHealth.of_handles(llm_deployments)

    async def healthz(self) -> JSONResponse:
        """Open (no key): 200 "ok" when every model id has a running engine replica, else 503
        "degraded" with each one's state and why (vllm_serving.health)."""
        return await self.health.healthz(self.speculation)

    async def model(self, model_id: str) -> Any:
        """The model's card (GET /v1/models, /v1/models/{id}) with its state."""
        return await self.health.card(await super().model(model_id))

    def _get_configured_serve_handle(self, model_id: str) -> TrackedHandle:
        return TrackedHandle(super()._get_configured_serve_handle(model_id))

    async def _process_llm_request(self, body: Any, call_method: str, raw_request: Any = None):
        # A model id without a running replica: a 503 saying why, not a wait to the deadline.
        if (refused := await self.health.refusal(getattr(body, "model", None))) is not None:
            return refused
        loop = asyncio.get_running_loop()
        calls: list = []
        CALLS.set(calls)  # this request's task: _get_response calls the engine in it
        ends_at = loop.time() + self.request_timeout_s
        chat = call_method == "chat"
        n = getattr(body, "n", None) or 1
        stream = bool(getattr(body, "stream", False))
        try:
            async with asyncio.timeout_at(ends_at):
                response = await super()._process_llm_request(body, call_method, raw_request)
        except TimeoutError:
            cancel(calls)
            if stream:
                # Nothing came before the deadline: the stream is its closing chunk alone.
                async def closed():
                    yield deadline_chunk(None, chat, n)
                    yield "data: [DONE]\n\n"

                return StreamingResponse(closed(), media_type="text/event-stream")
            return error_response(
                504,
                f"the request passed its deadline of {self.request_timeout_s:g} s before its "
                f"response was complete (finish_reason {FINISH_REASON!r} in a stream): ask for "
                "fewer tokens, or stream",
                code="deadline_exceeded",
                kind="timeout_error",
            )
        if isinstance(response, StreamingResponse):
            response.body_iterator = _cancelled_unless_done(
                guarded(response.body_iterator, ends_at, chat, n), calls, ends_at
            )
        return response


async def _cancelled_unless_done(packets: Any, calls: list, ends_at: float):
    """``packets``; the engine calls cancelled if the stream ended at its deadline or its
    client left (vLLM then aborts the request and stops generating for it)."""
    loop = asyncio.get_running_loop()
    finished = False
    try:
        async for packet in packets:
            yield packet
        finished = loop.time() < ends_at
    finally:
        if not finished:
            cancel(calls)
