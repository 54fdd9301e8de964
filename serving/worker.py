"""The replica's decoding thread: the requests in flight advance one engine step at a time,
round robin (each request one step of one of its generations per round, its generations in
turn), so a long request delays an ordinary one by at most one of its (bounded) steps per step
of the ordinary one, instead of by its whole length.

All torch work of a replica runs on this one thread (the models and their caches are not
thread-safe). The thread keeps a heartbeat: the instant the current step began. A step that
runs past ``stall_limit_s`` means the decode loop is stuck (a step's work is bounded by the
server's step limits, so this is a fault, not load); ``stalled()`` reports it and the replica's
health check fails, so Serve replaces the replica. The thread is a daemon: a stuck step never
blocks the process from exiting when Serve stops the replica.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.types import Generation, SamplingConfig

log = logging.getLogger("ray.serve")


@dataclass(eq=False)  # identity: the active list removes this task, not an equal one
class DecodeTask:
    """One generation to run. ``deliver`` is called on the decoding thread with each text
    delta (possibly ""), then with the Generation or the exception that ended it."""

    prompt_ids: list[int]
    policy: Any
    max_tokens: int
    sampling: SamplingConfig
    seed: int
    stops: list[str]
    deadline: float  # time.monotonic() instant: past it the generation ends ("deadline")
    deliver: Callable[[Any], None]
    group: str = ""  # the request it belongs to: one step per request per round
    cancel: threading.Event = field(default_factory=threading.Event)
    steps: Iterator[str] | None = None
    stream: Any = None


class DecodeWorker:
    def __init__(self, engine: SpeculativeEngine, stall_limit_s: float) -> None:
        self.engine = engine
        self.stall_limit_s = stall_limit_s
        self._inbox: deque[DecodeTask] = deque()
        self._wake = threading.Condition()
        self._active: list[DecodeTask] = []
        self._closing = False
        self._step_began: float | None = None  # the heartbeat: None between steps
        self.counts = {"completed": 0, "cancelled": 0, "deadline": 0, "failed": 0}
        self._thread = threading.Thread(target=self._run, name="decode", daemon=True)
        self._thread.start()

    # --- called from the event loop -------------------------------------------------------

    def submit(self, task: DecodeTask) -> None:
        with self._wake:
            if self._closing:
                raise RuntimeError("the replica is shutting down")
            self._inbox.append(task)
            self._wake.notify()

    @property
    def in_flight(self) -> int:
        return len(self._active) + len(self._inbox)

    def stalled(self) -> str | None:
        """Why the decode loop counts as stuck, or None."""
        if not self._thread.is_alive():
            return "the decoding thread has died"
        began = self._step_began
        if began is not None and time.monotonic() - began > self.stall_limit_s:
            return (
                f"one decoding step has run for {time.monotonic() - began:.0f} s "
                f"(limit {self.stall_limit_s:g} s)"
            )
        return None

    def shutdown(self, timeout_s: float) -> bool:
        """Cancel every queued and running generation (each ends at its next step boundary,
        finish reason "cancelled") and wait up to ``timeout_s`` for the thread to drain;
        whether it did."""
        with self._wake:
            self._closing = True
            for task in [*self._inbox, *self._active]:
                task.cancel.set()
            self._wake.notify()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def closing(self) -> bool:
        return self._closing

    # --- the decoding thread --------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._inbox and not self._active:
                    if self._closing:
                        return
                    self._wake.wait()
                self._active.extend(self._inbox)
                self._inbox.clear()
                if self._closing:
                    for task in self._active:
                        task.cancel.set()
                batch, seen = [], set()
                for task in self._active:  # the first in line of each request
                    if task.group not in seen:
                        seen.add(task.group)
                        batch.append(task)
            for task in batch:
                try:
                    alive = self._advance(task)
                except Exception:  # delivering failed (its event loop is gone): drop the task
                    log.exception("dropping a generation whose request cannot be answered")
                    alive = False
                with self._wake:  # to the back of the line: the request's next one goes next
                    self._active.remove(task)
                    if alive:
                        self._active.append(task)

    def _advance(self, task: DecodeTask) -> bool:
        """Run one step of ``task``; False once it has ended (its outcome delivered)."""
        self._step_began = time.monotonic()
        try:
            return advance(self.engine, task, self.counts)
        finally:
            self._step_began = None


def advance(engine: SpeculativeEngine, task: DecodeTask, counts: dict[str, int]) -> bool:
    """Run one step of ``task`` on ``engine``; False once it has ended (its outcome delivered
    and counted in ``counts``)."""
    try:
        if task.steps is None and (task.cancel.is_set() or time.monotonic() >= task.deadline):
            # Ended before it began (client gone, deadline passed while queued, shutdown):
            # no prefill for nobody.
            reason = "cancelled" if task.cancel.is_set() else "deadline"
            counts[reason] += 1
            task.deliver(Generation([], "", reason, []))
            return False
        if task.steps is None:
            task.stream = engine.stream(
                task.prompt_ids,
                task.policy,
                task.max_tokens,
                task.sampling,
                task.seed,
                task.stops,
            )
            task.steps = task.stream.step_deltas(task.cancel.is_set, task.deadline)
        delta = next(task.steps)
    except StopIteration:
        result: Generation = task.stream.result
        reason = result.finish_reason
        counts[reason if reason in ("cancelled", "deadline") else "completed"] += 1
        task.deliver(result)
        return False
    except BaseException as exc:  # handed to the request's coroutine
        counts["failed"] += 1
        log.warning("generation failed: %s: %s", type(exc).__name__, exc)
        task.deliver(exc)
        return False
    task.deliver(delta)
    return True
