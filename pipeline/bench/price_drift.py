"""How far a bench's measured step times are from the cost model's prices of the same steps,
per side: the draft's forwards, and the target's verification with the acceptance walk.

A cost model describes the machine state it was measured in, and a shared machine's state moves:
on this project's 2-core machine the same forwards have measured from about twice to a quarter
of the prices of a cost model taken on it days before. The cost-aware policies weigh one side's
price against the other's, so a drift *between* the sides moves their decisions (`throughput`
drafts shorter chains when drafting is overpriced); `marginal`'s and `ecospec`'s lambda is in ms
per token, so a drift of *both* sides moves theirs. Past the thresholds below the bench says so
and how to recalibrate; it changes nothing itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from pipeline.bench.rows import BenchRow

RELATIVE_WARN = 0.15  # draft scale over target scale off 1 by more: decisions move
ABSOLUTE_WARN = 1.5  # either side measured at more than 1.5x, or under 1 / 1.5, of its price


@dataclass(frozen=True)
class PriceDrift:
    """Measured and modelled ms of every priced step of a bench, per side."""

    draft_measured_ms: float
    draft_modelled_ms: float
    target_measured_ms: float
    target_modelled_ms: float

    @property
    def draft_scale(self) -> float:
        """Measured over modelled draft time (NaN when no step drafted)."""
        if self.draft_modelled_ms <= 0:
            return float("nan")
        return self.draft_measured_ms / self.draft_modelled_ms

    @property
    def target_scale(self) -> float:
        return self.target_measured_ms / self.target_modelled_ms

    @property
    def relative(self) -> float:
        """How much dearer drafting measured than its price, relative to verification."""
        return self.draft_scale / self.target_scale

    @property
    def stale(self) -> bool:
        scales = [s for s in (self.draft_scale, self.target_scale) if not math.isnan(s)]
        off_side = any(s > ABSOLUTE_WARN or s < 1 / ABSOLUTE_WARN for s in scales)
        off_between = len(scales) == 2 and abs(self.relative - 1) > RELATIVE_WARN
        return off_side or off_between

    def metrics(self) -> dict[str, float]:
        """The scales as tracked metrics (NaN left out)."""
        values = {
            "price_scale_draft": self.draft_scale,
            "price_scale_target": self.target_scale,
            "price_scale_relative": self.relative,
        }
        return {k: v for k, v in values.items() if not math.isnan(v)}

    def lines(self, target: str, draft: str, temperatures: str) -> list[str]:
        """What the bench prints: the two scales, and past the thresholds the command that
        recalibrates the pair in the bench's decoding modes."""
        recalibrate = (
            f"python -m jobs.calibrate --target {target} --draft {draft} "
            f"--temperatures {temperatures} --out out/calibrate"
        )
        drafted = not math.isnan(self.draft_scale)
        drafting = (
            f"draft forwards at {self.draft_scale:.2f}x their price"
            if drafted
            else "no step drafted"
        )
        out = [
            f"prices against this run's steps: {drafting}, verification at "
            f"{self.target_scale:.2f}x"
            + (f" (drafting against verification {self.relative:.2f})" if drafted else "")
        ]
        if self.stale:
            out.append(
                "  the cost model no longer describes this machine's state (thresholds: either "
                f"side off by {ABSOLUTE_WARN}x, or drafting against verification by "
                f"{RELATIVE_WARN:.0%}): the cost-aware policies decide on stale prices and the "
                f"modelled figures are off; recalibrate ({recalibrate}) and pass its "
                "costmodel.json with --costmodel"
            )
        return out


def price_drift(rows: Iterable[BenchRow]) -> PriceDrift | None:
    """The drift over every row timed per side (BenchRow.side_ms); None if none is."""
    timed = [row.side_ms for row in rows if row.side_ms is not None]
    if not timed or sum(t[3] for t in timed) <= 0:
        return None
    d_meas, d_mod, t_meas, t_mod = (sum(t[i] for t in timed) for i in range(4))
    return PriceDrift(d_meas, d_mod, t_meas, t_mod)
