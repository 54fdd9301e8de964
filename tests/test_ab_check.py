"""The A/B check (pipeline.vllm_spec.ab_check) on a simulated replica: epochs held at a
fixed k or run as the planner chooses, scored by realized tokens per ms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.vllm_spec.ab_check import MAX_GAP, POLICY, ABCheck, band
from pipeline.vllm_spec.planner_config import PlannerConfig
from pipeline.vllm_spec.step_planner import StepPlanner

EPOCH = 16


def _run(check: ABCheck, rates, steps: int, rows=16, noise=0.0, rng=None, drift=0.0) -> list:
    """Drive ``check`` for ``steps`` steps of ``rows`` rows; ``rates(held)`` tokens per ms of
    a step on that side (times a shared drift and per-step noise). Per step, whether it was
    held at 0."""
    sides = []
    for i in range(steps):
        held = check.held(rows)
        off = held == 0
        rate = rates(off) * math.exp(drift * math.sin(i / 200))
        if noise:
            rate *= math.exp(rng.normal(0.0, noise))
        check.observe(round(rate * 100), 100.0)
        sides.append(off)
    return sides


@pytest.mark.parametrize("policy, off", [(2.0, 1.5), (1.5, 2.0)])
def test_the_better_side_runs_and_the_other_is_checked_seldom(policy, off) -> None:
    check = ABCheck(EPOCH)
    sides = _run(check, lambda o: off if o else policy, 200 * EPOCH)
    late = sides[100 * EPOCH :]
    on_worse = sum(o == (off < policy) for o in late) / len(late)
    assert 0 < on_worse <= 1.5 / (MAX_GAP + 1)  # the checks, and nothing else
    assert ("k = 0 leads" in check.report()) == (off > policy)


def test_a_drifting_host_and_noisy_epochs_do_not_hide_a_clear_lead() -> None:
    """The host's speed swings by +-30% over a few epochs and each step by 20%: a 10% lead of
    either side still runs most of the time (checks are paired with their neighbours)."""
    rng = np.random.default_rng(0)
    for policy, off in ((1.1, 1.0), (1.0, 1.1)):
        check = ABCheck(EPOCH)
        made = {True: off, False: policy}
        sides = _run(check, made.__getitem__, 400 * EPOCH, noise=0.2, rng=rng, drift=0.3)
        share_off = sum(sides[100 * EPOCH :]) / len(sides[100 * EPOCH :])
        assert share_off > 0.85 if off > policy else share_off < 0.15, (policy, off, share_off)


def test_the_sides_trade_places_when_the_replica_changes() -> None:
    check = ABCheck(EPOCH)
    _run(check, lambda o: 1.0 if o else 2.0, 300 * EPOCH)  # long settled on the policy
    sides = _run(check, lambda o: 2.0 if o else 1.0, 100 * EPOCH)
    # The next check comes within MAX_GAP + 1 epochs; disagreeing, it is repeated at once
    # and the sides trade places; from there the policy only runs as checks (gaps 2, 4, ...).
    first = sides.index(True)
    assert first <= (MAX_GAP + 1) * EPOCH
    after = sides[first + 4 * EPOCH :]
    assert sum(after) / len(after) > 0.8 and check.bands[4].leader == 0


def test_bands_are_judged_apart_and_a_changed_band_ends_the_epoch() -> None:
    assert [band(r) for r in (1, 2, 3, 5, 6, 8, 11, 12, 16, 22, 23)] == [
        0, 1, 2, 2, 3, 3, 3, 4, 4, 4, 5
    ]  # fmt: skip
    check = ABCheck(EPOCH)

    def rates(off: bool) -> float:  # off pays at one row, the policy at 16
        return (2.0 if off else 1.0) if rows_now[0] == 1 else (1.0 if off else 2.0)

    rows_now = [1]
    for _ in range(60):  # stretches of 5 epochs at each batch size
        for rows in (1, 16):
            rows_now[0] = rows
            _run(check, rates, 5 * EPOCH, rows=rows)
    assert check.bands[0].leader == 0 and check.bands[4].leader == POLICY
    # A stretch of 1-row steps too short to score changes nothing in band 0.
    before = check.bands[0].sides[POLICY].lead
    check.held(1)
    check.observe(100, 1.0)
    check.held(16)
    assert check.bands[0].sides[POLICY].lead == before


def test_the_planner_holds_whole_epochs_at_zero_and_reports_them() -> None:
    planner = StepPlanner(4, PlannerConfig(ab_epoch=EPOCH, offline_priors=False))
    ids = [f"r{i}" for i in range(16)]
    chosen = []
    for _ in range(40 * EPOCH):
        k = planner.choose(ids)
        chosen.append(k)
        # Drafting makes twice what a step at 0 makes, in the same time.
        planner.observe_step(16 + 16 * k, k, 16, 10.0, 16 * (2 if k else 1), True)
    first_epoch_off = chosen[EPOCH : 2 * EPOCH]
    assert chosen[:EPOCH] == [chosen[0]] * EPOCH and chosen[0] > 0
    assert first_epoch_off == [0] * EPOCH  # the first check
    s = planner.ab.bands[4]
    assert s.leader == POLICY and s.epochs >= 38 and s.sides[0].epochs <= 5
    assert "A/B check 12-22 rows: the policy leads" in planner.report()
    with pytest.raises(ValueError, match="ab_epoch"):
        PlannerConfig(ab_epoch=-1)
    # Held at K, the check weighs K against 0; held at 0 there is nothing to check.
    fixed = StepPlanner(4, PlannerConfig(ab_epoch=EPOCH, design="fixed"))
    held = []
    for _ in range(2 * EPOCH):
        held.append(fixed.choose(ids))
        fixed.observe_step(16, held[-1], 16, 10.0, 16, True)
    assert held == [4] * EPOCH + [0] * EPOCH
    assert StepPlanner(4, PlannerConfig(ab_epoch=EPOCH, design="off")).ab is None


def test_a_fixed_k_that_beats_the_policy_and_zero_leads() -> None:
    """With ``ab_fixed``, a held K is a side too: where it makes the most, it runs."""
    check = ABCheck(EPOCH, (0, 3))
    made = {None: 1.0, 0: 1.1, 3: 1.3}
    held = []
    for _ in range(300 * EPOCH):
        k = check.held(16)
        held.append(k)
        check.observe(round(made[k] * 100), 100.0)
    late = held[100 * EPOCH :]
    assert check.bands[4].leader == 3 and late.count(3) / len(late) > 0.9
    assert "12-22 rows: k = 3 leads" in check.report()


def test_the_planner_holds_the_fixed_k_untrimmed_and_refuses_one_above_its_k() -> None:
    planner = StepPlanner(4, PlannerConfig(ab_epoch=EPOCH, ab_fixed=3, offline_priors=False))
    ids = [f"r{i}" for i in range(16)]
    for _ in range(EPOCH):  # the policy's first epoch, then the checks
        planner.observe_step(16, planner.choose(ids), 16, 10.0, 16, True)
    seen = set()
    for _ in range(4 * EPOCH):
        k = planner.choose(ids)
        if planner._held == 3:
            assert k == 3 and planner.keep(ids[0], 3, 16) == 3  # no marginal trim
            seen.add(3)
        planner.observe_step(16 + 16 * k, k, 16, 10.0, 16, True)
    assert seen == {3}
    with pytest.raises(ValueError, match="ab_fixed 5: at most the engine's K"):
        StepPlanner(4, PlannerConfig(ab_epoch=EPOCH, ab_fixed=5))
