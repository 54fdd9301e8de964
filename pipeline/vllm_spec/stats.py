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
# The catch-up drafter's counters (pipeline.vllm_spec.catch_up_draft), when this names a file.
DRAFTER_STATS_ENV = "SPECBOUND_DRAFTER_STATS"
DRAFTER_FIELDS = (
    "steps",  # propose() calls
    "skipped",  # of which ran no draft forward (k = 0)
    "flushed",  # k = 0 steps that ran the forward to empty a full backlog
    "caught_up",  # missed tokens fed to a later first pass
    "forward_s",  # time in steps that ran the draft
)


class StatsFile:
    """Counters in a float64 memmap at ``path`` (created, zeroed; with ``create=False`` an
    existing file of the right size is added to, so several processes of one engine share
    it); None path: in memory."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        fields: tuple[str, ...] = STAT_FIELDS,
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


def read_stats(
    path: str | os.PathLike[str], fields: tuple[str, ...] = STAT_FIELDS
) -> dict[str, float]:
    """The counters written at ``path`` (all 0 when nothing has started yet)."""
    if not Path(path).exists() or Path(path).stat().st_size < 8 * len(fields):
        return dict.fromkeys(fields, 0.0)
    values = np.fromfile(path, dtype=np.float64, count=len(fields))
    return dict(zip(fields, (float(v) for v in values), strict=True))


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}


def read_drafter_stats(path: str | os.PathLike[str]) -> dict[str, float]:
    return read_stats(path, DRAFTER_FIELDS)
