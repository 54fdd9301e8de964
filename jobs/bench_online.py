"""Online speculative decoding benchmark: tokens/s and speedup over plain decoding (our `ar`)
for every policy, the cost-aware ones (ecospec, ecospec-global, marginal, cascade) and
transformers' assisted generation, on the same prompts and models in one run, greedy (T=0)
and sampling (T=1); mean accepted length, mean unique experts per verification pass, the
share of wall time spent in target verification, and the fraction of the oracle's bound each
policy captures.

The bound: the text `ar` generated at that temperature goes through the extraction and the
Bellman oracle with the same cost model the marginal policy uses (exact-greedy acceptance at
T=0, the paper's surrogate from draft probabilities otherwise); "of bound" is a policy's
measured speedup over that S. At T=0 the `oracle-replay` row decodes with the oracle's own
k*(i), and its modelled cost is compared with the measured time.

--domains runs the whole bench once per prompt domain (--limit prompts each) and adds a
summary per domain and temperature, pooled over the domains too: each policy's speedup, its
ratio over the best fixed K of that domain and temperature in the same run, its share of the
bound and whether its greedy text equals `ar`'s.

    python -m jobs.bench_online --limit 8 --max-new-tokens 64
    python -m jobs.bench_online --domains code,prose,math --limit 8 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jobs.cli import SOURCE_HELP, add_model_args, parser, run
from pipeline.bench.domains import domain_metrics, domain_table, format_domain_summary
from pipeline.bench.online import BenchRow, run_online_bench
from pipeline.bench.scoring import format_online_bench
from pipeline.data.domains import DOMAINS, load_prompts
from pipeline.data.prompts import encode
from pipeline.decode.policies.artifacts import (
    DEFAULT_COSTMODEL,
    DEFAULT_POLICY,
    DEFAULT_PREDICTOR,
    load_artifacts,
)
from pipeline.models.loading import load_pair
from pipeline.tracking import tracked_run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.bench_online", __doc__)
    add_model_args(p)
    p.add_argument(
        "--source",
        default="humaneval",
        help=SOURCE_HELP,
    )
    p.add_argument(
        "--domains",
        default=None,
        help="comma-separated prompt domains (code, prose, math; 'all' for the three), each "
        "benched on its own with --limit prompts, then summarised per domain; replaces --source",
    )
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperatures", default="0,1", help="comma-separated (0,1)")
    p.add_argument("--predictor", type=Path, default=DEFAULT_PREDICTOR, help="expert predictor")
    p.add_argument("--costmodel", type=Path, default=DEFAULT_COSTMODEL, help="costmodel.json")
    p.add_argument("--policy", type=Path, default=DEFAULT_POLICY, help="the oracle's policy.json")
    p.add_argument("--lmax", type=int, default=12, help="Lmax of the bound (12)")
    p.add_argument("--quick", action="store_true", help="only ar, fixed(k=2) and marginal")
    p.add_argument(
        "--allow-costmodel-mismatch",
        action="store_true",
        help="use a cost model measured on another device, dtype, experts implementation or "
        "checkpoints (its prices then describe that other setting)",
    )
    args = p.parse_args(argv)
    if args.limit < 1 or args.max_new_tokens < 1 or args.lmax < 1:
        p.error("--limit, --max-new-tokens and --lmax must be >= 1")
    if args.domains is not None:
        names = [d.strip().lower() for d in args.domains.split(",") if d.strip()]
        args.domains = list(DOMAINS) if names == ["all"] else names
        unknown = [d for d in args.domains if d not in DOMAINS]
        if unknown or not args.domains or len(set(args.domains)) < len(args.domains):
            p.error(f"--domains {args.domains}: give distinct names among "
                    f"{', '.join(DOMAINS)}, or 'all'")  # fmt: skip
    return args


def main(argv: list[str] | None = None) -> list[BenchRow]:
    args = parse_args(argv)
    pair = load_pair(args.target, args.draft, args.device, args.dtype, args.experts_implementation)
    artifacts = load_artifacts(args.predictor, args.costmodel, args.policy, str(pair.device))
    # Before any policy runs: the bound at --lmax prices m = 1 .. lmax + 1.
    artifacts.cost.require_m(range(1, args.lmax + 2), f"the bound at --lmax {args.lmax}")
    artifacts.check_pair(pair, allow_mismatch=args.allow_costmodel_mismatch)
    sources = {d: d for d in args.domains} if args.domains else {args.source: args.source}
    results = {}
    for name, source in sources.items():
        prompts = [encode(pair.tokenizer, p.text, keep_last=512)
                   for p in load_prompts(source, args.limit)]  # fmt: skip
        results[name] = run_online_bench(
            pair, artifacts, prompts, [float(t) for t in args.temperatures.split(",")],
            args.max_new_tokens, args.lmax, quick=args.quick,
            progress=lambda line, name=name: print(f"[bench_online] {name}: {line}", flush=True),
        )  # fmt: skip
        if args.domains:
            print(f"\n=== domain {name} ===")
        print(format_online_bench(results[name]))
    metrics = {}
    if args.domains:
        table = domain_table(results)
        print()
        print(format_domain_summary(table))
        metrics.update(domain_metrics(table))
        for name, result in results.items():  # each domain's own bench metrics too
            metrics.update({f"{name}_{k}": v for k, v in result.metrics().items()})
    else:
        metrics.update(results[args.source].metrics())
    with tracked_run("bench_online", params=vars(args)) as mlrun:
        mlrun.log_metrics(metrics)
    return [row for result in results.values() for row in result.rows]


if __name__ == "__main__":
    run(main)
