"""The engine calls a request makes, and their cancellation: a stream closed early, or a
response awaited past its deadline, leaves its call to the engine replica running, and vLLM
generating to max_tokens for no one, until the call is cancelled (vLLM aborts a cancelled
request). Serve's cancel is best effort: once in a CI run a stream's call was never cancelled
(the replica logged neither CANCELLED nor OK for it, and vLLM went on generating), so each
cancelled call is drained for a grace period and cancelled again while it still yields."""

from __future__ import annotations

import asyncio
import logging
from contextvars import ContextVar
from typing import Any

log = logging.getLogger("ray.serve")

# The engine calls one request made (its own task's context).
CALLS: ContextVar[list | None] = ContextVar("specbound_engine_calls", default=None)

CANCEL_GRACE_S = 2.0  # a cancelled call that still yields after this is cancelled again
CANCEL_TRIES = 3
_CONFIRMING: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks


class TrackedHandle:
    """An engine deployment's handle whose calls are recorded in the request's ``CALLS``."""

    def __init__(self, handle: Any):
        self._handle = handle

    def options(self, **kwargs: Any) -> TrackedHandle:
        return TrackedHandle(self._handle.options(**kwargs))

    def __getattr__(self, name: str) -> _TrackedMethod:
        return _TrackedMethod(getattr(self._handle, name))


class _TrackedMethod:
    def __init__(self, method: Any):
        self._method = method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        response = self._method.remote(*args, **kwargs)
        calls = CALLS.get()
        if calls is not None:
            calls.append(response)
        return response


def cancel(calls: list) -> None:
    """Cancel each call now, and confirm in the background that it ended."""
    loop = asyncio.get_running_loop()
    for call in calls:
        call.cancel()
        task = loop.create_task(confirm_cancelled(call))
        _CONFIRMING.add(task)
        task.add_done_callback(_CONFIRMING.discard)


async def _drain(call: Any) -> None:
    try:
        async for _ in call:
            pass
    except BaseException:  # noqa: BLE001 - cancelled (Serve raises its own error) or failed: ended
        pass


async def confirm_cancelled(
    call: Any, grace_s: float = CANCEL_GRACE_S, tries: int = CANCEL_TRIES
) -> bool:
    """Drain a cancelled ``call`` until it ends; while it still yields after each ``grace_s``,
    cancel it again at the replica (``DeploymentResponse.cancel`` acts once only). Whether it
    ended."""
    drain = asyncio.ensure_future(_drain(call))
    try:
        for attempt in range(tries):
            done, _ = await asyncio.wait({drain}, timeout=grace_s)
            if done:
                return True
            log.warning(
                "engine call %s still running %.0f s after its cancellation: cancelling it "
                "again (%d of %d)",
                getattr(call, "request_id", "?"),
                (attempt + 1) * grace_s,
                attempt + 1,
                tries,
            )
            replica_result = getattr(call, "_replica_result", None)
            if replica_result is not None:
                replica_result.cancel()
        done, _ = await asyncio.wait({drain}, timeout=grace_s)
        return bool(done)
    finally:
        drain.cancel()
