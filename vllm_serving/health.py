"""What the vLLM app tells about itself: each model id's state read from Serve's own status
(its controller's deployment statuses and the engine replicas' placement groups), and the
placement check of the app builder (vllm_serving.placement).

States of a model id (its engine deployment):

    running        at least one engine replica RUNNING: requests are served
    starting       replicas placed and starting (vLLM loads the models)
    not_placeable  a replica's placement group waits for resources no node has free
    failed         Serve gave up on the deployment (DEPLOY_FAILED, UNHEALTHY), with its message
    unavailable    no replica at all (the deployment is being deleted or not deployed)
    unknown        Serve's status could not be read (requests are passed on, not refused)

``/healthz`` is 200 ``{"status": "ok"}`` only when every model id is running, else 503 with
``"degraded"`` (or ``"unknown"``) and each model's state and reason; ``/v1/models`` carries the
same under each card's ``metadata.serving``. A request for a model id that is not running (and
not unknown) is answered at once with a 503 in OpenAI's error shape naming the model and why,
instead of waiting in Serve's router until its deadline.

The builder refuses an app whose engine replicas the cluster cannot hold at their minimum
count (``placement_problem``; the demand is ``vllm_serving.run.engine_demand``'s), judged by
``capacity_of``: the cluster's nodes now, or the most its autoscaler's node types add up to.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from serving.errors import error_response

log = logging.getLogger("ray.serve")

RUNNING, STARTING, NOT_PLACEABLE, FAILED, UNAVAILABLE, UNKNOWN = (
    "running",
    "starting",
    "not_placeable",
    "failed",
    "unavailable",
    "unknown",
)
# Serve's replica states of a replica on its way up.
_COMING_UP = ("STARTING", "UPDATING", "RECOVERING")
# Serve names an engine replica's placement group by the replica's full id.
_REPLICA_PREFIX = "SERVE_REPLICA::"

TTL_S = 1.0  # a read of Serve's status younger than this is reused
STALE_S = 5.0  # a "running" read older than this is refreshed before a request relies on it
CONFIRM_S = 0.25  # a refusal rests on a read at most this old (a model just up is not refused)
READ_TIMEOUT_S = 0.75  # a request never waits longer than this for a read


@dataclass(frozen=True)
class ModelState:
    state: str
    running_replicas: int = 0
    reason: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "running_replicas": self.running_replicas,
            "reason": self.reason,
        }


def _value(x: Any) -> str:
    """An enum's value or a string as it is."""
    return str(getattr(x, "value", x))


def _resources(amounts: dict[str, float]) -> str:
    """{"CPU": 1.0, "GPU": 0.0} -> "CPU 1" (Ray's node:... and memory entries left out)."""
    shown = [
        f"{name} {amount:g}"
        for name, amount in amounts.items()
        if amount and not name.startswith("node:") and "memory" not in name
    ]
    return ", ".join(shown) or "nothing"


def _short(message: str, limit: int = 400) -> str:
    """Serve's message in one line: a traceback's first and last lines."""
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    if not lines:
        return ""
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def classify(
    deployment: Any | None,
    pending_bundles: list[dict[str, float]] | None = None,
    available: dict[str, float] | None = None,
    total: dict[str, float] | None = None,
) -> ModelState:
    """One model id's state from its engine deployment's status in ``serve.status()`` (a
    ``DeploymentStatusOverview``: status, replica_states, message; None: not in the app) and
    the bundles of its replicas' placement groups still PENDING (each replica's first bundle)."""
    if deployment is None:
        return ModelState(UNAVAILABLE, 0, "the engine deployment is not in Serve's status")
    counts = {_value(state): n for state, n in (deployment.replica_states or {}).items()}
    running = counts.get("RUNNING", 0)
    if running:
        return ModelState(RUNNING, running)
    status = _value(deployment.status)
    serve_says = _short(deployment.message)
    if status in ("DEPLOY_FAILED", "UNHEALTHY"):
        return ModelState(FAILED, 0, f"Serve reports {status}: {serve_says or 'no message'}")
    if pending_bundles:
        asked = {k: v for k, v in pending_bundles[0].items() if v}
        need = _resources(asked)
        free = ", ".join(f"{k} {(available or {}).get(k, 0.0):g}" for k in asked)
        of = ", ".join(f"{k} {(total or {}).get(k, 0.0):g}" for k in asked)
        n = len(pending_bundles)
        return ModelState(
            NOT_PLACEABLE,
            0,
            f"{n} engine replica{'s' if n > 1 else ''} cannot be placed now: each needs {need}, "
            f"the cluster has {free} free of {of}",
        )
    starting = sum(counts.get(s, 0) for s in _COMING_UP)
    if starting:
        reason = f"{starting} engine replica{'s' if starting > 1 else ''} starting"
        return ModelState(STARTING, 0, reason + (f" (Serve: {serve_says})" if serve_says else ""))
    states = ", ".join(f"{k} {v}" for k, v in counts.items() if v) or "none"
    return ModelState(UNAVAILABLE, 0, f"no engine replica coming up (replicas: {states})")


def read_serve(app: str, deployments: dict[str, str]) -> dict[str, ModelState]:
    """Each model id's state (``deployments``: model id -> its engine deployment's name in
    ``app``), read from the Serve controller and the GCS. Blocking: run it off the loop."""
    import ray
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None:
        reason = f"Serve has no application {app!r}"
        return {model: ModelState(UNKNOWN, 0, reason) for model in deployments}
    overviews = {m: status.deployments.get(d) for m, d in deployments.items()}
    states = {model: classify(overview) for model, overview in overviews.items()}
    down = [m for m, state in states.items() if state.state in (STARTING, UNAVAILABLE)]
    pending: dict[str, list[dict[str, float]]] = {}
    if down and any(overviews[m] is not None for m in down):
        from ray.util import placement_group_table

        for group in placement_group_table().values():
            name = group.get("name") or ""
            if group.get("state") not in ("PENDING", "RESCHEDULING"):
                continue
            for model in down:
                if name.startswith(f"{_REPLICA_PREFIX}{app}#{deployments[model]}#"):
                    bundles = group.get("bundles") or {}
                    pending.setdefault(model, []).append(bundles.get(0, {}) or {})
    if pending:
        available, total = ray.available_resources(), ray.cluster_resources()
        for model, bundles in pending.items():
            states[model] = classify(overviews[model], bundles, available, total)
    return states


@dataclass
class Snapshot:
    states: dict[str, ModelState]
    at: float  # monotonic time of the read


@dataclass
class ModelHealth:
    """The model ids' states, read from Serve when the last read is older than ``TTL_S``
    (``CONFIRM_S`` before a refusal) and shared by every request: one read in flight at a
    time, off the event loop."""

    models: list[str]
    read: Callable[[], dict[str, ModelState]]
    clock: Callable[[], float] = time.monotonic
    timeout_s: float = READ_TIMEOUT_S
    _snapshot: Snapshot | None = None
    _reading: asyncio.Task | None = field(default=None, repr=False)

    @classmethod
    def of_handles(cls, handles: dict[str, Any]) -> ModelHealth:
        """From the ingress's engine deployment handles (model id -> DeploymentHandle)."""
        apps = {h.app_name for h in handles.values()}
        app = apps.pop() if len(apps) == 1 else ""
        deployments = {model: h.deployment_name for model, h in handles.items()}
        return cls(list(handles), lambda: read_serve(app, deployments))

    def _read_now(self) -> dict[str, ModelState]:
        try:
            return self.read()
        except Exception as exc:  # the monitor failing must not take requests down
            log.warning("could not read Serve's status: %r", exc)
            reason = f"Serve's status could not be read: {exc!r}"[:300]
            return {model: ModelState(UNKNOWN, 0, reason) for model in self.models}

    def _start_read(self) -> asyncio.Task:
        """The read in flight, or a new one."""
        if self._reading is None or self._reading.done():
            started = self.clock()

            async def reading() -> Snapshot:
                states = await asyncio.to_thread(self._read_now)
                self._snapshot = Snapshot(states, started)
                return self._snapshot

            self._reading = asyncio.get_running_loop().create_task(reading())
        return self._reading

    async def _refresh(self) -> Snapshot:
        """A new read (joining the one in flight), or the last one if it takes too long."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._start_read()), self.timeout_s)
        except TimeoutError:
            if self._snapshot is not None:
                return self._snapshot
            reason = f"Serve's status did not answer within {self.timeout_s:g} s"
            return Snapshot({m: ModelState(UNKNOWN, 0, reason) for m in self.models}, self.clock())

    async def snapshot(self, max_age_s: float = TTL_S) -> Snapshot:
        snap = self._snapshot
        if snap is not None and self.clock() - snap.at <= max_age_s:
            return snap
        return await self._refresh()

    async def states(self) -> dict[str, ModelState]:
        return (await self.snapshot()).states

    def _resolve(self, model: str | None) -> str | None:
        if model is None:
            return self.models[0] if len(self.models) == 1 else None
        return model if model in self.models else None

    async def refusal(self, model: str | None) -> JSONResponse | None:
        """A 503 for a request to a model id without a running replica, or None (served:
        running, unknown, or a model id the router itself answers, such as an unknown one)."""
        model = self._resolve(model)
        if model is None:
            return None
        snap, waited = self._snapshot, False
        if snap is None or self.clock() - snap.at > STALE_S:
            snap, waited = await self._refresh(), True
        elif self.clock() - snap.at > TTL_S:
            self._start_read()  # for the requests after this one
        state = snap.states.get(model)
        refused = state is not None and state.state not in (RUNNING, UNKNOWN)
        if refused and not waited and self.clock() - snap.at > CONFIRM_S:
            snap = await self._refresh()  # at most one wait per request
            state = snap.states.get(model)
        if state is None or state.state in (RUNNING, UNKNOWN):
            return None
        response = error_response(
            503,
            f"model {model!r} has no running replica ({state.state}): {state.reason}",
            param="model",
            code=f"model_{state.state}",
            kind="server_error",
        )
        if state.state == STARTING:
            response.headers["Retry-After"] = "10"
        return response

    async def healthz(self, speculation: dict[str, Any]) -> JSONResponse:
        """200 ``ok`` when every model id has a running replica; else 503 ``degraded`` (or
        ``unknown`` when Serve's status cannot be read), each model's state and reason."""
        states = await self.states()
        models = {
            model: {**speculation.get(model, {}), **states[model].as_dict()}
            for model in self.models
        }
        kinds = {s.state for s in states.values()}
        status = "ok" if kinds == {RUNNING} else "unknown" if UNKNOWN in kinds else "degraded"
        body = {"status": status, "models": models}
        return JSONResponse(status_code=200 if status == "ok" else 503, content=body)

    async def card(self, card: Any) -> Any:
        """A /v1/models card with the model's state under ``metadata.serving``."""
        if card is None or card.id not in self.models:
            return card
        state = (await self.states())[card.id]
        return card.model_copy(update={"metadata": {**card.metadata, "serving": state.as_dict()}})
