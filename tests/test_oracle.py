"""The Bellman oracle against brute force, and its structural properties."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pipeline.cost.model import CostModel
from pipeline.oracle.bellman import acceptance_table, cost_table, evaluate_policy, solve


def _model(lmax: int, alpha: float = 0.3) -> CostModel:
    ms = range(1, lmax + 2)
    return CostModel({m: 5.0 + 0.2 * m for m in ms}, {m: alpha for m in ms}, 0.001, 0.5, 0.1)


def _union(rng, n, lmax):
    base = rng.uniform(2, 4, size=(n, 1, 1))
    grow = np.arange(lmax + 1)[None, None, :] + np.arange(lmax)[None, :, None]
    return base + grow * rng.uniform(0.5, 1.5, size=(n, lmax, lmax + 1))


def _brute_force(probs, cost):
    n, lmax, _ = probs.shape
    choices = [range(1, min(lmax, n - i) + 1) for i in range(n)]
    return min(
        evaluate_policy(probs, cost, np.array(policy))[0] for policy in itertools.product(*choices)
    )


def _direct_value(probs, cost, policy):
    """Plain recursion over outcomes (no vectorisation), to check evaluate_policy itself."""
    n = probs.shape[0]

    def value(i):
        if i >= n:
            return 0.0
        k = policy[i]
        return sum(
            probs[i, k - 1, a] * (cost[i, k - 1, a] + value(min(i + a + 1, n)))
            for a in range(k + 1)
        )

    return value(0)


@pytest.mark.parametrize("seed", range(6))
def test_dp_equals_brute_force_over_all_policies(seed):
    rng = np.random.default_rng(seed)
    n, lmax = 6, 3
    p = np.concatenate([[np.nan], rng.uniform(0, 1, n)])
    probs = acceptance_table(p, lmax)
    cost = cost_table(_model(lmax, alpha=rng.uniform(0, 1)), _union(rng, n, lmax), 50)
    sol = solve(probs, cost)
    assert sol.dp[0] == pytest.approx(_brute_force(probs, cost), rel=1e-12)
    assert evaluate_policy(probs, cost, sol.k_star)[0] == pytest.approx(sol.dp[0])
    policy = np.array([rng.integers(1, min(lmax, n - i) + 1) for i in range(n)])
    assert evaluate_policy(probs, cost, policy)[0] == pytest.approx(
        _direct_value(probs, cost, policy)
    )


def test_acceptance_table_is_a_distribution_matching_the_formula():
    p = np.array([np.nan, 0.9, 0.5, 0.2, 0.7])
    probs = acceptance_table(p, 3)
    n = 4
    for i in range(n):
        for k in range(1, 4):
            row = probs[i, k - 1]
            if k > n - i:
                assert (row == 0).all()
                continue
            assert row.sum() == pytest.approx(1.0)
            window = p[i + 1 : i + 1 + k]
            for a in range(k):
                assert row[a] == pytest.approx(np.prod(window[:a]) * (1 - window[a]))
            assert row[k] == pytest.approx(np.prod(window))


def test_hopeless_draft_means_k_star_is_one_everywhere():
    rng = np.random.default_rng(0)
    n, lmax = 12, 5
    probs = acceptance_table(np.zeros(n + 1), lmax)
    sol = solve(probs, cost_table(_model(lmax), _union(rng, n, lmax), 30))
    assert (sol.k_star == 1).all()
    assert sol.visit[:-1] == pytest.approx(np.ones(n))  # every state visited, one at a time


def test_bound_never_decreases_with_lmax():
    rng = np.random.default_rng(1)
    n, lmax = 40, 8
    p = np.concatenate([[np.nan], rng.uniform(0.3, 0.99, n)])
    probs = acceptance_table(p, lmax)
    cost = cost_table(_model(lmax), _union(rng, n, lmax), 100)
    dp0 = [solve(probs[:, :L, : L + 1], cost[:, :L, : L + 1]).dp[0] for L in range(1, lmax + 1)]
    assert all(b <= a + 1e-9 for a, b in zip(dp0, dp0[1:], strict=False))


def test_visitation_is_a_probability_flow():
    rng = np.random.default_rng(2)
    n, lmax = 30, 6
    p = np.concatenate([[np.nan], rng.uniform(0.2, 0.95, n)])
    sol = solve(acceptance_table(p, lmax), cost_table(_model(lmax), _union(rng, n, lmax), 10))
    assert sol.visit[0] == 1.0 and sol.visit[-1] == pytest.approx(1.0)
    assert 1.0 <= sol.mean_draft_length() <= lmax
