"""The bench's check of its cost model against the steps it timed (pipeline.bench.price_drift):
each side's measured over priced time, in the row's decoding mode, the context term and the
acceptance walk included where the model prices them; a warning with the recalibration command
past the thresholds, none within them."""

from __future__ import annotations

import math

import pytest

from pipeline.bench.online import side_times
from pipeline.bench.price_drift import ABSOLUTE_WARN, PriceDrift, price_drift
from pipeline.bench.rows import BenchRow
from pipeline.cost.model import CostModel
from pipeline.decode.types import StepRecord

# T_T = 4 + 0.5 U + 0.01 L; T_D = 0.4 n + 0.1; at T = 1 a mode: draft 0.6 n + 0.2, walk 0.1 m
COST = CostModel(
    {m: 4.0 for m in range(1, 6)},
    {m: 0.5 for m in range(1, 6)},
    0.01,
    0.4,
    0.1,
    meta={
        "modes": [
            {
                "temperature": 1.0,
                "top_p": 1.0,
                "draft": {"a": 0.6, "b": 0.2},
                "accept": {"a": 0.1, "b": 0.0},
            },
        ]
    },
)


def _step(forwards: int, verified: int, new: int, t_draft: float, t_verify: float) -> StepRecord:
    return StepRecord(
        drafted=verified - 1,
        verified=verified,
        accepted=new - 1,
        new_tokens=new,
        unique_experts=[2, 2],
        t_draft_ms=t_draft,
        t_verify_ms=t_verify,
        draft_forwards=forwards,
        t_accept_ms=0.5,
    )


def _row(temperature: float, steps: list[StepRecord]) -> BenchRow:
    return BenchRow("fixed(k=2)", temperature, 4, 1.0, 1.0, 2.0, 0.5, steps=[steps])


def test_side_times_price_each_step_in_the_rows_mode_with_its_context():
    steps = [_step(2, 3, 3, 1.8, 10.0), _step(2, 3, 1, 1.8, 10.0)]
    prompt = [0] * 100
    # greedy: no mode, so no walk in the price nor in the measured target side
    d_meas, d_mod, t_meas, t_mod = side_times(_row(0.0, steps), [prompt], COST)
    assert d_meas == pytest.approx(3.6) and d_mod == pytest.approx(2 * 0.9)
    assert t_meas == pytest.approx(20.0)
    assert t_mod == pytest.approx((5.0 + 0.01 * 100) + (5.0 + 0.01 * 103))
    # T = 1: the mode's draft line, and its walk both priced and measured
    d_meas, d_mod, t_meas, t_mod = side_times(_row(1.0, steps), [prompt], COST)
    assert d_mod == pytest.approx(2 * 1.4)
    assert t_meas == pytest.approx(21.0)
    assert t_mod == pytest.approx((5.3 + 1.0) + (5.3 + 1.03))


def test_the_drift_pools_every_timed_row_and_warns_past_its_thresholds():
    within, stale = _row(0.0, []), _row(0.0, [])
    within.side_ms = (2.0, 2.0, 10.0, 9.0)  # draft 1.00x, target 1.11x: relative 0.90
    assert price_drift([within]) == PriceDrift(2.0, 2.0, 10.0, 9.0)
    assert price_drift([_row(0.0, [])]) is None  # nothing timed (not priced yet)
    lines = price_drift([within]).lines("models/target", "models/draft", "0")
    assert lines == [
        "prices against this run's steps: draft forwards at 1.00x their price, verification at "
        "1.11x (drafting against verification 0.90)"
    ]
    stale.side_ms = (1.0, 4.0, 3.0, 9.0)  # both sides at a quarter / a third of their price
    drift = price_drift([within, stale])
    assert drift.draft_scale == pytest.approx(3 / 6) and drift.target_scale == pytest.approx(
        13 / 18
    )
    assert drift.stale
    text = "\n".join(drift.lines("models/target", "models/draft", "0,1"))
    assert "no longer describes this machine's state" in text
    command = "python -m jobs.calibrate --target models/target --draft models/draft"
    assert f"{command} --temperatures 0,1 --out out/calibrate" in text
    assert set(drift.metrics()) == {
        "price_scale_draft",
        "price_scale_target",
        "price_scale_relative",
    }


@pytest.mark.parametrize(
    ("sides", "stale"),
    [
        ((1.0, 1.0, 1.0, 1.0), False),
        ((1.2, 1.0, 1.0, 1.0), True),  # drafting 20% dearer than verification, relatively
        ((1.4, 1.0, 1.3, 1.0), False),  # both dearer alike, within the absolute bound
        ((ABSOLUTE_WARN * 1.1, 1.0, ABSOLUTE_WARN * 1.1, 1.0), True),
        ((0.0, 0.0, 0.5, 1.0), True),  # no draft (`ar` alone): the target side alone
        ((0.0, 0.0, 0.9, 1.0), False),
    ],
)
def test_stale_means_a_side_far_off_or_the_sides_apart(sides, stale):
    drift = PriceDrift(*sides)
    assert drift.stale is stale
    if sides[1] == 0:
        assert math.isnan(drift.draft_scale) and set(drift.metrics()) == {"price_scale_target"}
        assert "no step drafted" in drift.lines("t", "d", "0")[0]
