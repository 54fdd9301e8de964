"""The Bellman oracle against brute force (values, policies and visitation), the plain step
(k = 0) that makes the bound >= 1, the three acceptance rules, and cross-fitting."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pipeline.cost.model import CostModel
from pipeline.oracle.bellman import (
    acceptance_table,
    ar_cost,
    available,
    cost_table,
    evaluate_policy,
    solve,
    solve_many,
)
from pipeline.oracle.fanout import crossfit_value
from pipeline.oracle.inputs import ACCEPTANCE_MODES, acceptance_probs


def _model(lmax: int, alpha: float = 0.3, beta_slope: float = 0.2) -> CostModel:
    ms = range(1, lmax + 2)
    return CostModel({m: 5.0 + beta_slope * m for m in ms}, {m: alpha for m in ms}, 0.001, 0.5, 0.1)


def _union(rng, n, lmax, token_experts=None):
    """A random U table [N, lmax + 1, lmax + 1]; U(i, 0, 0) = ``token_experts[i]``."""
    base = rng.uniform(2, 4, size=(n, 1, 1))
    grow = np.arange(lmax + 1)[None, None, :] + np.arange(lmax + 1)[None, :, None]
    out = base + grow * rng.uniform(0.5, 1.5, (n, lmax + 1, lmax + 1))
    if token_experts is not None:
        out[:, 0, 0] = token_experts[:n]
    return out


def _r(rng, n, mode):
    """Per-position acceptance of ``mode`` from random draft / target probabilities."""
    q = np.concatenate([[np.nan], rng.uniform(0, 1, n)])
    pi = np.concatenate([[np.nan], rng.uniform(0.01, 1, n)])
    match = np.concatenate([[0.0], (rng.uniform(0, 1, n) < 0.6).astype(float)])
    return acceptance_probs(mode, q, match, pi)


def _policies(n, lmax, plain_step):
    ok = available(n, lmax, plain_step)
    return itertools.product(*[np.flatnonzero(ok[i]).tolist() for i in range(n)])


def _direct_value(probs, cost, policy):
    """Plain recursion over outcomes (no vectorisation), to check evaluate_policy itself."""
    n = probs.shape[0]

    def value(i):
        if i >= n:
            return 0.0
        k = policy[i]
        return sum(
            probs[i, k, a] * (cost[i, k, a] + value(min(i + a + 1, n))) for a in range(k + 1)
        )

    return value(0)


def _direct_visits(probs, policy):
    """Probability that the policy ever stands at each state, by enumerating every path."""
    n = probs.shape[0]
    visits = np.zeros(n + 1)

    def walk(i, p):
        visits[i] += p
        if i < n:
            k = policy[i]
            for a in range(k + 1):
                if probs[i, k, a] > 0:
                    walk(min(i + a + 1, n), p * probs[i, k, a])

    walk(0, 1.0)
    return visits


@pytest.mark.parametrize("mode", ACCEPTANCE_MODES)
@pytest.mark.parametrize("plain_step", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_dp_equals_brute_force_over_all_policies(seed, plain_step, mode):
    rng = np.random.default_rng(seed)
    n, lmax = 6, 3
    probs = acceptance_table(_r(rng, n, mode), lmax, plain_step)
    cost = cost_table(_model(lmax, alpha=rng.uniform(0, 1)), _union(rng, n, lmax), 50)
    sol = solve(probs, cost)
    values = {pol: _direct_value(probs, cost, pol) for pol in _policies(n, lmax, plain_step)}
    best = min(values, key=values.get)
    assert sol.dp[0] == pytest.approx(values[best], rel=1e-12)
    assert values[tuple(sol.k_star)] == pytest.approx(sol.dp[0], rel=1e-12)
    assert (sol.k_star >= (0 if plain_step else 1)).all()
    # The forward visitation is the probability of reaching each state along k*.
    np.testing.assert_allclose(sol.visit, _direct_visits(probs, sol.k_star), atol=1e-12)
    for pol in list(values)[:: max(1, len(values) // 20)]:
        assert evaluate_policy(probs, cost, np.array(pol))[0] == pytest.approx(values[pol])


def test_acceptance_table_is_a_distribution_matching_the_formula():
    r = np.array([np.nan, 0.9, 0.5, 0.2, 0.7])
    n, lmax = 4, 3
    for plain_step in (True, False):
        probs = acceptance_table(r, lmax, plain_step)
        assert probs.shape == (n, lmax + 1, lmax + 1)
        for i in range(n):
            assert probs[i, 0].tolist() == ([1.0, 0, 0, 0] if plain_step else [0.0] * 4)
            for k in range(1, lmax + 1):
                row = probs[i, k]
                if k > n - i:
                    assert (row == 0).all()
                    continue
                assert row.sum() == pytest.approx(1.0)
                window = r[i + 1 : i + 1 + k]
                for a in range(k):
                    assert row[a] == pytest.approx(np.prod(window[:a]) * (1 - window[a]))
                assert row[k] == pytest.approx(np.prod(window))


def test_acceptance_rules():
    q = np.array([np.nan, 0.3, 0.8, 0.5])
    pi = np.array([np.nan, 0.6, 0.4, 0.0])
    match = np.array([0.0, 1.0, 0.0, 1.0])
    assert acceptance_probs("surrogate", q, match, pi)[1:].tolist() == [0.3, 0.8, 0.5]
    assert acceptance_probs("greedy", q, match, pi)[1:].tolist() == [1.0, 0.0, 1.0]
    # min(1, q / pi); a token the target never emits is always accepted.
    assert acceptance_probs("sampling", q, match, pi)[1:].tolist() == [0.5, 1.0, 1.0]
    with pytest.raises(ValueError, match="target_prob"):
        acceptance_probs("sampling", q, match, np.full(4, np.nan))


@pytest.mark.parametrize("mode", ACCEPTANCE_MODES)
def test_plain_step_makes_the_bound_at_least_one(mode):
    """dp[i] <= Cost(i, 0, 0) + dp[i + 1] at every state, and summing the plain steps is the
    AR cost (U(i, 0, 0) = |E(i)|), so Cost_AR / dp[0] >= 1 whatever the prices."""
    for seed in range(20):
        rng = np.random.default_rng(seed)
        n, lmax = int(rng.integers(1, 30)), int(rng.integers(1, 7))
        experts = rng.uniform(1, 8, n + 1)
        # Steep prices for verifying more positions: speculation often does not pay.
        model = _model(lmax, alpha=rng.uniform(0, 3), beta_slope=rng.uniform(0, 5))
        cost = cost_table(model, _union(rng, n, lmax, experts), 40)
        probs = acceptance_table(_r(rng, n, mode), lmax)
        ar = ar_cost(model, experts, 40)
        assert evaluate_policy(probs, cost, np.zeros(n, int))[0] == pytest.approx(ar, rel=1e-12)
        sol = solve(probs, cost)
        assert ar / sol.dp[0] >= 1 - 1e-12
        assert (sol.dp[:-1] <= cost[np.arange(n), 0, 0] + sol.dp[1:] + 1e-9).all()


def test_hopeless_draft_plain_step_everywhere_and_the_papers_bound_below_one():
    rng = np.random.default_rng(0)
    n, lmax = 12, 5
    experts = np.full(n + 1, 3.0)
    model = _model(lmax)
    cost = cost_table(model, _union(rng, n, lmax, experts), 30)
    ar = ar_cost(model, experts, 30)
    sol = solve(acceptance_table(np.zeros(n + 1), lmax), cost)
    assert (sol.k_star == 0).all() and sol.dp[0] == pytest.approx(ar)
    paper = solve(acceptance_table(np.zeros(n + 1), lmax, plain_step=False), cost)
    assert (paper.k_star == 1).all() and ar / paper.dp[0] < 1
    np.testing.assert_allclose(paper.visit[:-1], np.ones(n))  # every state, one at a time


def test_bound_never_decreases_with_lmax_and_one_pass_solves_every_lmax():
    rng = np.random.default_rng(1)
    n, lmax = 40, 8
    for plain_step in (True, False):
        r = np.concatenate([[np.nan], rng.uniform(0.3, 0.99, n)])
        probs = acceptance_table(r, lmax, plain_step)
        cost = cost_table(_model(lmax), _union(rng, n, lmax), 100)
        sliced = [
            solve(probs[:, : L + 1, : L + 1], cost[:, : L + 1, : L + 1]) for L in range(1, lmax + 1)
        ]
        dp0 = [s.dp[0] for s in sliced]
        assert all(b <= a + 1e-9 for a, b in zip(dp0, dp0[1:], strict=False))
        assert dp0[-1] < dp0[0] - 1e-6  # not vacuous: longer chains pay here
        many_lmaxes = solve_many(probs, cost, list(range(1, lmax + 1)))
        for L, one, many in zip(range(1, lmax + 1), sliced, many_lmaxes, strict=True):
            np.testing.assert_allclose(many.dp, one.dp, rtol=1e-12)
            np.testing.assert_array_equal(many.k_star, one.k_star)
            np.testing.assert_allclose(many.visit, one.visit, atol=1e-12)
            np.testing.assert_allclose(many.q[:, : L + 1], one.q, rtol=1e-12)
            assert np.isinf(many.q[:, L + 1 :]).all()
        schedules = np.stack([s.k_star for s in sliced])
        np.testing.assert_allclose(evaluate_policy(probs, cost, schedules)[:, 0], dp0)


def test_evaluate_policy_rejects_unavailable_budgets():
    rng = np.random.default_rng(3)
    n, lmax = 5, 3
    cost = cost_table(_model(lmax), _union(rng, n, lmax), 10)
    probs = acceptance_table(np.full(n + 1, 0.5), lmax, plain_step=False)
    with pytest.raises(ValueError, match="unavailable budget k = 0 at state 0"):
        evaluate_policy(probs, cost, np.zeros(n, int))
    with pytest.raises(ValueError, match="k = 3 at state 3"):
        evaluate_policy(probs, cost, np.full(n, 3))


@pytest.mark.parametrize("mode", ["sampling", "surrogate"])
def test_in_sample_bound_beats_every_schedule_on_the_same_draw(mode):
    rng = np.random.default_rng(7)
    n, lmax = 40, 6
    q = np.concatenate([[np.nan], rng.uniform(0, 1, n)])
    probs = acceptance_table(acceptance_probs(mode, q, q > 0.5, np.full(n + 1, 0.6)), lmax)
    cost = cost_table(_model(lmax), _union(rng, n, lmax), 20)
    dp0 = solve(probs, cost).dp[0]
    left = n - np.arange(n)
    schedules = [np.minimum(k, left) for k in range(lmax + 1)]
    # A state-dependent chain rule: draft while the draft's confidence stays >= 0.5.
    run = [
        next((j for j in range(lmax) if i + 1 + j > n or q[i + 1 + j] < 0.5), lmax)
        for i in range(n)
    ]
    schedules.append(np.minimum(run, left))
    for k_policy in schedules:
        assert dp0 <= evaluate_policy(probs, cost, k_policy)[0] + 1e-9


def test_cross_fitting_brackets_the_true_optimum():
    """Tails are random draws around a mean U; values are linear in U, so the true value of a
    schedule is its value at the mean U and the true optimum V* solves there. In expectation
    the in-sample optimum is below V* (optimistic) and the cross-fitted value above it."""
    rng = np.random.default_rng(11)
    n, lmax, draws = 10, 4, 400
    probs = acceptance_table(np.concatenate([[np.nan], rng.uniform(0.3, 0.9, n)]), lmax)
    mean_u = _union(rng, n, lmax)
    model = _model(lmax, alpha=1.0)
    v_star = solve(probs, cost_table(model, mean_u, 10)).dp[0]
    noisy = lambda: mean_u + rng.normal(0, 1.5, mean_u.shape)  # noqa: E731
    in_sample, cross = [], []
    for _ in range(draws // 2):
        costs = [cost_table(model, noisy(), 10) for _ in range(2)]
        sols = [solve(probs, c) for c in costs]
        in_sample.append(np.mean([s.dp[0] for s in sols]))
        cross.append(crossfit_value(probs, costs, sols))
    se = np.std(in_sample) / np.sqrt(len(in_sample))
    assert np.mean(in_sample) < v_star - 3 * se
    assert np.mean(cross) > v_star - 3 * np.std(cross) / np.sqrt(len(cross))
    assert np.mean(cross) > np.mean(in_sample) + 3 * se
    assert crossfit_value(probs, costs[:1], sols[:1]) is None
