"""Speed of the oracle's arithmetic (jobs.bench_oracle): U(i, k, a) from bitmask unions and the
Bellman DP, timed on synthetic extraction tables of a given routing shape."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pipeline.cost.model import CostModel
from pipeline.oracle.bellman import acceptance_table, cost_table, solve
from pipeline.oracle.expert_union import bitmasks, union_table_shared


@dataclass(frozen=True)
class SyntheticSequence:
    tokens: np.ndarray  # [N + 1, layers, top_k] routing of the reference tokens
    tails: np.ndarray  # [cells, layers, top_k] routing of one junk-tail token per cell
    start: np.ndarray  # [cells] divergence point s of each tail token
    offset: np.ndarray  # [cells] its position r = 1..Lmax after s
    p_tok: np.ndarray  # [N + 1] draft acceptance probabilities (NaN for x_0)


@dataclass(frozen=True)
class OracleBenchResult:
    sequences: int
    tokens: int
    lmax: int
    tail_tokens: int
    seconds_union: float
    seconds_dp: float

    @property
    def states(self) -> int:
        return self.sequences * self.tokens


def _routing(rng: np.random.Generator, rows: int, layers: int, experts: int, top_k: int):
    scores = rng.random((rows, layers, experts))
    return np.argsort(scores, axis=-1)[..., :top_k].astype(np.int16)


def synthetic_sequences(
    rng: np.random.Generator, sequences: int, tokens: int, lmax: int, layers: int,
    experts: int, top_k: int,
) -> list[SyntheticSequence]:  # fmt: skip
    """Random routing and acceptance, with every cell (s, r) an extraction at ``lmax`` has."""
    n = tokens
    out = []
    for _ in range(sequences):
        routing = _routing(rng, n + 1, layers, experts, top_k)
        s = np.repeat(np.arange(n), [min(lmax, n - j) for j in range(n)])
        r = np.concatenate([np.arange(1, min(lmax, n - j) + 1) for j in range(n)])
        tails = _routing(rng, len(s), layers, experts, top_k)
        p_tok = np.concatenate([[np.nan], rng.beta(3, 2, n)])
        out.append(SyntheticSequence(routing, tails, s, r, p_tok))
    return out


def bench_oracle(
    sequences: int, tokens: int, lmax: int, layers: int = 6, experts: int = 32, top_k: int = 4,
    seed: int = 0,
) -> OracleBenchResult:  # fmt: skip
    """Time U(i, k, a) for every cell, then the DP with visitation, over ``sequences``
    synthetic sequences of ``tokens`` tokens, in this process."""
    rng = np.random.default_rng(seed)
    # A made-up but well-formed cost model: the DP's work does not depend on the prices.
    model = CostModel({m: 5 + 0.2 * m for m in range(1, lmax + 2)},
                      {m: 0.3 for m in range(1, lmax + 2)}, 0.001, 0.5, 0.1)  # fmt: skip
    data = synthetic_sequences(rng, sequences, tokens, lmax, layers, experts, top_k)
    t0 = time.perf_counter()
    unions = [
        union_table_shared(bitmasks(d.tokens, experts), bitmasks(d.tails, experts), d.start,
                           d.offset, lmax)
        for d in data
    ]  # fmt: skip
    t_union = time.perf_counter() - t0
    t0 = time.perf_counter()
    for d, union in zip(data, unions, strict=True):
        solve(acceptance_table(d.p_tok, lmax), cost_table(model, union, 100), union)
    t_dp = time.perf_counter() - t0
    return OracleBenchResult(sequences, tokens, lmax, sum(len(d.start) for d in data), t_union,
                             t_dp)  # fmt: skip


def format_oracle_bench(result: OracleBenchResult) -> str:
    r = result
    return "\n".join([
        f"{r.sequences} sequences x {r.tokens} tokens, Lmax {r.lmax}: {r.states:,} states, "
        f"{r.tail_tokens:,} tail tokens",
        f"U(i,k,a) for every cell: {r.seconds_union:.2f}s "
        f"({r.seconds_union / r.sequences * 1e3:.1f} ms/seq)",
        f"DP + visitation at Lmax {r.lmax}: {r.seconds_dp:.2f}s "
        f"({r.seconds_dp / r.sequences * 1e3:.1f} ms/seq)",
        f"total {r.seconds_union + r.seconds_dp:.2f}s in one process (Ray tasks split it over "
        "cores)",
    ])  # fmt: skip
