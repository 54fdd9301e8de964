"""The catch-up drafter's counters (pipeline.vllm_spec.catch_up_draft), shared with whoever
started the engine: vLLM runs the drafter in a worker process of its own, so the counters live
in a small memory-mapped file (writing one costs nothing measurable; the bench reads deltas
around each cell)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

# The catch-up drafter's counters (pipeline.vllm_spec.catch_up_draft), when this names a file.
DRAFTER_STATS_ENV = "SPECBOUND_DRAFTER_STATS"
DRAFTER_FIELDS = (
    "steps",  # steps of a speculating engine the drafter saw
    "skipped",  # of which ran no draft forward (k = 0)
    "plain",  # of which ran as a step without speculation (pipeline.vllm_spec.free_when_off)
    "flushed",  # k = 0 steps that ran the forward to empty a full backlog
    "caught_up",  # missed tokens fed to a later first pass
    "deferred",  # rows left behind by a first pass that had no room for their catch-up
    "stale_prefix",  # cached-prefix positions drafted from a stale draft KV (not caught up)
    "forward_s",  # time in steps that ran the draft
)


class StatsFile:
    """Counters in a float64 memmap at ``path`` (created, zeroed; with ``create=False`` an
    existing file of the right size is added to, so several processes of one engine share
    it); None path: in memory."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        fields: tuple[str, ...] = DRAFTER_FIELDS,
        create: bool = True,
    ) -> None:
        n = len(fields)
        if path is None:
            self.values = np.zeros(n)
        else:
            fresh = create or not Path(path).exists() or Path(path).stat().st_size != 8 * n
            mode = "w+" if fresh else "r+"
            self.values = np.memmap(path, dtype=np.float64, mode=mode, shape=(n,))
        self.fields = fields
        self._index = {name: i for i, name in enumerate(fields)}

    def add(self, **deltas: float) -> None:
        for name, value in deltas.items():
            self.values[self._index[name]] += value

    def as_dict(self) -> dict[str, float]:
        return dict(zip(self.fields, (float(v) for v in self.values), strict=True))


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}


def read_drafter_stats(path: str | os.PathLike[str]) -> dict[str, float]:
    """The counters written at ``path`` (all 0 when nothing has started yet)."""
    fields = DRAFTER_FIELDS
    if not Path(path).exists() or Path(path).stat().st_size < 8 * len(fields):
        return dict.fromkeys(fields, 0.0)
    values = np.fromfile(path, dtype=np.float64, count=len(fields))
    return dict(zip(fields, (float(v) for v in values), strict=True))
