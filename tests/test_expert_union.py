"""Vectorised U(i, k, a) against a direct set computation, and per-acceptance tails read from
extraction-shaped tables."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from pipeline.data.schemas import (
    SEQUENCES_SCHEMA,
    TAILS_SCHEMA,
    TOKENS_SCHEMA,
    experts_array,
    experts_to_numpy,
)
from pipeline.models.adapters import MoESpec
from pipeline.oracle.expert_union import (
    bitmasks,
    union_table_paper,
    union_table_shared,
)
from pipeline.oracle.union_from_tables import sequence_union_table, tail_draws

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
    assert got.shape == got_paper.shape == (n, lmax + 1, lmax + 1)
    for i in range(n):
        for k in range(lmax + 1):  # k = 0: the plain step verifies x_i alone
            for a in range(lmax + 1):
                if k > n - i or a > k:
                    assert np.isnan(got[i, k, a]) and np.isnan(got_paper[i, k, a])
                    continue
                want = _direct_u(tokens, lambda i, k, a: shared[i + a], i, k, a)
                assert got[i, k, a] == pytest.approx(want)
                want = _direct_u(tokens, lambda i, k, a: paper[(i, k, a)], i, k, a)
                assert got_paper[i, k, a] == pytest.approx(want)
        plain = np.mean([len(set(tokens[i, layer].tolist())) for layer in range(LAYERS)])
        assert got[i, 0, 0] == got_paper[i, 0, 0] == plain
    # Shared tails are prefix-consistent: U never shrinks as k grows with a fixed.
    diffs = np.diff(got, axis=1)
    assert (diffs[~np.isnan(diffs)] >= 0).all()


def test_experts_column_round_trip():
    routing = _random_routing(np.random.default_rng(0), 5, 16)
    assert np.array_equal(experts_to_numpy(experts_array(routing), LAYERS, TOP_K), routing)


def synthetic_tables(
    rng,
    seq_id: str,
    n: int,
    lmax: int,
    num_experts: int = 16,
    draws: dict[str, int] | None = None,
    category: str = "code",
):
    """Extraction-shaped Arrow tables (sequences, tokens, tails) for one sequence, with shared
    tails for every (acceptance, draw) in ``draws``; also the routing of tokens and tails."""
    draws = draws or {"surrogate": 2, "greedy": 1, "sampling": 2}
    routing = _random_routing(rng, n + 1, num_experts)
    q = rng.uniform(0.05, 1, n)
    tokens = pa.table(
        {
            "seq_id": [seq_id] * (n + 1),
            "t": np.arange(n + 1, dtype=np.int32),
            "token_id": rng.integers(0, 100, n + 1).astype(np.int32),
            "draft_prob": pa.array([None, *q.tolist()], pa.float32()),
            "draft_match": pa.array([None, *(q > 0.5).tolist()], pa.bool_()),
            "target_prob": pa.array([None, *rng.uniform(0.05, 1, n).tolist()], pa.float32()),
            "experts": experts_array(routing),
        },
        schema=TOKENS_SCHEMA,
    )
    tails, rows = {}, []
    for acc, count in draws.items():
        for d in range(count):
            for s in range(n):
                length = min(lmax, n - s)
                tails[(acc, d, s)] = _random_routing(rng, length, num_experts)
                rows += [(acc, d, s, r) for r in range(1, length + 1)]
    flat = np.concatenate([tails[(acc, d, s)][r - 1][None] for acc, d, s, r in rows])
    tails_table = pa.table(
        {
            "seq_id": [seq_id] * len(rows),
            "mode": ["shared"] * len(rows),
            "acceptance": [r[0] for r in rows],
            "draw": pa.array([r[1] for r in rows], pa.int32()),
            "s": pa.array([r[2] for r in rows], pa.int32()),
            "r": pa.array([r[3] for r in rows], pa.int32()),
            "token_id": pa.array(np.zeros(len(rows)), pa.int32()),
            "experts": experts_array(flat),
            "i": pa.nulls(len(rows), pa.int32()),
            "k": pa.nulls(len(rows), pa.int32()),
            "a": pa.nulls(len(rows), pa.int32()),
        },
        schema=TAILS_SCHEMA,
    )
    sequences = pa.table(
        {
            "seq_id": [seq_id],
            "category": [category],
            "prompt_len": pa.array([7], pa.int32()),
            "n_tokens": pa.array([n], pa.int32()),
            "source": ["synthetic"],
            "prompt_ids": pa.array([[1, 2, 3, 4, 5, 6, 7]], pa.list_(pa.int32())),
        },
        schema=SEQUENCES_SCHEMA,
    )
    return sequences, tokens, tails_table, routing, tails


def test_union_from_tables_prices_each_acceptance_with_its_own_tails():
    rng = np.random.default_rng(5)
    n, lmax = 7, 3
    spec = MoESpec("synthetic", tuple(range(LAYERS)), 16, TOP_K, False)
    _, tokens, tails, routing, raw = synthetic_tables(rng, "s0", n, lmax)
    assert tail_draws(tails) == {"greedy": [0], "sampling": [0, 1], "surrogate": [0, 1]}
    for acc, d in [("surrogate", 0), ("surrogate", 1), ("greedy", 0), ("sampling", 1)]:
        got = sequence_union_table(tokens, tails, spec, lmax, acc, d)
        for i in range(n):
            for k in range(min(lmax, n - i) + 1):
                for a in range(k + 1):
                    tail = raw.get((acc, d, i + a))  # none at s = N (a = k only)
                    want = _direct_u(routing, lambda i, k, a, tail=tail: tail, i, k, a)
                    assert got[i, k, a] == pytest.approx(want)
    with pytest.raises(ValueError, match="name the one to price"):
        sequence_union_table(tokens, tails, spec, lmax)
    with pytest.raises(ValueError, match="no greedy tails of draw 1"):
        sequence_union_table(tokens, tails, spec, lmax, "greedy", 1)
