"""What switching drafting on or off costs (pipeline.vllm_spec.switch_cost), without vLLM: the
measured extra per band, the ski-rental rule, and a planner near the line between 0 and
drafting that switches less, and spends less time per token, once it prices its switches."""

from __future__ import annotations

import numpy as np
import pytest
from planner_steps import TRUTH, judge_chains

from pipeline.vllm_spec.online_step_cost import features
from pipeline.vllm_spec.planner_config import PlannerConfig
from pipeline.vllm_spec.priors import Priors
from pipeline.vllm_spec.step_planner import StepPlanner
from pipeline.vllm_spec.switch_cost import SwitchCost


def test_switch_steps_are_averaged_per_band_and_a_switch_waits_for_its_price() -> None:
    cost = SwitchCost()
    for _ in range(200):  # the average starts at 0 (free) and converges to what is measured
        cost.observe(True, 16, 16.0, 10.0)
        cost.observe(False, 16, 14.0, 10.0)
    cost.observe(False, 20, 7.0, 10.0)  # cheaper than a steady step: free
    assert cost.pair_ms(16) == pytest.approx(6.0 + 0.9 * 4.0, rel=1e-6)
    assert cost.pair_ms(1) == 0.0 and cost.pair_ms(8) == 0.0  # other bands: none seen
    assert [cost.pays(3.0, 16) for _ in range(4)] == [False, False, False, True]
    cost.pays(3.0, 16)
    cost.agree()  # the best came back to the current side: the saving is gone
    assert [cost.pays(3.0, 16) for _ in range(4)] == [False, False, False, True]
    assert cost.held == 7 and "16+ rows on 6.0 off 3.6" in cost.report()
    assert cost.pays(0.0, 1)  # no switch measured at 1 row: switching is free there
    one = SwitchCost()
    one.observe(True, 16, 500.0, 10.0)  # one catch-up far above its price: at most 2 steps
    assert one.pair_ms(16) == pytest.approx(0.1 * 20.0)


EXTRA = {"on": 15.0, "off": 5.0}  # ms a switch step costs above its steady price


def _near_the_line(price_switches: bool, steps: int = 3000) -> tuple[int, float]:
    """16 rows whose acceptance (0.5) makes drafting about break even with TRUTH: each row's
    estimate wanders with its chains, so the modelled best k crosses 0 now and then. Returns
    the steps whose k changed and the run's ms per token."""
    rng = np.random.default_rng(1)
    config = PlannerConfig(price_switches=price_switches)
    planner = StepPlanner(4, config, Priors(rates={"greedy": 0.5}))
    planner.cost.anchor(TRUTH)
    ids = [f"r{i}" for i in range(16)]
    last, total_ms, made = 0, 0.0, 0
    for _ in range(steps):
        k = planner.choose(ids)
        positions = len(ids) * (1 + last)  # every row verifies the last step's drafts
        switch = "on" if k > 0 and last == 0 else "off" if k == 0 and last > 0 else None
        ms = float(features(positions, k, len(ids)) @ TRUTH) + EXTRA.get(switch, 0.0)
        tokens = judge_chains(planner, ids, last, 0.5, rng)
        planner.observe_step(
            positions,
            k,
            len(ids),
            ms,
            tokens,
            decode=switch is None,
            switch=switch,
        )
        total_ms, made, last = total_ms + ms, made + tokens, k
    return planner.switches, total_ms / made


def test_a_planner_near_the_line_switches_less_once_it_prices_its_switches() -> None:
    """Blind to what a switch costs, it switched at 81 steps of 3,000 (unlocks spaced by the
    switches' measured cost) and spent 0.638 ms per token; priced, 26 and 0.623 (a step that
    never drafts: 0.6225)."""
    blind, priced = _near_the_line(False), _near_the_line(True)
    assert priced[0] < blind[0] / 3
    assert priced[1] < blind[1]
