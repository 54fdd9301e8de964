"""The Ray Serve application: a FastAPI ingress deployment holding one model pair per replica.

    serve run serving.app:app                                   # embedded models, CPU or GPU
    serve run serving.app:build_app target=/ckpt/t draft=/ckpt/d device=cuda num_gpus=1
    serve run serve_config.yaml                                 # GPU cluster, autoscaling

Routes: POST /v1/completions (OpenAI-compatible, plus the ``speculation`` request field and
response statistics), GET /v1/models, GET /healthz. Generation is synchronous torch code: each
request's decoding loop runs on the replica's one decoding thread (so one generation at a time
per model pair, in arrival order) and hands text deltas back to the event loop, which stays
free for health checks, validation and other streams.
"""

# No `from __future__ import annotations`: FastAPI must see the route parameters' real types
# (Serve rebuilds the methods' signatures, and string annotations then fail to resolve).
import asyncio
import concurrent.futures
import logging
import secrets
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application

from pipeline.data.prompts import encode
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.artifacts import PolicyArtifacts, load_artifacts
from pipeline.decode.stats import speculation_stats
from pipeline.decode.types import Generation, SamplingConfig
from pipeline.models.loading import DEFAULT_DRAFT, DEFAULT_TARGET, load_pair
from serving.errors import RequestError, error_body, install_error_handlers
from serving.protocol import (
    CompletionRequest,
    check_lengths,
    completion_body,
    new_completion_id,
    now,
    parse_request,
    read_json,
    sse,
    usage,
)
from serving.speculation import build_policy, policy_names

log = logging.getLogger("ray.serve")

DEPLOYMENT_NAME = "SpecboundServer"


class AppArgs(BaseModel):
    """`serve run serving.app:build_app key=value ...` (or `args:` in a Serve config file)."""

    model_config = ConfigDict(extra="forbid")

    target: str | None = None  # None: the embedded models, resolved on the replica's node
    draft: str | None = None
    device: str = "auto"  # CUDA when the replica has a GPU
    dtype: str = "auto"
    model_name: str = "specbound"  # the id in /v1/models and responses
    max_tokens_limit: int = Field(1024, ge=1)
    max_body_bytes: int = Field(1 << 20, ge=1024)
    num_cpus: float = Field(1.0, ge=0)  # <= 1 on small machines: the proxy needs a core
    num_gpus: float | None = Field(None, ge=0)  # None: 1 if this machine has CUDA, else 0
    max_ongoing_requests: int = Field(8, ge=1)
    # The committed cost model was measured on one device/dtype/experts implementation and
    # checkpoint pair; cost-aware policies refuse other settings unless this is set.
    allow_costmodel_mismatch: bool = False


@dataclass
class Job:
    """A validated request, ready to decode."""

    request: CompletionRequest
    prompt_ids: list[int]
    policy: Any
    policy_name: str
    knobs: dict[str, Any]
    seed: int


api = FastAPI(
    title="specbound",
    description="OpenAI-compatible completions with speculative decoding for MoE targets",
)
install_error_handlers(api)


# The controller notices a dead replica at its next health check (default every 10 s).
@serve.deployment(name=DEPLOYMENT_NAME, ray_actor_options={"num_cpus": 1},
                  max_ongoing_requests=8, health_check_period_s=2)  # fmt: skip
@serve.ingress(api)
class SpecboundServer:
    def __init__(self, args: AppArgs):
        self.args = args
        self.pair = load_pair(args.target or DEFAULT_TARGET, args.draft or DEFAULT_DRAFT,
                              args.device, args.dtype)  # fmt: skip
        self.engine = SpeculativeEngine(self.pair)
        # The cost-aware policies' artifacts, checked against this pair once; if they are
        # missing or were measured elsewhere, those policies answer a 500 naming why (the
        # others keep serving).
        self.artifacts: PolicyArtifacts | None = None
        self.artifacts_error: str | None = None
        try:
            self.artifacts = load_artifacts(device=str(self.pair.device))
            self.artifacts.check_pair(self.pair, args.allow_costmodel_mismatch)
        except (OSError, ValueError) as exc:
            self.artifacts, self.artifacts_error = None, f"{type(exc).__name__}: {exc}"
            log.warning("cost-aware policies unavailable: %s", self.artifacts_error)
        self.tokenizer = self.pair.tokenizer
        self.context = min(
            getattr(m.config, "max_position_embeddings", None) or 1 << 30
            for m in (self.pair.target, self.pair.draft)
        )
        self.created = now()
        # One decoding thread: generations on this model pair run one at a time, FIFO, and the
        # lock makes that explicit should the executor ever grow.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="decode")
        self._lock = threading.Lock()
        self.generations = {"completed": 0, "cancelled": 0, "failed": 0}  # for /healthz
        log.info("specbound replica ready on %s (context %d)", self.pair.device, self.context)

    # --- routes ---------------------------------------------------------------------------

    @api.get("/healthz")
    async def healthz(self) -> dict:
        return {"status": "ok", "model": self.args.model_name, "device": str(self.pair.device),
                "generations": dict(self.generations)}  # fmt: skip

    @api.get("/v1/models")
    async def models(self) -> dict:
        return {
            "object": "list",
            "data": [{
                "id": self.args.model_name,
                "object": "model",
                "created": self.created,
                "owned_by": "specbound",
                "target": self.pair.target_path,
                "draft": self.pair.draft_path,
                "context_length": self.context,
                "policies": policy_names(),
            }],
        }  # fmt: skip

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        data = await read_json(request, self.args.max_body_bytes)
        req = parse_request(data)
        if req.model is not None and req.model != self.args.model_name:
            raise RequestError(
                f"model '{req.model}' does not exist; this server serves "
                f"'{self.args.model_name}'",
                "model", status=404, code="model_not_found",
            )  # fmt: skip
        # Tokenizing a long prompt and loading a policy's artifacts are blocking work.
        job = await asyncio.to_thread(self._prepare, req)
        cid, created = new_completion_id(), now()
        if req.stream:
            return StreamingResponse(
                self._stream(job, cid, created),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        result = None
        async for item in self._decode(job):
            if isinstance(item, Generation):
                result = item
        assert result is not None
        return JSONResponse(completion_body(
            cid, created, self.args.model_name, result.text, result.finish_reason,
            usage=usage(len(job.prompt_ids), len(result.tokens)),
            speculation=speculation_stats(job.policy_name, job.knobs, result.steps),
        ))  # fmt: skip

    # --- internals ------------------------------------------------------------------------

    def _prepare(self, req: CompletionRequest) -> Job:
        ids = encode(self.tokenizer, req.prompt)
        check_lengths(len(ids), req.max_tokens, self.context, self.args.max_tokens_limit)
        name, knobs = req.speculation_spec
        policy = build_policy(name, knobs, self.artifacts, self.artifacts_error)
        # Without a seed every request samples differently (the engine would default to 0).
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        return Job(req, ids, policy, name, knobs, seed)

    async def _decode(self, job: Job) -> AsyncIterator[str | Generation]:
        """Run the job on the decoding thread; yields text deltas, then the Generation. If the
        consumer goes away (client disconnect), the generation stops at the next step."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        req = job.request

        def put(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def work() -> None:
            try:
                with self._lock:
                    gen = self.engine.stream(
                        job.prompt_ids, job.policy, req.max_tokens,
                        SamplingConfig(req.temperature, req.top_p), job.seed, req.stops,
                    )  # fmt: skip
                    for delta in gen.deltas(cancel.is_set):
                        put(delta)
                    if gen.result.finish_reason == "cancelled":
                        log.info("client gone: stopped after %d tokens", len(gen.result.tokens))
                        self.generations["cancelled"] += 1
                    else:
                        self.generations["completed"] += 1
                    put(gen.result)
            except BaseException as exc:  # handed to the request's coroutine
                self.generations["failed"] += 1
                put(exc)

        loop.run_in_executor(self._executor, work)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Generation):
                    return
        finally:
            cancel.set()

    async def _stream(self, job: Job, cid: str, created: int) -> AsyncIterator[str]:
        model = self.args.model_name
        try:
            async for item in self._decode(job):
                if isinstance(item, Generation):
                    yield sse(completion_body(
                        cid, created, model, "", item.finish_reason, chunk=True,
                        usage=usage(len(job.prompt_ids), len(item.tokens)),
                        speculation=speculation_stats(job.policy_name, job.knobs, item.steps),
                    ))  # fmt: skip
                else:
                    yield sse(completion_body(cid, created, model, item, None, chunk=True))
        except Exception:
            # Headers are out: the error goes in the stream, which the openai client raises.
            log.exception("generation failed mid-stream (%s)", cid)
            yield sse(error_body("internal server error during generation", kind="server_error"))
        yield sse("[DONE]")


def build_app(args: dict[str, Any]) -> Application:
    """The application for `serve run serving.app:build_app key=value ...`; values arrive as
    strings from the command line and are validated (and converted) by AppArgs."""
    cfg = AppArgs.model_validate(args)
    if cfg.num_gpus is None:
        cfg.num_gpus = 1.0 if torch.cuda.is_available() else 0.0
    if cfg.num_gpus == 0 and cfg.device == "auto":
        cfg.device = "cpu"  # a replica without a reserved GPU must not use one it can see
    return SpecboundServer.options(
        ray_actor_options={"num_cpus": cfg.num_cpus, "num_gpus": cfg.num_gpus},
        max_ongoing_requests=cfg.max_ongoing_requests,
    ).bind(cfg)


app = build_app({})
