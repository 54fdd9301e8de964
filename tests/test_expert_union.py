"""Vectorised U(i, k, a) against a direct set computation."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.data.schemas import experts_array, experts_to_numpy
from pipeline.oracle.expert_union import (
    bitmasks,
    union_table_paper,
    union_table_shared,
)

LAYERS, TOP_K = 3, 2


def _random_routing(rng, rows, num_experts):
    return np.stack(
        [
            np.stack(
                [np.sort(rng.choice(num_experts, TOP_K, replace=False)) for _ in range(LAYERS)]
            )
            for _ in range(rows)
        ]
    ).astype(np.int16)


def _direct_u(tokens, tail_of, i, k, a):
    sets = []
    for layer in range(LAYERS):
        experts = set()
        for t in range(i, i + a + 1):
            experts |= set(tokens[t, layer].tolist())
        if a < k:
            for row in tail_of(i, k, a)[: k - a]:
                experts |= set(row[layer].tolist())
        sets.append(len(experts))
    return np.mean(sets)


@pytest.mark.parametrize("num_experts", [16, 100])  # one and two bitmask words
def test_shared_and_paper_unions_equal_direct_sets(num_experts):
    rng = np.random.default_rng(num_experts)
    n, lmax = 9, 4
    tokens = _random_routing(rng, n + 1, num_experts)
    shared = {s: _random_routing(rng, min(lmax, n - s), num_experts) for s in range(n)}
    s_idx = np.concatenate([[s] * len(t) for s, t in shared.items()])
    r_idx = np.concatenate([np.arange(1, len(t) + 1) for t in shared.values()])
    flat = np.concatenate(list(shared.values()))
    got = union_table_shared(
        bitmasks(tokens, num_experts), bitmasks(flat, num_experts), s_idx, r_idx, lmax
    )
    paper = {
        (i, k, a): _random_routing(rng, k - a, num_experts)
        for i in range(n)
        for k in range(1, min(lmax, n - i) + 1)
        for a in range(k)
    }
    cells = np.array(list(paper))
    lens = [len(v) for v in paper.values()]
    got_paper = union_table_paper(
        bitmasks(tokens, num_experts),
        bitmasks(np.concatenate(list(paper.values())), num_experts),
        np.repeat(cells[:, 0], lens),
        np.repeat(cells[:, 1], lens),
        np.repeat(cells[:, 2], lens),
        lmax,
    )
    for i in range(n):
        for k in range(1, lmax + 1):
            for a in range(lmax + 1):
                if k > n - i or a > k:
                    assert np.isnan(got[i, k - 1, a]) and np.isnan(got_paper[i, k - 1, a])
                    continue
                want = _direct_u(tokens, lambda i, k, a: shared[i + a], i, k, a)
                assert got[i, k - 1, a] == pytest.approx(want)
                want = _direct_u(tokens, lambda i, k, a: paper[(i, k, a)], i, k, a)
                assert got_paper[i, k - 1, a] == pytest.approx(want)
    # Shared tails are prefix-consistent: U never shrinks as k grows with a fixed.
    diffs = np.diff(got, axis=1)
    assert (diffs[~np.isnan(diffs)] >= 0).all()


def test_experts_column_round_trip():
    routing = _random_routing(np.random.default_rng(0), 5, 16)
    assert np.array_equal(experts_to_numpy(experts_array(routing), LAYERS, TOP_K), routing)
