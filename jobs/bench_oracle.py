"""Speed of the oracle's arithmetic: U(i, k, a) with bitmask unions and the Bellman DP for many
sequences, on synthetic extraction tables shaped like the embedded target (6 MoE layers, 32
experts, top-4), in one run. Per sequence it does what jobs.oracle does: a U table per
(acceptance, draw) of junk tails, then the DP for every Lmax, acceptance rule and plain-step
setting, with visitation and cross-fitting.

    python -m jobs.bench_oracle --sequences 100 --tokens 512 --lmax 12
"""

from __future__ import annotations

from jobs.cli import parser, run
from pipeline.bench.oracle import bench_oracle, format_oracle_bench
from pipeline.tracking import tracked_run


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = parser("jobs.bench_oracle", __doc__)
    p.add_argument("--sequences", type=int, default=100)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--lmax", type=int, default=12)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    args = p.parse_args(argv)
    for name in ("sequences", "tokens", "lmax", "layers", "experts", "top_k"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.top_k > args.experts:
        p.error("--top-k must be <= --experts")
    result = bench_oracle(
        args.sequences, args.tokens, args.lmax, args.layers, args.experts, args.top_k
    )
    print(format_oracle_bench(result))
    metrics = {"seconds_union": result.seconds_union, "seconds_dp": result.seconds_dp}
    with tracked_run("bench_oracle", params=vars(args)) as tracked:
        tracked.log_metrics(metrics)
    return metrics


if __name__ == "__main__":
    run(main)
