"""The cost-aware scheduler's planner (pipeline.vllm_spec.step_planner), without vLLM: the
online step-cost fit recovers a known cost, acceptance estimates follow each request, and the
choice is the brute-force best of the model it holds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.vllm_spec.online_step_cost import features
from pipeline.vllm_spec.planner_config import PlannerConfig
from pipeline.vllm_spec.priors import Priors, load_priors, mode_of
from pipeline.vllm_spec.step_planner import StepPlanner

ROOT = Path(__file__).resolve().parents[1]
UNION = (32, 4, 0.9787)  # E, top_k, r: the embedded target's calibration


@pytest.mark.parametrize("union", [None, UNION])
def test_step_cost_fit_recovers_the_cost_it_is_timed_on(union) -> None:
    """Each batch-size band's fit prices every step of its band as the truth does (at one row
    the row terms are one column with the intercept and the per-round terms: sums only)."""
    truth = np.array([5.0, 0.2, 0.0 if union is None else 0.3, 0.3, 1.5, 0.08, 0.8, 0.1])
    planner = StepPlanner(4, PlannerConfig(forget=1.0), Priors(union=union))
    rng = np.random.default_rng(0)
    for _ in range(3000):
        rows, k = int(rng.integers(1, 17)), int(rng.integers(0, 5))
        positions = rows * (1 + int(rng.integers(0, 5)))
        x = features(positions, k, rows, planner.union(positions))
        ms = x @ truth + rng.normal(0, 0.3)
        planner.observe_step(positions, k, rows, ms)
    for rows in range(1, 17):
        for k in range(5):
            for verified in range(5):
                positions = rows * (1 + verified)
                want = features(positions, k, rows, planner.union(positions)) @ truth
                assert planner.step_ms(positions, k, rows) == pytest.approx(want, rel=0.03)
    planner.observe_step(4, 1, 2, float("nan"))  # an untimed step changes nothing
    assert planner.steps == 3000


def test_steps_at_one_batch_size_do_not_move_the_prices_of_another() -> None:
    """Thousands of 1-row steps (a quiet stretch) whose cost grows with the draft rounds and
    not with the verified positions: the 1-row band learns that, and 16-row steps keep the
    calibration's prices (one fit for every batch size took c_pos to -0.23 ms from such steps
    and priced 16-row k = 4 steps at 5.7 ms where they took 18.8)."""
    priors = load_priors(ROOT / "models" / "draft", "cpu")
    planner = StepPlanner(4, PlannerConfig(), priors)
    fresh = StepPlanner(4, PlannerConfig(), priors)
    rng = np.random.default_rng(0)
    last = 4
    for _ in range(6000):
        k = int(rng.choice([2, 3, 4, 4, 4]))
        verified = int(rng.integers(0, last + 1))
        planner.observe_step(1 + verified, k, 1, 5.0 + 1.3 * k + rng.normal(0, 0.3))
        last = k
    for k in range(5):
        assert planner.step_ms(1 + k, k, 1) == pytest.approx(5.0 + 1.3 * k, abs=0.3)
        for rows in (8, 16):
            positions = rows * (1 + k)
            assert planner.step_ms(positions, k, rows) == fresh.step_ms(positions, k, rows)


def test_what_the_steps_do_not_measure_stays_at_the_prior() -> None:
    """One request, k of 2..4 each step: the positions (1 + the last k), the union of their
    experts and the intercept are nearly collinear, so the steps measure their sum, not each.
    The fit keeps the prior's information (forgetting only the data's): the firm terms stay
    at the prior, the intercept takes the shift, and the step time is right at every k,
    those never run (0, 1) included. Forgetting the prior too let the collinear terms run
    off on the noise (c0 29.6, c_union -6.0 on this data)."""
    prior = (7.0, 0.1, 0.08, 0.0, 1.0, 0.06, 0.2, 0.1)
    truth = np.array(prior) + np.array([2.0, 0, 0, 0, 0.5, 0, 0, 0])  # slower host, sampled drafts
    for seed in range(3):
        planner = StepPlanner(4, PlannerConfig(), Priors(cost=prior, union=UNION))
        rng = np.random.default_rng(seed)
        last = 2
        for _ in range(3000):
            k = int(rng.integers(2, 5))
            positions, last = 1 + last, k
            x = features(positions, k, 1, planner.union(positions))
            planner.observe_step(positions, k, 1, float(x @ truth + rng.normal(0, 1.0)))
        assert planner.theta[[2, 5, 7]] == pytest.approx([prior[2], prior[5], prior[7]], abs=0.01)
        assert 8.0 < planner.theta[0] < 9.5
        for k in range(5):
            x = features(1 + k, k, 1, planner.union(1 + k))
            assert planner.step_ms(1 + k, k, 1) == pytest.approx(x @ truth, abs=0.4)


def test_a_step_that_prefills_is_counted_not_fitted() -> None:
    """The model prices decode steps: a prompt's positions (cheap beside a verified position at
    T > 0, whose rejection test samples over the vocabulary) would drag c_pos toward a
    prefill's cost per token."""
    planner = StepPlanner(4, PlannerConfig())
    before = planner.theta.copy()
    planner.observe_step(180, 2, 1, 40.0, tokens=1, decode=False)
    assert np.array_equal(planner.theta, before)
    assert (planner.steps, planner.unfitted_steps) == (1, 1)
    assert planner.tokens_per_ms == pytest.approx(0.1 / 40.0)  # the replica's output still
    planner.observe_step(3, 2, 1, 12.0, tokens=3)
    assert not np.array_equal(planner.theta, before)
    assert "(1 not fitted)" in planner.report()


def test_acceptance_follows_each_request_from_the_pooled_rate() -> None:
    planner = StepPlanner(4, PlannerConfig(decay=1.0))
    rng = np.random.default_rng(1)
    for _ in range(3000):
        for rid, rate in (("easy", 0.9), ("hard", 0.2)):
            k = int(rng.integers(1, 5))
            accepted = next((i for i in range(k) if rng.random() > rate), k)
            planner.observe_chain(rid, k, accepted)
    assert planner.rate("easy") == pytest.approx(0.9, abs=0.02)
    assert planner.rate("hard") == pytest.approx(0.2, abs=0.02)
    pooled = planner.acceptance.pooled["greedy"][0] / planner.acceptance.pooled["greedy"][1]
    assert planner.rate("new") == pytest.approx(pooled)
    planner.forget_requests({"easy"})
    assert set(planner.acceptance.requests) == {"easy"}


def test_choice_is_the_best_k_of_the_model() -> None:
    planner = StepPlanner(6, PlannerConfig(explore=0.0))
    planner.theta = np.array([7.0, 0.1, 0.0, 0.0, 1.0, 0.05, 0.0, 0.0])
    for rid, accepted in (("a", 3), ("b", 1), ("c", 4)):
        planner.observe_chain(rid, 4, accepted)
    ids = ["a", "b", "c"]
    rates = np.array([planner.rate(r) for r in ids])

    def worth(k: int) -> float:
        tokens = sum((1 - a ** (k + 1)) / (1 - a) for a in rates)
        return tokens / planner.step_ms(3 * (1 + k), k, 3)

    assert planner.choose(ids) == max(range(7), key=worth)


@pytest.mark.parametrize(("rate", "d0", "want"), [(0.95, 0.1, 6), (0.05, 5.0, 0)])
def test_choice_drafts_long_when_cheap_and_likely_and_never_when_not(rate, d0, want) -> None:
    planner = StepPlanner(6, PlannerConfig(explore=0.0, prior_rate=rate, prior_weight=1e6))
    planner.theta = np.array([7.0, 0.05, 0.0, 0.0, d0, 0.01, 0.0, 0.0])
    assert planner.choose(["x", "y"]) == want


def test_fixed_design_exploration_and_empty_batches() -> None:
    assert StepPlanner(3, PlannerConfig(design="fixed")).choose(["a"]) == 3
    off = StepPlanner(3, PlannerConfig(design="off"))
    assert off.choose(["a"]) == 0 and off.keep("a", 3) == 0
    assert StepPlanner(0).choose(["a"]) == 0 and StepPlanner(3).choose([]) == 0
    planner = StepPlanner(4, PlannerConfig(explore=1.0, seed=3))
    picks = [planner.choose(["a"]) for _ in range(500)]
    assert set(picks) == {0, 1, 2, 3, 4} and planner.chosen.sum() == 500
    changed = sum(a != b for a, b in zip(picks, picks[1:], strict=False))
    assert planner.switches == changed and f"(changed at {changed} steps)" in planner.report()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"explore": 2}', "explore"),
        ('{"nope": 1}', "unknown field"),
        ('{"design": "random"}', "design"),
        ('{"prior_cost": [1, 2, 3, 4]}', "prior_cost"),
        ("[1]", "JSON object"),
    ],
)
def test_settings_are_refused_with_their_reason(text, message) -> None:
    with pytest.raises(ValueError, match=message):
        PlannerConfig.from_env({"SPECBOUND_SCHEDULER": text})
    assert PlannerConfig.from_env({}) == PlannerConfig()


def geometric(rates: np.ndarray, verified) -> float:
    """Tokens of rows verifying ``verified`` drafts at per-token rates (no depth evidence)."""
    return float(np.sum((1.0 - rates ** (np.asarray(verified) + 1)) / (1.0 - rates)))


def test_marginal_rule_verifies_a_chain_only_as_far_as_it_pays() -> None:
    planner = StepPlanner(4, PlannerConfig(prior_rate=0.6, prior_weight=1e6))
    planner.theta = np.array([7.0, 0.1, 0.0, 0.0, 1.0, 0.05, 0.0, 0.0])
    assert planner.keep("r", 4) == 4  # no output measured yet: nothing to price with
    planner.tokens_per_ms = 2.0  # a position costs 0.1 ms x 2 tokens/ms = 0.2 tokens
    # 0.6, 0.36, 0.216 >= 0.2 > 0.13: three of four kept.
    assert planner.keep("r", 4) == 3 and planner.trimmed == 1
    assert planner.keep("r", 2) == 2
    assert StepPlanner(4, PlannerConfig(trim=False)).keep("r", 4) == 4


def test_the_choice_counts_only_the_drafts_the_marginal_rule_will_verify() -> None:
    """A k beyond what ``keep`` verifies pays draft rounds for tokens dropped unverified: the
    choice is the brute-force best with each row's tokens cut where the marginal rule cuts."""
    planners = [StepPlanner(4, PlannerConfig(prior_rate=0.6, prior_weight=1e6)) for _ in "ab"]
    for planner in planners:
        planner.theta = np.array([7.0, 0.1, 0.0, 0.0, 0.3, 0.0, 0.0, 0.0])
    rows = ["a", "b"]
    assert planners[0].choose(rows) == 4  # no output measured yet: every draft is verified
    planner = planners[1]
    planner.tokens_per_ms = 2.0  # 0.6, 0.36, 0.216 >= 0.2 > 0.13: three of four kept
    assert [planner.keep(r, 4, 2) for r in rows] == [3, 3]
    rates = np.array([0.6, 0.6])

    def worth(k: int) -> float:
        verified = min(k, 3)
        return geometric(rates, verified) / planner.step_ms(2 * (1 + verified), k, 2)

    assert planner.choose(rows) == max(range(5), key=worth) == 3


def test_a_verified_position_is_priced_with_the_experts_it_adds() -> None:
    """With the union term, one more position costs c_pos plus c_union times the experts it
    brings that the step's other positions do not: more in a small step than in a big one."""
    planner = StepPlanner(4, PlannerConfig(prior_rate=0.5, prior_weight=1e6), Priors(union=UNION))
    planner.theta = np.array([7.0, 0.02, 0.5, 0.0, 1.0, 0.05, 0.0, 0.0])
    planner.tokens_per_ms = 1.0
    small = planner.keep("r", 4, positions=1)
    big = planner.keep("r", 4, positions=200)
    assert small < big


def test_rows_are_priced_at_their_own_temperature() -> None:
    priors = Priors(rates={"greedy": 0.9, "sampled": 0.3})
    planner = StepPlanner(4, PlannerConfig(), priors)
    planner.set_mode("g", mode_of(0.0))
    planner.set_mode("s", mode_of(1.0))
    assert planner.rate("g") == pytest.approx(0.9) and planner.rate("s") == pytest.approx(0.3)
    planner.set_mode("s2", "sampled")
    for _ in range(50):
        planner.observe_chain("s2", 4, 0)  # sampled evidence moves the sampled pool only
    assert planner.rate("s") < 0.1
    assert planner.rate("g") == pytest.approx(0.9)
    assert StepPlanner(4, PlannerConfig(offline_priors=False), priors).rate("g") == 0.6


def test_offline_priors_are_the_pairs_acceptance_model_and_calibration(tmp_path) -> None:
    priors = load_priors(ROOT / "models" / "draft", "cpu")
    acceptance = json.loads((ROOT / "models" / "acceptance.json").read_text())
    assert priors.rates["greedy"] == acceptance["modes"]["greedy"]["prior"]
    assert priors.rates["sampled"] == acceptance["modes"]["sampled"]["prior"]
    cost = json.loads((ROOT / "models" / "vllm_costmodel.json").read_text())["cost"]
    names = ("b0", "b_pos", "b_union", "b_row", "d0", "d_tok", "s0", "s_row")
    assert priors.cost == tuple(cost[n] for n in names)
    assert priors.union == (cost["experts"], cost["top_k"], cost["union_decay"])
    assert load_priors(ROOT / "models" / "draft", "cuda").cost is None  # another device
    # The 2-layer draft has its own acceptance model beside it and no vLLM calibration.
    two = load_priors(ROOT / "models" / "draft-2layer", "cpu")
    assert two.cost is None and set(two.rates) == {"greedy", "sampled"}
    assert load_priors(tmp_path / "nothing") == Priors()
    # A calibration made before the fit had a row term: the row term's prior is 0.
    (tmp_path / "old").mkdir()
    body = json.loads((ROOT / "models" / "vllm_costmodel.json").read_text())
    del body["cost"]["b_row"]
    (tmp_path / "old" / "vllm_costmodel.json").write_text(json.dumps(body))
    assert load_priors(tmp_path / "old", "cpu").cost[3] == 0.0
    planner = StepPlanner(4, PlannerConfig(), priors)
    assert planner.theta[0] == cost["b0"] and planner.rate("new") == priors.rates["greedy"]
    assert priors.draft_cost_measured


def test_a_drafter_no_calibration_measured_takes_its_targets_terms_only() -> None:
    """The EAGLE-3 head: its own acceptance model, the target's step terms from the draft
    model's calibration of the same target, its draft terms a guess the steps outweigh."""
    target = str(ROOT / "models" / "target")
    head = load_priors(ROOT / "models" / "eagle3-head", "cpu", target)
    own = json.loads((ROOT / "models" / "eagle3-head" / "acceptance.json").read_text())
    assert head.rates["greedy"] == own["modes"]["greedy"]["prior"]
    cost = json.loads((ROOT / "models" / "vllm_costmodel.json").read_text())["cost"]
    assert head.cost[:3] == (cost["b0"], cost["b_pos"], cost["b_union"])
    assert head.union is not None and not head.draft_cost_measured
    assert load_priors(ROOT / "models" / "eagle3-head", "cpu").cost is None  # no target named
    assert load_priors(ROOT / "models" / "eagle3-head", "cpu", "other-target").cost is None
    firm = StepPlanner(4, PlannerConfig(), load_priors(ROOT / "models" / "draft", "cpu"))
    loose = StepPlanner(4, PlannerConfig(), head)
    assert np.allclose(np.diag(loose.cost.prior_info)[:4], np.diag(firm.cost.prior_info)[:4])
    assert np.all(20 * np.diag(loose.cost.prior_info)[4:] < np.diag(firm.cost.prior_info)[4:])


def test_methods_have_one_name_each_and_ours_is_the_scheduler() -> None:
    """One name per mechanism: ours (and ours-eagle3) the scheduler over vLLM's drafter with
    probabilistic drafting; scheduler knobs travel in SPECBOUND_SCHEDULER. The calibration's
    custom_class drafter is no method: nothing serves with it."""
    from pipeline.vllm_spec.methods import SCHEDULER_CLASS, parse_methods

    ours, head = parse_methods("ours:k=3:design=off,ours-eagle3:k=2")
    entry = ours.entry("models/draft")
    assert entry["speculative_config"] == {
        "method": "draft_model",
        "num_speculative_tokens": 3,
        "model": "models/draft",
        "draft_sample_method": "probabilistic",
    }
    assert entry["engine_kwargs"] == {"scheduler_cls": SCHEDULER_CLASS}
    assert json.loads(entry["env"]["SPECBOUND_SCHEDULER"]) == {"design": "off"}
    assert head.entry("models/draft")["speculative_config"]["method"] == "eagle3"
    for retired in ("cost_aware", "proposer"):
        with pytest.raises(ValueError, match=f"unknown method '{retired}'"):
            parse_methods(f"{retired}:k=2")


def test_acceptance_fades_back_to_the_replicas_longer_memory_while_nothing_is_drafted() -> None:
    """A replica that stopped drafting after a bad streak measures no acceptance; its
    estimates return step by step to the mode's longer memory: the offline rate before any
    chain, then the replica's last few hundred chains (not the streak, and not an offline rate
    the replica measures otherwise: ShareGPT's 0.728 offline, 0.55-0.63 online)."""
    fresh = StepPlanner(4, PlannerConfig(revert=0.02), Priors(rates={"greedy": 0.8}))
    for _ in range(500):  # idle steps: timed, no chain judged
        fresh.observe_step(8, 0, 1, 7.0)
    assert fresh.rate("new") == pytest.approx(0.8)
    planner = StepPlanner(4, PlannerConfig(revert=0.02), Priors(rates={"greedy": 0.8}))
    for i in range(300):  # 2 of 4 kept: a per-token rate of 2 / 3
        planner.observe_chain(f"q{i % 8}", 4, 2)
    for _ in range(10):
        planner.observe_chain("r", 4, 0)
    assert planner.rate("r") < 0.4
    longer = planner.acceptance.long_rate("greedy")
    assert 0.6 < longer < 2 / 3
    for _ in range(500):
        planner.observe_step(8, 0, 1, 7.0)
    assert planner.rate("r") == pytest.approx(longer, abs=0.01)
    assert planner.rate("new") == pytest.approx(longer, abs=0.01)
    assert StepPlanner(4, PlannerConfig(revert=0.0)).config.revert == 0.0
    with pytest.raises(ValueError, match="revert"):
        PlannerConfig(revert=0.9)


def test_one_slow_step_cannot_stop_drafting_and_idle_steps_bring_it_back() -> None:
    """A first forward at a new shape can take 100x a step; it moves the fit by at most half
    a prediction plus 1 ms. A replica that stopped drafting on a bad estimate of the draft
    terms (which k = 0 steps cannot measure) drafts again once they fade to the prior."""
    target = str(ROOT / "models" / "target")
    planner = StepPlanner(
        6, PlannerConfig(), load_priors(ROOT / "models" / "eagle3-head", "cpu", target)
    )
    rows = ["a"]
    before = planner.step_ms(7, 6, 1)
    assert planner.choose(rows) > 0
    planner.observe_step(7, 6, 1, 500.0)  # the head's first forward
    assert planner.step_ms(7, 6, 1) <= before + 0.5 * before + 1.0 + 1e-9
    assert planner.choose(rows) > 0
    planner.theta[4] = 50.0  # a draft round believed to cost 50 ms: never worth it
    assert planner.choose(rows) == 0
    for _ in range(300):
        planner.observe_step(1, 0, 1, planner.step_ms(1, 0, 1))  # idle steps, as priced
    assert planner.choose(rows) > 0


def test_a_request_caps_its_row_and_a_batch_of_capped_rows_drafts_nothing() -> None:
    planner = StepPlanner(4, PlannerConfig(trim=False), Priors(rates={"greedy": 0.95}))
    # drafting is cheap: k = 4 pays
    planner.theta = np.array([5.0, 0.05, 0.0, 0.0, 0.2, 0.01, 0.0, 0.0])
    planner.tokens_per_ms = 0.1
    assert planner.choose(["a", "b"]) == 4
    planner.set_cap("a", 0)
    planner.set_cap("b", 0)
    assert planner.choose(["a", "b"]) == 0  # no row may draft: the step runs as none
    assert planner.held_off == 2
    planner.set_cap("b", 2)
    assert planner.choose(["a", "b"]) == 2  # more than the largest cap buys nothing
    assert planner.keep("a", 4) == 0 and planner.keep("b", 4) == 2
    assert planner.keep("c", 4) == 4  # a request without a cap
    planner.forget_requests({"c"})
    assert planner.caps == {}
    # The brute force over k with each row's expected tokens cut at its cap.
    planner.set_cap("a", 1)
    rates = np.array([planner.rate("a"), planner.rate("c")])
    caps = np.array([1, 4])

    def worth(k: int) -> float:
        positions = float(np.sum(1 + np.minimum(k, caps)))
        verified = np.minimum(k, caps)
        tokens = geometric(rates, verified)
        assert tokens == pytest.approx(planner.expected_tokens(["a", "c"], k, caps))
        return tokens / planner.step_ms(positions, k, 2)

    assert planner.choose(["a", "c"]) == max(range(5), key=worth)


@pytest.mark.parametrize(
    "extra, temperature, seed, cap",
    [
        (None, 0.0, None, 4),
        ({"speculation": "off"}, 0.0, None, 0),
        ({"max_draft_tokens": 2}, 0.0, None, 2),
        ({"max_draft_tokens": 9}, 0.0, None, 4),
        (None, 1.0, 7, 0),  # seeded and sampled: drafts nothing so its seed repeats
        ({"speculation": "on"}, 1.0, 7, 4),  # unless it asks to draft
        (None, 0.0, 7, 4),  # a seed changes nothing at T = 0
        ({"other": 1}, 1.0, None, 4),
    ],
)
def test_draft_cap_reads_the_request(extra, temperature, seed, cap) -> None:
    from types import SimpleNamespace

    from pipeline.vllm_spec.request_args import draft_cap

    params = SimpleNamespace(extra_args=extra, temperature=temperature, seed=seed)
    assert draft_cap(params, 4) == cap


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"speculation": "maybe"}, "vllm_xargs.speculation"),
        ({"max_draft_tokens": True}, "vllm_xargs.max_draft_tokens"),
        ({"max_draft_tokens": -1}, "vllm_xargs.max_draft_tokens"),
        ({"max_draft_tokens": 5}, "vllm_xargs.max_draft_tokens"),
        ({"max_draft_tokens": "2"}, "vllm_xargs.max_draft_tokens"),
        ([1], "vllm_xargs"),
    ],
)
def test_bad_request_args_name_their_field(extra, param) -> None:
    from pipeline.vllm_spec.request_args import check_request_args

    problems = check_request_args(extra, 4)
    assert [p for p, _ in problems] == [param]
    assert check_request_args({"speculation": "off", "max_draft_tokens": 4, "x": 1}, 4) == []


def test_the_report_gives_the_runs_acceptance_beside_the_recent_estimate() -> None:
    """The estimates follow recent chains (at an engine's end, its last requests); the run's
    accepted / drafted is what vLLM's own counters give, so the two can be compared."""
    planner = StepPlanner(4, PlannerConfig(revert=0.0))
    for _ in range(200):
        planner.observe_chain("easy", 4, 4)
    for _ in range(200):
        planner.observe_chain("hard", 4, 0)
    report = planner.report()
    assert "accepted / drafted over the run greedy 0.500" in report  # 800 of 1600
    recent = planner.acceptance.pooled["greedy"][0] / planner.acceptance.pooled["greedy"][1]
    assert recent < 0.1 and f"greedy {recent:.3f}" in report  # the last chains: hard


def test_the_report_sets_each_chain_length_against_what_the_estimates_expected() -> None:
    """Per drafted length, the accepted tokens of the chains against what the choice priced
    them at when they were judged (here a geometric chain, depth factors off, at the row's
    estimate): equal where the estimate is right, below where it is optimistic (here pinned
    at 0.6 by a heavy prior, the truth 0.4)."""
    rng = np.random.default_rng(0)
    for truth in (0.6, 0.4):
        config = PlannerConfig(
            prior_rate=0.6, prior_weight=1e9, decay=1.0, revert=0.0, depth_factors=False
        )
        planner = StepPlanner(4, config)
        for _ in range(4000):
            accepted = int(np.argmin(np.append(rng.random(3) < truth, False)))
            planner.observe_chain("r", 3, accepted)
        measured, modelled, n = planner.acceptance.by_length[3]
        want = truth * (1 - truth**3) / (1 - truth)
        assert n == 4000 and measured / n == pytest.approx(want, abs=0.04)
        assert modelled / n == pytest.approx(0.6 * (1 - 0.6**3) / 0.4, rel=1e-4)
        assert f"by its length 3: {measured / n:.2f}/{modelled / n:.2f} (4000)" in planner.report()


def test_depth_factors_price_each_draft_at_what_its_depth_accepts() -> None:
    """Deep drafts are accepted less than the first (at 16 requests chains of 4 got 2.62
    tokens where a geometric chain at the rows' rates expected 3.17). Here a draft is accepted
    at 0.8, 0.6, 0.4, 0.2 by depth, the row's rate pinned at 0.6: the factors learn each
    depth's ratio, the tokens per chain priced meet those measured, and the marginal rule and
    the choice cut where the depths say (2 drafts), not where a geometric chain would (3)."""
    truth = np.array([0.8, 0.6, 0.4, 0.2])
    rng = np.random.default_rng(1)
    planners = []
    for on in (True, False):
        config = PlannerConfig(
            prior_rate=0.6, prior_weight=1e9, decay=1.0, revert=0.0, depth_factors=on
        )
        planners.append(StepPlanner(4, config))
        planners[-1].theta = np.array([7.0, 0.1, 0.0, 0.0, 0.3, 0.0, 0.0, 0.0])
        planners[-1].tokens_per_ms = 2.0  # a verified position costs 0.2 tokens
    for _ in range(5000):
        accepted = int(np.argmin(np.append(rng.random(4) < truth, False)))
        for planner in planners:
            planner.observe_chain("r", 4, accepted)
    on, off = planners
    factors = np.array(on.acceptance.factors("greedy", 4))
    assert factors == pytest.approx(truth / 0.6, abs=0.15)
    assert off.acceptance.factors("greedy", 4) == [1.0] * 4
    (measured, priced, n), (_, geometric_priced, _) = (p.acceptance.by_length[4] for p in planners)
    assert priced / measured == pytest.approx(1.0, abs=0.03)
    assert geometric_priced / measured < 0.9  # 1.31 of 1.51 a chain
    assert on.keep("r", 4) == 2 and off.keep("r", 4) == 3
    reach = np.cumprod(np.minimum(0.6 * factors, 0.995))

    def worth(k: int) -> float:  # the brute force: tokens of the drafts kept, k rounds paid
        verified = min(k, 2)
        return (1 + reach[:verified].sum()) / on.step_ms(1 + verified, k, 1)

    assert on.choose(["r"]) == max(range(5), key=worth)


def test_two_steps_in_every_measure_off_every_draft_nothing_and_measure_drafting() -> None:
    """Steps that all draft cannot tell what drafting at all adds to a step (s0 + s_row B)
    from the intercept and the row term; two steps at k = 0 now and then (free with the
    plugin) measure it. Here drafting at all costs 14 ms at 8 rows, which the prior puts at
    1: the planner learns it and stops drafting, where rounds alone would pay."""
    truth = np.array([6.0, 0.02, 0.0, 0.3, 0.5, 0.02, 2.0, 1.5])
    prior = truth.copy()
    prior[[6, 7]] = [0.2, 0.1]
    planner = StepPlanner(
        4, PlannerConfig(measure_off_every=16, unlock_every=0), Priors(rates={"greedy": 0.7})
    )
    planner.cost.anchor(prior)
    rows = [f"r{i}" for i in range(8)]
    assert planner.choose(rows) > 0  # priced with the prior: drafting pays
    chosen, last = [], 0
    for _ in range(400):
        k = planner.choose(rows)
        chosen.append(k)
        positions = 8 * (1 + last)
        x = features(positions, k, 8, 0.0)
        planner.observe_step(positions, k, 8, float(x @ truth))
        last = k
    assert chosen[14:16] == [0, 0] and planner.measured_off >= 2  # choices 16 and 17
    drafting = planner.step_ms(40, 4, 8) - planner.step_ms(8, 0, 8)
    want = (features(40, 4, 8) - features(8, 0, 8)) @ truth
    # learnt from the prior's 1 ms (once it stops drafting, nothing tells the rounds' terms
    # from the drafting terms: a k it no longer runs may be priced above what it costs)
    assert 0.9 * want < drafting < 1.5 * want
    assert planner.step_ms(8, 0, 8) == pytest.approx(features(8, 0, 8) @ truth, rel=0.05)
    assert all(k == 0 for k in chosen[-50:])
    assert "steps held at 0 to measure drafting" in planner.report()


def test_the_row_and_drafting_terms_can_be_held_at_zero() -> None:
    held = StepPlanner(4, PlannerConfig(row_terms=False, measure_off_every=0))
    assert held.theta[[3, 6, 7]].tolist() == [0.0, 0.0, 0.0]
    for rows, k in ((1, 0), (8, 2), (4, 4)) * 50:
        held.observe_step(rows * (1 + k), k, rows, 20.0)
    assert held.theta[[3, 6, 7]] == pytest.approx([0.0, 0.0, 0.0], abs=1e-6)
    assert held.measured_off == 0


def test_a_planner_sitting_at_zero_drafts_two_steps_in_every_unlock_every() -> None:
    """A model that drifted against drafting (here a draft round believed to cost 50 ms)
    chooses 0 and measures nothing that would correct it; every unlock_every-th choice of 0 in
    a row drafts the best k >= 1 instead, for two steps: the first's draft pass also catches
    up the skipped steps (the scheduler does not fit its time), the second's time is what a
    drafted step costs. Off (0): never."""
    for every in (32, 0):
        planner = StepPlanner(4, PlannerConfig(unlock_every=every), Priors(rates={"greedy": 0.7}))
        planner.theta = planner.theta + np.eye(8)[4] * (50.0 - planner.theta[4])  # every band
        rows = ["a", "b"]
        chosen = [planner.choose(rows) for _ in range(100)]
        drafted = [i for i, k in enumerate(chosen) if k > 0]
        if every:
            assert drafted == [31, 32, 64, 65, 97, 98] and planner.unlocked == 6
            assert {chosen[i] for i in drafted} == {1}  # the best k >= 1 at that price
        else:
            assert drafted == [] and planner.unlocked == 0


def _decode(planner: StepPlanner, steps: int, noisy: int, rows: int = 8) -> np.ndarray:
    """``steps`` decode steps of ``rows`` rows, the k of each step the planner's; a step costs
    the truth below, verifying what the step before drafted, except that drafted steps among
    the first ``noisy`` take 5x as long (a noisy start: first forwards at new shapes, the
    host stalling). As the scheduler does, the first drafted step after a step at 0 is not
    fitted (its draft pass also catches up the skipped tokens)."""
    truth = np.array([7.0, 0.085, 0.0, 0.1, 0.9, 0.05, 0.25, 0.1])  # online_step_cost.TERMS
    ids = [f"r{i}" for i in range(rows)]
    chosen, last = [], 0
    for step in range(steps):
        k = planner.choose(ids)
        positions = rows * (1 + last)
        ms = float(features(positions, k, rows) @ truth)
        if k > 0 and step < noisy:
            ms *= 5.0
        catch_up = k > 0 and last == 0
        planner.observe_step(positions, k, rows, ms, tokens=rows, decode=not catch_up)
        chosen.append(k)
        last = k
    return np.array(chosen)


def test_a_planner_misled_by_a_slow_start_drafts_again_sooner_when_it_unlocks() -> None:
    """Drafted steps that were slow at the start (5x, the first 250 steps) price drafting
    above what it pays, and steps at 0 measure nothing that corrects it: without unlock_every
    the planner stops drafting soon after the noise and sits at 0 to the end; with it, the
    pairs of drafted steps measure drafting at its true cost and the planner is drafting by
    choice again in most of the last 500 of 2000 steps (without, forgetting alone brings it
    back after about 2,700). (Since the fit applies steps 16 at a time and a pricing serves up to 8
    steps, 100 noisy steps no longer mislead it at all; since the choice counts only the
    drafts the marginal rule keeps, 200 do not either.)"""
    for every in (0, 32):
        planner = StepPlanner(4, PlannerConfig(unlock_every=every), Priors(rates={"greedy": 0.6}))
        chosen = _decode(planner, 2000, noisy=250)
        after, late = (float(np.mean(chosen[a:b] > 0)) for a, b in ((250, 1250), (1500, 2000)))
        if every:
            assert late > 0.8
        else:
            assert after < 0.1 and late == 0.0
