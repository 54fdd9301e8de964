"""What a cost-aware policy prices its plans with: the cost model's T_D(n) and T_T(m, U(m))
as two short tables, optionally retimed by the generation's own measured step times.

A cost model describes the machine state, temperature and code path it was measured in; the
same machine a few minutes later, or sampling at T = 1 where it was calibrated at T = 0, can
run the draft or the target tens of percent faster or slower, and each side differently. With
``retime`` the tables are scaled per side by measured over modelled time, from decayed sums
that start from RETIME_PRIOR_MS of agreement (one slow step cannot swing a decision), within
RETIME_LIMITS.
"""

from __future__ import annotations

from collections.abc import Callable

from pipeline.cost.model import CostModel
from pipeline.decode.types import StepRecord

RETIME_DECAY = 0.9
RETIME_PRIOR_MS = 20.0
RETIME_LIMITS = (0.5, 2.0)
SIDES = ("draft", "target")


class PriceTables:
    """T_D(n) for n = 0 .. max_k and T_T(m) for m = 1 .. max_k + 1 (index 0 unused). Plans
    compare differences of T_T, in which the context term c L cancels, so the tables leave it
    out; ``step_price`` prices a whole step with it."""

    def __init__(
        self, cost: CostModel, union: Callable[[int], float], max_k: int, retime: bool
    ) -> None:
        self.cost, self.union, self.retime = cost, union, retime
        self._td0 = [cost.t_draft(n) for n in range(max_k + 1)]
        self._tt0 = [0.0] + [cost.t_target(m, union(m), 0) for m in range(1, max_k + 2)]
        # [measured, modelled] ms of each side's work in this generation
        self._timed = {side: [RETIME_PRIOR_MS, RETIME_PRIOR_MS] for side in SIDES}
        self.td, self.tt = list(self._td0), list(self._tt0)

    def scale(self, side: str) -> float:
        """Measured over modelled time of ``side`` ("draft" or "target"); 1 without retiming."""
        if not self.retime:
            return 1.0
        measured, modelled = self._timed[side]
        return min(max(measured / modelled, RETIME_LIMITS[0]), RETIME_LIMITS[1])

    def refresh(self) -> None:
        """The tables at the current scales (once per step, before its decisions)."""
        d, t = self.scale("draft"), self.scale("target")
        self.td = [d * v for v in self._td0]
        self.tt = [t * v for v in self._tt0]

    def step_price(self, record: StepRecord, ctx: int, extra_ms: float = 0.0) -> float:
        """The step's modelled price at the current scales (with the experts it verified),
        then the step's measured times folded into the scales."""
        u = record.u_bar if record.unique_experts else self.union(record.verified)
        modelled = {
            "draft": self.cost.t_draft(record.draft_forwards),
            "target": self.cost.t_target(record.verified, u, ctx),
        }
        price = sum(self.scale(side) * modelled[side] for side in SIDES) + extra_ms
        measured = {"draft": record.t_draft_ms, "target": record.t_verify_ms}
        for side in SIDES:
            if modelled[side] > 0:  # a plain step's draft side ran no forward: nothing to compare
                sums = self._timed[side]
                sums[0] = RETIME_DECAY * sums[0] + measured[side]
                sums[1] = RETIME_DECAY * sums[1] + modelled[side]
        return price
