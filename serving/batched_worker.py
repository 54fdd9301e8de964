"""The replica's continuous batching: up to ``max_batch`` generations decode together, each
step of each one a part of ONE packed draft or target forward (pipeline.decode.batching).
Generations join at the next forward after they arrive and leave the moment they end. A
generation decodes while it holds a seat: at most ``max_batch`` seats, and the positions the
seated generations may verify per step (their policies' declared step work) stay within
``max_positions`` (one alone always fits), so one step of the batch costs about what the
heaviest request alone would, not that many times over. Beyond that they take turns: at each
step boundary a seated generation gives its seat to a waiting one, the one whose request
holds the fewest seats first, so a request with many choices or huge trees cannot starve
another (as the round robin of serving.worker guarantees). Each
keeps its own policy, draft length, acceptance, cache length, stop strings, token budget,
deadline and cancellation (the batch-1 decode loop, serving.worker.advance, on a thread of
its own).

The decoding thread admits generations and runs the forwards (all torch work on the models
happens there). Its heartbeat is the forward in progress; a forward running past
``stall_limit_s``, or a generation that has waited that long for one, means the loop is stuck
(steps are bounded by the server's step limits): ``stalled()`` says so and the health check
fails, so Serve replaces the replica. A failing forward fails the generations in it, not the
replica.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque

from pipeline.decode.batched import BatchedEngine
from serving.worker import DecodeTask, advance

log = logging.getLogger("ray.serve")


class BatchedDecodeWorker:
    """The same interface as serving.worker.DecodeWorker (submit, in_flight, stalled,
    shutdown, closing, counts), batching across generations."""

    def __init__(
        self, engine: BatchedEngine, stall_limit_s: float, max_batch: int, max_positions: int = 256
    ) -> None:
        self.engine = engine
        self.batcher = engine.batcher
        self.stall_limit_s = stall_limit_s
        self.max_batch = max_batch
        self._inbox: deque[DecodeTask] = deque()
        self._running: set[DecodeTask] = set()
        self._lock = threading.Lock()
        self._closing = False
        self._seats = threading.Condition()
        self._free = max_batch
        self.max_positions = max_positions
        self._positions = 0  # what the seated generations may verify per step
        self._seated: dict[str, int] = {}  # seats held per request
        self._waiters: list[DecodeTask] = []  # in arrival order
        self.counts = {"completed": 0, "cancelled": 0, "deadline": 0, "failed": 0}
        self._thread = threading.Thread(target=self._run, name="decode", daemon=True)
        self._thread.start()

    # --- called from the event loop -------------------------------------------------------

    def submit(self, task: DecodeTask) -> None:
        with self._lock:
            if self._closing:
                raise RuntimeError("the replica is shutting down")
            self._inbox.append(task)

    @property
    def in_flight(self) -> int:
        return len(self._running) + len(self._inbox)

    @property
    def closing(self) -> bool:
        return self._closing

    def stalled(self) -> str | None:
        """Why the decode loop counts as stuck, or None."""
        if not self._thread.is_alive():
            return "the decoding thread has died"
        now = time.monotonic()
        began = self.batcher.forward_began
        if began is not None and now - began > self.stall_limit_s:
            return (
                f"one batched forward has run for {now - began:.0f} s "
                f"(limit {self.stall_limit_s:g} s)"
            )
        stuck = self.batcher.stuck_for()
        if stuck > self.stall_limit_s:
            return (
                f"the batch has made no progress for {stuck:.0f} s (limit {self.stall_limit_s:g} s)"
            )
        return None

    def shutdown(self, timeout_s: float) -> bool:
        """Cancel every queued and running generation (each ends at its next step boundary,
        finish reason "cancelled") and wait up to ``timeout_s`` for them to end."""
        with self._lock:
            self._closing = True
            for task in [*self._inbox, *self._running]:
                task.cancel.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # --- the decoding thread --------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._inbox:
                    task = self._inbox.popleft()
                    if self._closing:
                        task.cancel.set()
                    self._running.add(task)
                    threading.Thread(
                        target=self._drive, args=(task,), name="generation", daemon=True
                    ).start()
                if self._closing and not self._running:
                    return
            if not self.batcher.run_once(timeout_s=0.02) and not self._running:
                time.sleep(0.005)  # idle: nothing to batch, nothing running

    def _drive(self, task: DecodeTask) -> None:
        """One generation's decode loop, its steps joining the batch's forwards while it
        holds a seat; at a step boundary it gives the seat up to a waiting generation."""
        alive = True
        try:
            while alive:
                self._take_seat(task)
                try:
                    with self.batcher.participant():
                        while alive:
                            alive = self._step(task)
                            if alive and self._seat_wanted():
                                break
                finally:
                    self._leave_seat(task)
        except Exception as exc:  # a fault of this worker's own: the request still gets an answer
            log.exception("generation thread failed")
            self.counts["failed"] += 1
            with contextlib.suppress(Exception):
                task.deliver(exc)
        finally:
            with self._lock:
                self._running.discard(task)

    def _step(self, task: DecodeTask) -> bool:
        try:
            return advance(self.engine, task, self.counts)
        except Exception:  # delivering failed (its event loop is gone)
            log.exception("dropping a generation whose request cannot be answered")
            task.cancel.set()
            if task.steps is not None:
                task.steps.close()  # its cache slots go back
            return False

    # --- seats: max_batch generations decode at once, fairly over requests -------------------

    def _next_waiter(self) -> DecodeTask:
        """The waiting generation whose request holds the fewest seats (first come first)."""
        return min(self._waiters, key=lambda t: self._seated.get(t.group, 0))

    def _fits(self, task: DecodeTask) -> bool:
        if self._free <= 0:
            return False
        alone = self._free == self.max_batch
        return alone or self._positions + _positions(task) <= self.max_positions

    def _take_seat(self, task: DecodeTask) -> None:
        with self._seats:
            self._waiters.append(task)
            self._seats.wait_for(lambda: self._next_waiter() is task and self._fits(task))
            self._waiters.remove(task)
            self._free -= 1
            self._positions += _positions(task)
            self._seated[task.group] = self._seated.get(task.group, 0) + 1
            self._seats.notify_all()

    def _seat_wanted(self) -> bool:
        return bool(self._waiters)

    def _leave_seat(self, task: DecodeTask) -> None:
        with self._seats:
            self._free += 1
            self._positions -= _positions(task)
            self._seated[task.group] -= 1
            if not self._seated[task.group]:
                del self._seated[task.group]
            self._seats.notify_all()


def _positions(task: DecodeTask) -> int:
    """The positions one step of the task's policy may verify (its declared step work)."""
    try:
        return max(1, int(task.policy.step_work().verified))
    except Exception:  # no declared work (the registry requires it; a test double may not)
        return 1
