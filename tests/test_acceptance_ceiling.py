"""The informed ceiling (pipeline/acceptance/ceiling.py): its solve is the best of every
position-by-position plan (brute force), it never loses to a fixed K, it gains nothing when
acceptance is the same everywhere and far from trivial edges, and the job runs end to end."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pipeline.acceptance.ceiling import ceiling, expected_cost


def _step(k: int, t: int) -> float:
    return 1.0 + 0.3 * k + 0.05 * t  # a draft token costs 0.3 of a plain step


def _cost_of_plan(acc: np.ndarray, plan: tuple[int, ...]) -> float:
    """Expected cost of drafting plan[t] at position t, by enumerating the outcomes."""

    def go(t: int) -> float:
        if t >= len(acc):
            return 0.0
        k = min(plan[t], len(acc) - t)
        total, survive = _step(k, t), 1.0
        for j in range(k):
            total += survive * (1 - acc[t + j]) * go(t + j + 1)
            survive *= acc[t + j]
        return total + survive * go(t + k + 1)

    return go(0)


def test_the_solve_is_the_best_plan_by_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(5):
        acc = rng.uniform(0.05, 0.95, 5)
        brute = min(_cost_of_plan(acc, plan) for plan in itertools.product(range(4), repeat=5))
        assert expected_cost(acc, _step, 3) == pytest.approx(brute)
        assert expected_cost(acc, _step, 3, fixed=2) == pytest.approx(_cost_of_plan(acc, (2,) * 5))


def test_the_ceiling_never_loses_to_fixed_and_gains_little_at_constant_acceptance():
    rng = np.random.default_rng(1)
    varied = [rng.choice([0.1, 0.95], 60) for _ in range(3)]
    res = ceiling(varied, lambda i: _step, 6, [1, 2, 3, 4])
    assert all(res.clairvoyant <= c + 1e-9 for c in res.fixed.values())
    assert res.gain_over_best_fixed > 1.05  # knowing where acceptance drops pays
    # Prices that do not move along the text: the best fixed K is the best stationary plan.
    flat = ceiling([np.full(200, 0.7)], lambda i: lambda k, t: 1.0 + 0.3 * k, 6, [1, 2, 3, 4, 5, 6])
    assert 1.0 <= flat.gain_over_best_fixed < 1.01  # only the text's end differs


@pytest.mark.slow
def test_ceiling_job_end_to_end(tmp_path, capsys):
    from jobs.acceptance_ceiling import main

    traces = tmp_path / "t.npz"
    args = [
        "--limit",
        "1",
        "--max-new-tokens",
        "6",
        "--temperatures",
        "0,1",
        "--max-k",
        "3",
        "--fixed",
        "1,2",
        "--traces",
        str(traces),
        "--trees",
        "eagle2:b=2",
    ]
    results = main(args)
    assert set(results) == {(d, t) for d in ("code", "prose", "math") for t in (0.0, 1.0)}
    assert all(r.gain_over_best_fixed >= 1.0 - 1e-9 for r in results.values())
    for r in results.values():
        # The tree solve's chains-only ceiling and best fixed K are the chain ceiling's; more
        # actions never cost more.
        assert r.tree.chain == pytest.approx(r.clairvoyant)
        assert r.tree.best_fixed == pytest.approx(r.fixed[r.best_k])
        assert r.tree.chain_or_tree <= min(r.tree.chain, r.tree.tree) + 1e-9
    # At T = 1 only: one position's acceptance with 1 .. 4 candidates, each kind per domain,
    # then the chains-or-leaves ceilings, never below the chains' (more actions).
    first, leaves = capsys.readouterr().out.split("one position's acceptance")[1].split("\n\n")[:2]
    domains = ("code", "prose", "math")
    rows = [line.split() for line in first.splitlines() if line.startswith(domains)]
    assert len(rows) == 6 and all(row[1] == "1" for row in rows)
    for row in rows:
        values = [float(v) for v in row[-4:]]
        assert values == sorted(values) and values[0] >= 0.0 and values[-1] <= 1.0
    rows = [line.split() for line in leaves.splitlines() if line.startswith(domains)]
    assert len(rows) == 3
    for row in rows:
        chains, *widths = (float(v.rstrip("x")) for v in row[2:6])
        assert len(widths) == 3 and min(widths) >= chains - 1e-9
    again = main(args)  # read back from the saved traces (their texts too)
    assert {k: r.clairvoyant for k, r in again.items()} == pytest.approx(
        {k: r.clairvoyant for k, r in results.items()}
    )
    assert {k: r.tree.chain_or_tree for k, r in again.items()} == pytest.approx(
        {k: r.tree.chain_or_tree for k, r in results.items()}
    )
