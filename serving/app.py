"""The Ray Serve application: a FastAPI ingress deployment holding one model pair per replica.

    serve run serving.app:app                                   # embedded models, CPU or GPU
    serve run serving.app:build_app target=/ckpt/t draft=/ckpt/d device=cuda num_gpus=1
    serve run serve_config.yaml                                 # GPU cluster, autoscaling

Routes: POST /v1/completions and POST /v1/chat/completions (OpenAI-compatible, plus the
``speculation`` request field and response statistics), GET /v1/models, GET /healthz.
The generations in flight decode together, continuously batched (serving.batched_worker: each
step of each one a part of one packed forward per model; ``max_batch`` at a time), or with
``max_batch=1`` one engine step at a time round robin (serving.worker); all model work runs on
the replica's decoding thread, and the event loop stays free for health checks, validation
and streams. What bounds one request: the step limits (jointly over a
policy's knobs), max_tokens, the number of choices, and a deadline.
"""

# No `from __future__ import annotations`: FastAPI must see the route parameters' real types
# (Serve rebuilds the methods' signatures, and string annotations then fail to resolve).
import asyncio
import importlib
import logging
import time
from typing import Any

import psutil
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve import Application

from pipeline.acceptance.native_reads import native_reads
from pipeline.decode.batched import BatchedEngine
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.heap import freeze_startup_heap
from pipeline.decode.policies.artifacts import (
    PolicyArtifacts,
    artifacts_beside,
    load_pair_artifacts,
)
from pipeline.models.loading import DEFAULT_DRAFT, DEFAULT_TARGET, load_pair
from serving import generation
from serving.auth import install_auth, set_api_key
from serving.batched_worker import BatchedDecodeWorker
from serving.errors import RequestError, install_error_handlers
from serving.generation import Job
from serving.metrics import ServingMetrics
from serving.prepare import prepare_job
from serving.protocol import parse_chat_request, parse_request, read_json
from serving.responses import now
from serving.settings import AppArgs
from serving.speculation import default_spec, policy_labels, policy_names
from serving.worker import DecodeWorker

log = logging.getLogger("ray.serve")

DEPLOYMENT_NAME = "SpecboundServer"


api = FastAPI(
    title="specbound",
    description="OpenAI-compatible completions with speculative decoding for MoE targets",
)
install_error_handlers(api)
# Before @serve.ingress freezes a copy of `api`: the key is read per request from what the
# replica's __init__ sets (set_api_key).
install_auth(api)


# The controller notices a dead or stalled replica at its next health check.
@serve.deployment(
    name=DEPLOYMENT_NAME,
    ray_actor_options={"num_cpus": 1},
    max_ongoing_requests=8,
    health_check_period_s=2,
)
@serve.ingress(api)
class SpecboundServer:
    def __init__(self, args: AppArgs):
        self.args = args
        set_api_key(args.api_key)
        for module in args.policy_modules:
            importlib.import_module(module)
        self.pair = load_pair(
            args.target or DEFAULT_TARGET,
            args.draft or DEFAULT_DRAFT,
            args.device,
            args.dtype,
            args.experts_implementation,
        )
        self.limits = args.step_limits()
        self.engine = (
            BatchedEngine(self.pair, self.limits)
            if args.max_batch > 1
            else SpeculativeEngine(self.pair, self.limits)
        )
        # The cost-aware policies' artifacts, checked against this pair once; if they are
        # missing or were measured elsewhere, those policies answer a 500 naming why (the
        # others keep serving).
        self.tokenizer = self.pair.tokenizer
        self.artifacts: PolicyArtifacts | None = None
        self.artifacts_error: str | None = None
        try:
            self.artifacts = load_pair_artifacts(
                args.artifacts or artifacts_beside(args.draft), str(self.pair.device)
            )
            self.artifacts.check_pair(self.pair, args.allow_costmodel_mismatch)
        except (OSError, ValueError) as exc:
            self.artifacts, self.artifacts_error = None, f"{type(exc).__name__}: {exc}"
            log.warning("cost-aware policies unavailable: %s", self.artifacts_error)
        if self.artifacts is not None and self.artifacts.acceptance is None:
            log.warning(
                "no acceptance model (models/acceptance.json): throughput and specdec "
                "are unavailable, requests without a policy get %s",
                default_spec(None),
            )
        self.vocab = min(
            len(self.tokenizer),
            self.pair.target.config.vocab_size,
            self.pair.draft.config.vocab_size,
        )
        self.context = min(
            getattr(m.config, "max_position_embeddings", None) or 1 << 30
            for m in (self.pair.target, self.pair.draft)
        )
        self.created = now()
        self.worker = (
            BatchedDecodeWorker(
                self.engine, args.stall_timeout_s, args.max_batch, args.max_batch_positions
            )
            if args.max_batch > 1
            else DecodeWorker(self.engine, args.stall_timeout_s)
        )
        self.metrics = ServingMetrics()
        # throughput's compiled reads: built now (about 0.2 s), not in a request.
        if self.pair.device.type == "cpu":
            native_reads()  # (it logs why when they cannot be built)
        freeze_startup_heap()  # no request waits on a collection of the loaded libraries
        log.info("specbound replica ready on %s (context %d)", self.pair.device, self.context)

    def check_health(self) -> None:
        """Serve's health check: a stuck decode loop makes Serve replace this replica."""
        why = self.worker.stalled()
        self.metrics.stalled(why is not None)
        self.metrics.queue(self.worker.in_flight)
        if why:
            raise RuntimeError(f"decode loop stalled: {why}")

    def __del__(self) -> None:
        # Serve has drained what it could; whatever still runs is cancelled now.
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.close()
        worker = getattr(self, "worker", None)
        if worker is not None and not worker.shutdown(self.args.shutdown_timeout_s):
            log.warning(
                "decoding thread still busy after %ss; exiting anyway", self.args.shutdown_timeout_s
            )

    # --- routes ---------------------------------------------------------------------------

    @api.get("/healthz")
    async def healthz(self) -> JSONResponse:
        why = self.worker.stalled()
        body = {
            "status": "stalled" if why else "ok",
            "model": self.args.model_name,
            "device": str(self.pair.device),
            "in_flight": self.worker.in_flight,
            "rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
            "generations": dict(self.worker.counts),
        }
        if why:
            body["error"] = why
        return JSONResponse(body, status_code=503 if why else 200)

    @api.get("/v1/models")
    async def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.args.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "specbound",
                    "target": self.pair.target_path,
                    "draft": self.pair.draft_path,
                    "context_length": self.context,
                    "policies": policy_names(),
                    "policy_labels": policy_labels(),
                }
            ],
        }

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, "completion")

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve(request, "chat")

    # --- internals ------------------------------------------------------------------------

    async def _serve(self, request: Request, kind: str):
        arrived = time.monotonic()
        route = "chat" if kind == "chat" else "completions"
        status, streaming = 499, False  # 499 unless answered: the client went away
        try:
            data = await read_json(request, self.args.max_body_bytes)
            req = parse_chat_request(data) if kind == "chat" else parse_request(data)
            if req.model is not None and req.model != self.args.model_name:
                raise RequestError(
                    f"model '{req.model}' does not exist; this server serves "
                    f"'{self.args.model_name}'",
                    "model",
                    status=404,
                    code="model_not_found",
                )
            # Tokenizing long prompts and building a policy are blocking work.
            job = await asyncio.to_thread(self._prepare, req, kind, arrived)
            if req.stream:
                streaming = True  # the stream records its own outcome when it ends
                return StreamingResponse(
                    generation.stream(self.worker, job, self._finished(job, route, arrived)),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            body, results = await generation.respond(self.worker, job)
            status = 200
            self._finished(job, None, arrived)(results, status)
            return JSONResponse(body)
        except RequestError as exc:
            status = exc.status
            raise
        except Exception:
            status = 500
            raise
        finally:
            if not streaming:
                self.metrics.request(route, status, time.monotonic() - arrived)

    def _finished(self, job: Job, route: str | None, arrived: float):
        """What records a request's generations (and, with ``route``, the request itself:
        a stream's status and latency are known only when it ends)."""

        def record(results: dict, status: int) -> None:
            if route is not None:
                self.metrics.request(route, status, time.monotonic() - arrived)
            ttft = None if job.first_text_at is None else job.first_text_at - arrived
            prompts = {c.index: len(c.prompt_ids) for c in job.choices}
            for index, result in results.items():
                self.metrics.generation(
                    job.policy_name,
                    result.steps,
                    prompts[index],
                    len(result.tokens),
                    result.finish_reason,
                    ttft,
                )
                ttft = None  # once per request

        return record

    def _prepare(self, req: Any, kind: str, arrived: float) -> Job:
        return prepare_job(
            req,
            kind,
            arrived,
            self.tokenizer,
            self.vocab,
            self.context,
            self.args,
            self.limits,
            self.artifacts,
            self.artifacts_error,
        )


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
        # Serve drains in-flight requests (each ends by its deadline), then __del__ cancels
        # what is left; past this Serve kills the replica.
        graceful_shutdown_timeout_s=cfg.request_timeout_s + cfg.shutdown_timeout_s,
    ).bind(cfg)


app = build_app({})
