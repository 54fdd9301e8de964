"""The forward batcher of continuous batching: many generations, one packed forward per model.

Every generation in the batch runs its own decode loop (engine, policy, acceptance: the same
code as at batch 1) on its own thread. Where that code would call a model, it submits the
tokens to the batcher and waits. Once every generation in the batch is waiting, the batcher
runs ONE forward for them all: the draft's if any of them waits on the draft (so that a
generation still drafting catches up and all verify together), else the target's; but a
generation waiting to verify waits for at most MAX_TARGET_WAIT draft forwards, so that one
generation's deep tree cannot hold every other one's steps to its depth. Each
generation's tokens sit in its own block of a shared slot cache (pipeline.models.slots), so
generations join and leave at any step, and each keeps its own draft length, acceptance and
cache length. A target forward's record (positions, the union of experts over every
generation's positions, contexts, time) is what a batch cost model is fitted on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.models.loading import ModelPair
from pipeline.models.routing import RoutingCapture
from pipeline.models.slots import SlotCache, segmented_attention
from pipeline.models.timing import timed

# Draft forwards a verification waits for before the target runs for it anyway: above every
# usual draft length (chains <= 12, trees a few levels), far below the deepest tree the step
# limits allow (52 levels), whose every level would otherwise delay the others' steps.
MAX_TARGET_WAIT = 16


@dataclass(eq=False)
class ForwardRequest:
    """One generation's part of a packed forward."""

    side: str  # "draft" or "target"
    row: int  # its block in that side's slot cache
    ids: list[int]
    visible: torch.Tensor | None  # [n, length + n] bool; None: causal
    positions: list[int] | None  # None: length .. length + n - 1
    routing: bool = False
    prefill: bool = False  # a prompt's prefill, not a step (batch cost fits leave these out)
    begin: bool = False  # a step's first draft forward (its catch-up)
    # Set by the batcher:
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    experts: torch.Tensor | None = None  # [n, layers, top_k] when ``routing``
    t_ms: float = 0.0  # the packed forward's time
    passed: int = 0  # forwards of the other side run while this one waited
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class BatchRecord:
    """One packed forward: what a batch cost model (pipeline.cost.batch) prices."""

    side: str
    rows: int
    positions: int  # tokens fed
    union: list[int]  # target: unique experts per MoE layer over every position of the pass
    context: int  # cached positions summed over the rows
    prefills: int  # rows feeding a prompt (not a step)
    t_ms: float
    gap_ms: float = 0.0  # since the previous forward ended: the generations' own work
    begins: int = 0  # draft rows starting a step (their gap holds the step's bookkeeping)
    attended: int = 0  # sum over rows of positions fed x positions cached (attention work)


class ForwardBatcher:
    """Packed forwards for the generations of a batch (see the module docstring).

    Generation threads call ``participant()`` around the part of their decode that is in the
    batch and ``forward()`` for each model call; one thread (the replica's decoding thread)
    calls ``run_once()`` in a loop."""

    def __init__(self, pair: ModelPair, max_records: int = 4096) -> None:
        self.pair = pair
        self.caches = {
            "draft": SlotCache(pair.draft.config.num_hidden_layers),
            "target": SlotCache(pair.target.config.num_hidden_layers),
        }
        self._lock = threading.Condition()
        self._cache_lock = threading.Lock()  # cache layout: forwards vs rollbacks
        self._participants = 0
        self._pending: list[ForwardRequest] = []
        self.forward_began: float | None = None  # the heartbeat: None between forwards
        self.last_progress = time.monotonic()  # a forward ended or a generation joined
        self._last_end = self.last_progress
        self.records: list[BatchRecord] = []
        self.max_records = max_records
        self.economy = None  # a BatchEconomy, set by the first policy that prices the batch
        self.economy_lock = threading.Lock()

    # --- generation threads -------------------------------------------------------------

    @contextmanager
    def participant(self) -> Iterator[None]:
        """Around one generation's decode: the batcher waits for it before each forward."""
        with self._lock:
            self._participants += 1
            self.last_progress = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._participants -= 1
                self._lock.notify_all()

    def forward(self, req: ForwardRequest) -> ForwardRequest:
        with self._lock:
            self._pending.append(req)
            self._lock.notify_all()
        req.done.wait()
        if req.error is not None:
            raise req.error
        return req

    def acquire(self, side: str) -> int:
        with self._cache_lock:
            return self.caches[side].acquire()

    def release(self, side: str, row: int) -> None:
        with self._cache_lock:
            self.caches[side].release(row)

    def length(self, side: str, row: int) -> int:
        return self.caches[side].length[row]

    def crop(self, side: str, row: int, length: int) -> None:
        with self._cache_lock:
            cache = self.caches[side]
            if length > cache.length[row]:
                raise ValueError(f"cannot crop {cache.length[row]} positions to {length}")
            cache.length[row] = length

    def keep(self, side: str, row: int, base: int, extra: list[int]) -> None:
        with self._cache_lock:
            self.caches[side].keep(row, base, extra)

    # --- the decoding thread ------------------------------------------------------------

    @property
    def participants(self) -> int:
        return self._participants

    def stuck_for(self) -> float:
        """Seconds the batch has made no progress although generations are in it: no
        forward ended since one joined or since the last forward (0 with none in it). A
        generation's own work between forwards is bounded, so this growing means one is stuck
        (in a forward, or in its policy) and holds up the batch."""
        if not self._participants and not self._pending:
            return 0.0
        return time.monotonic() - self.last_progress

    def run_once(self, timeout_s: float = 0.05) -> bool:
        """Wait (up to ``timeout_s``) until every participant waits, then run one packed
        forward; whether one ran."""
        with self._lock:
            ready = self._lock.wait_for(
                lambda: self._pending and len(self._pending) >= self._participants, timeout_s
            )
            if not ready:
                return False
            side = self._next_side()
            batch = [r for r in self._pending if r.side == side]
            self._pending = [r for r in self._pending if r.side != side]
            for req in self._pending:
                req.passed += 1
        self.forward_began = time.monotonic()
        gap_ms = (self.forward_began - self._last_end) * 1e3
        try:
            self._run(side, batch, gap_ms)
        except BaseException as exc:  # every request of this forward fails, not the replica
            for req in batch:
                req.error = exc
        finally:
            self.forward_began = None
            self.last_progress = self._last_end = time.monotonic()
            for req in batch:
                req.done.set()
        return True

    def _next_side(self) -> str:
        """The draft while any generation drafts, unless a verification has waited
        MAX_TARGET_WAIT draft forwards."""
        starved = any(r.side == "target" and r.passed >= MAX_TARGET_WAIT for r in self._pending)
        drafting = any(r.side == "draft" for r in self._pending)
        return "draft" if drafting and not starved else "target"

    @torch.no_grad()
    def _run(self, side: str, batch: list[ForwardRequest], gap_ms: float) -> None:
        pair, cache = self.pair, self.caches[side]
        model = pair.draft if side == "draft" else pair.target
        with self._cache_lock:
            starts = [cache.length[r.row] for r in batch]
            mask = cache.plan(
                [(r.row, len(r.ids), r.visible) for r in batch], model.dtype, pair.device
            )
            positions = []
            for req, start in zip(batch, starts, strict=True):
                positions += req.positions or list(range(start, start + len(req.ids)))
            ids = torch.tensor([[t for r in batch for t in r.ids]], device=pair.device)
            pos = torch.tensor([positions], device=pair.device)

            def run():
                kw = {
                    "past_key_values": cache,
                    "use_cache": True,
                    "attention_mask": mask,
                    "position_ids": pos,
                }
                with segmented_attention(model, cache):
                    if side == "draft":
                        return model(ids, output_hidden_states=True, **kw), None
                    with RoutingCapture(model, pair.spec) as capture:
                        out = model(ids, **kw)
                        return out, capture.take(1, ids.shape[1])[0]

            (out, routing), t_ms = timed(pair.device, run)
        q = 0
        for req in batch:
            n = len(req.ids)
            req.logits = out.logits[0, q : q + n]
            if side == "draft":
                req.hidden = out.hidden_states[-1][0, q : q + n]
            elif req.routing:
                req.experts = routing[q : q + n]
            req.t_ms = t_ms
            q += n
        union: list[int] = []
        if side == "target":
            r = routing.cpu().numpy()
            union = [len(np.unique(r[:, layer])) for layer in range(r.shape[1])]
        attended = sum(len(r.ids) * s for r, s in zip(batch, starts, strict=True))
        record = BatchRecord(
            side,
            len(batch),
            int(ids.shape[1]),
            union,
            sum(starts),
            sum(req.prefill for req in batch),
            t_ms,
            gap_ms,
            sum(req.begin for req in batch),
            attended,
        )
        self.records.append(record)
        if self.economy is not None:
            self.economy.observe(record)
        if len(self.records) > self.max_records:
            del self.records[: len(self.records) - self.max_records]
