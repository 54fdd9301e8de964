"""Speed of the oracle's arithmetic: U(i, k, a) with bitmask unions and the Bellman DP for many
sequences, on synthetic extraction tables shaped like the embedded target (6 MoE layers, 32
experts, top-4), in one run.

    python -m jobs.bench_oracle --sequences 100 --tokens 512 --lmax 12
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pipeline.costmodel import CostModel
from pipeline.expert_union import bitmasks, union_table_shared
from pipeline.oracle import acceptance_table, cost_table, solve


def _routing(rng: np.random.Generator, rows: int, layers: int, experts: int, top_k: int):
    scores = rng.random((rows, layers, experts))
    return np.argsort(scores, axis=-1)[..., :top_k].astype(np.int16)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(prog="python -m jobs.bench_oracle", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--sequences", type=int, default=100)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--lmax", type=int, default=12)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    n, lmax = args.tokens, args.lmax
    model = CostModel({m: 5 + 0.2 * m for m in range(1, lmax + 2)},
                      {m: 0.3 for m in range(1, lmax + 2)}, 0.001, 0.5, 0.1)  # fmt: skip
    data = []
    for _ in range(args.sequences):
        tokens = _routing(rng, n + 1, args.layers, args.experts, args.top_k)
        s = np.repeat(np.arange(n), [min(lmax, n - j) for j in range(n)])
        r = np.concatenate([np.arange(1, min(lmax, n - j) + 1) for j in range(n)])
        tails = _routing(rng, len(s), args.layers, args.experts, args.top_k)
        p_tok = np.concatenate([[np.nan], rng.beta(3, 2, n)])
        data.append((tokens, tails, s, r, p_tok))
    t0 = time.perf_counter()
    unions = [
        union_table_shared(bitmasks(tok, args.experts), bitmasks(tl, args.experts), s, r, lmax)
        for tok, tl, s, r, _ in data
    ]
    t_union = time.perf_counter() - t0
    t0 = time.perf_counter()
    bounds = []
    for (_, _, _, _, p_tok), union in zip(data, unions, strict=True):
        sol = solve(acceptance_table(p_tok, lmax), cost_table(model, union, 100), union)
        bounds.append(sol.dp[0])
    t_dp = time.perf_counter() - t0
    states = args.sequences * n
    print(f"{args.sequences} sequences x {n} tokens, Lmax {lmax}: {states:,} states, "
          f"{sum(len(d[2]) for d in data):,} tail tokens")  # fmt: skip
    print(f"U(i,k,a) for every cell: {t_union:.2f}s ({t_union / args.sequences * 1e3:.1f} ms/seq)")
    print(f"DP + visitation at Lmax {lmax}: {t_dp:.2f}s ({t_dp / args.sequences * 1e3:.1f} ms/seq)")
    print(f"total {t_union + t_dp:.2f}s in one process (Ray tasks split it over cores)")
    return {"seconds_union": t_union, "seconds_dp": t_dp}


if __name__ == "__main__":
    main()
