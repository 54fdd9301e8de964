"""The proposer's counters, shared with whoever started the engine: vLLM runs the proposer in
a worker process of its own, so the counters live in a small memory-mapped file (writing one
costs nothing measurable; the bench reads deltas around each cell)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

STAT_FIELDS = (
    "calls",  # propose() calls (engine steps)
    "propose_s",  # total time inside propose()
    "draft_s",  # of which in the draft's forwards
    "decide_s",  # of which outside them: matching rows, features, the plan
    "drafted",  # tokens proposed
    "rows",  # batch rows seen (sum over calls)
    "step_s",  # wall time of whole engine steps (end of one propose to the end of the next)
    "steps_timed",  # steps step_s covers (the first call has no previous end)
    "draft_rounds",  # packed draft forwards
    "plain_steps",  # steps that proposed nothing and ran no draft forward
    "verified",  # rows whose last proposal's outcome was seen
    "accepted",  # proposed tokens those rows accepted
)
ENV = "SPECBOUND_PROPOSER_STATS"


class StatsFile:
    """Counters in a float64 memmap at ``path`` (created, zeroed); None path: in memory."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        if path is None:
            self.values = np.zeros(len(STAT_FIELDS))
        else:
            self.values = np.memmap(path, dtype=np.float64, mode="w+", shape=(len(STAT_FIELDS),))
        self._index = {name: i for i, name in enumerate(STAT_FIELDS)}

    def add(self, **deltas: float) -> None:
        for name, value in deltas.items():
            self.values[self._index[name]] += value

    def as_dict(self) -> dict[str, float]:
        return dict(zip(STAT_FIELDS, (float(v) for v in self.values), strict=True))


def read_stats(path: str | os.PathLike[str]) -> dict[str, float]:
    """The counters a proposer wrote at ``path`` (all 0 when it has not started yet)."""
    if not Path(path).exists() or Path(path).stat().st_size < 8 * len(STAT_FIELDS):
        return dict.fromkeys(STAT_FIELDS, 0.0)
    values = np.fromfile(path, dtype=np.float64, count=len(STAT_FIELDS))
    return dict(zip(STAT_FIELDS, (float(v) for v in values), strict=True))


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}
