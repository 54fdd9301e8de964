"""Speed of the oracle's arithmetic (jobs.bench_oracle): U(i, k, a) from bitmask unions and the
Bellman DP, timed on synthetic extraction tables of a given routing shape, for the work a job
does per sequence: a U table per (acceptance, draw) of junk tails (surrogate and sampling two
draws each, greedy one), then the DP for every Lmax of the sweep, every acceptance, with and
without the plain step, in-sample and cross-fitted (pipeline.oracle.fanout.solve_sequence)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pipeline.cost.model import CostModel
from pipeline.oracle.expert_union import bitmasks, mean_popcount, union_table_shared
from pipeline.oracle.fanout import solve_sequence
from pipeline.oracle.inputs import SequenceInput

# The (acceptance, draw) pairs of a default extraction (greedy tails are deterministic).
TAIL_SETS = (("surrogate", 0), ("surrogate", 1), ("greedy", 0), ("sampling", 0), ("sampling", 1))


@dataclass(frozen=True)
class SyntheticSequence:
    tokens: np.ndarray  # [N + 1, layers, top_k] routing of the reference tokens
    tails: list[np.ndarray]  # per TAIL_SETS entry: [cells, layers, top_k] tail-token routing
    start: np.ndarray  # [cells] divergence point s of each tail token
    offset: np.ndarray  # [cells] its position r = 1..Lmax after s
    p_tok: np.ndarray  # [N + 1] draft probabilities of the reference (NaN for x_0)
    pi_tok: np.ndarray  # [N + 1] target probabilities of the reference (NaN for x_0)


@dataclass(frozen=True)
class OracleBenchResult:
    sequences: int
    tokens: int
    lmax: int
    tail_tokens: int
    seconds_union: float
    seconds_dp: float
    solves: int  # (Lmax, acceptance, plain step) configurations per sequence

    @property
    def states(self) -> int:
        return self.sequences * self.tokens


def _routing(rng: np.random.Generator, rows: int, layers: int, experts: int, top_k: int):
    scores = rng.random((rows, layers, experts))
    return np.argsort(scores, axis=-1)[..., :top_k].astype(np.int16)


def synthetic_sequences(
    rng: np.random.Generator,
    sequences: int,
    tokens: int,
    lmax: int,
    layers: int,
    experts: int,
    top_k: int,
) -> list[SyntheticSequence]:
    """Random routing and acceptance, with every cell (s, r) an extraction at ``lmax`` has."""
    n = tokens
    out = []
    for _ in range(sequences):
        routing = _routing(rng, n + 1, layers, experts, top_k)
        s = np.repeat(np.arange(n), [min(lmax, n - j) for j in range(n)])
        r = np.concatenate([np.arange(1, min(lmax, n - j) + 1) for j in range(n)])
        tails = [_routing(rng, len(s), layers, experts, top_k) for _ in TAIL_SETS]
        p_tok = np.concatenate([[np.nan], rng.beta(3, 2, n)])
        pi_tok = np.concatenate([[np.nan], rng.beta(3, 2, n)])
        out.append(SyntheticSequence(routing, tails, s, r, p_tok, pi_tok))
    return out


def bench_oracle(
    sequences: int,
    tokens: int,
    lmax: int,
    layers: int = 6,
    experts: int = 32,
    top_k: int = 4,
    seed: int = 0,
) -> OracleBenchResult:
    """Time U(i, k, a) for every cell of every tail set, then the DP sweep with visitation and
    cross-fitting, over ``sequences`` synthetic sequences of ``tokens`` tokens, here."""
    rng = np.random.default_rng(seed)
    # A made-up but well-formed cost model: the DP's work does not depend on the prices.
    model = CostModel(
        {m: 5 + 0.2 * m for m in range(1, lmax + 2)},
        {m: 0.3 for m in range(1, lmax + 2)},
        0.001,
        0.5,
        0.1,
    )
    data = synthetic_sequences(rng, sequences, tokens, lmax, layers, experts, top_k)
    t0 = time.perf_counter()
    unions = []
    for d in data:
        token_masks = bitmasks(d.tokens, experts)
        unions.append(
            {
                key: union_table_shared(token_masks, bitmasks(t, experts), d.start, d.offset, lmax)
                for key, t in zip(TAIL_SETS, d.tails, strict=True)
            }
        )
    t_union = time.perf_counter() - t0
    lmaxes = list(range(1, lmax + 1))
    t0 = time.perf_counter()
    for j, (d, u) in enumerate(zip(data, unions, strict=True)):
        seq = SequenceInput(
            f"s{j}",
            "synthetic",
            100,
            d.p_tok,
            (d.p_tok > 0.5).astype(float),
            d.pi_tok,
            np.arange(tokens + 1),
            mean_popcount(bitmasks(d.tokens, experts)),
            d.tokens,
            u,
        )
        solve_sequence(seq, model, lmaxes, lmax)
    t_dp = time.perf_counter() - t0
    tail_tokens = sum(len(d.start) * len(TAIL_SETS) for d in data)
    return OracleBenchResult(
        sequences, tokens, lmax, tail_tokens, t_union, t_dp, len(lmaxes) * 3 * 2
    )


def format_oracle_bench(result: OracleBenchResult) -> str:
    r = result
    return "\n".join(
        [
            f"{r.sequences} sequences x {r.tokens} tokens, Lmax {r.lmax}: {r.states:,} states, "
            f"{r.tail_tokens:,} tail tokens",
            f"U(i,k,a) for every cell of {len(TAIL_SETS)} tail sets: {r.seconds_union:.2f}s "
            f"({r.seconds_union / r.sequences * 1e3:.1f} ms/seq)",
            f"DP + visitation + cross-fitting, {r.solves} configurations (Lmax 1..{r.lmax} x 3 "
            f"acceptances x plain step on/off): {r.seconds_dp:.2f}s "
            f"({r.seconds_dp / r.sequences * 1e3:.1f} ms/seq)",
            f"total {r.seconds_union + r.seconds_dp:.2f}s in one process (Ray tasks split it over "
            "cores)",
        ]
    )
