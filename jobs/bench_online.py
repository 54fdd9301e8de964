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

--runs N repeats the whole bench N times (prompt j of run r draws with seed r x limit + j at
T > 0) and ends with the figures pooled over the runs: each policy's tokens and seconds summed,
its ratio over the best fixed K of those sums, each run's own ratio (lowest-highest) beside it.
One run's best fixed K is the luckiest of several noisy rows; pooled, that bias shrinks.

Before anything decodes, every policy must build and the cost model must price every step it
may take (its largest m, from its knobs: a chain of max_k verifies max_k + 1). Each row is
appended to OUT/rows.jsonl as soon as it is scored; a policy whose scoring fails is left out,
the others are reported, and the run ends naming it with a non-zero exit.

    python -m jobs.bench_online --limit 8 --max-new-tokens 64
    python -m jobs.bench_online --domains code,prose,math --limit 8 --max-new-tokens 64
    python -m jobs.bench_online --domains all --policies ar,fixed:k=2,fixed:k=4,throughput
    python -m jobs.bench_online --domains all --runs 3 --no-bound --temperatures 1
    # the second pair (a 2-layer draft), its artifacts beside it
    python -m jobs.bench_online --draft models/draft-2layer --artifacts models/draft-2layer
    # the third: the EAGLE-3 head (no transformers assisted generation: it knows no head)
    python -m jobs.bench_online --draft models/eagle3-head --artifacts models/eagle3-head
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

from jobs.cli import (
    add_limit_arg,
    add_lmax_arg,
    add_max_new_tokens_arg,
    add_model_args,
    add_out_arg,
    add_predictor_arg,
    add_source_arg,
    add_temperatures_arg,
    add_threads_arg,
    parse_policy_specs,
    parser,
    run,
    torch_threads,
)
from pipeline.bench.domains import domain_metrics
from pipeline.bench.guard import ResultLog, raise_failures
from pipeline.bench.online import run_online_bench
from pipeline.bench.price_drift import price_drift
from pipeline.bench.rows import BenchRow
from pipeline.bench.runs import repeat_bench
from pipeline.bench.scoring import OnlineBenchResult, format_online_bench
from pipeline.data.domains import DOMAINS, load_prompts
from pipeline.data.prompts import encode
from pipeline.decode.policies.artifacts import (
    DEFAULT_ACCEPTANCE,
    DEFAULT_COSTMODEL,
    DEFAULT_POLICY,
    artifact_paths,
    load_artifacts,
)
from pipeline.decode.policies.registry import validate_knobs
from pipeline.models.loading import load_pair
from pipeline.tracking import tracked_run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.bench_online", __doc__)
    add_model_args(p)
    add_source_arg(p)
    p.add_argument(
        "--domains",
        default=None,
        help="comma-separated prompt domains (code, prose, math; 'all' for the three), each "
        "benched on its own with --limit prompts, then summarised per domain; replaces --source",
    )
    add_limit_arg(p, 8, "per domain with --domains")
    p.add_argument(
        "--runs",
        type=int,
        default=1,
        help="repeat the bench this many times, then summarise it pooled over the runs, "
        "with each run's own ratio over the best fixed K beside it (3: the spread)",
    )
    add_max_new_tokens_arg(p, 64)
    add_temperatures_arg(p, "0,1")
    add_predictor_arg(p)
    p.add_argument("--costmodel", type=Path, default=DEFAULT_COSTMODEL, help="costmodel.json")
    p.add_argument("--policy", type=Path, default=DEFAULT_POLICY, help="the oracle's policy.json")
    p.add_argument(
        "--acceptance",
        type=Path,
        default=DEFAULT_ACCEPTANCE,
        help="acceptance.json (jobs.train_acceptance)",
    )
    p.add_argument(
        "--artifacts",
        type=Path,
        default=None,
        metavar="DIR",
        help="read predictor/, costmodel.json, policy.json and acceptance.json from "
        "DIR (another pair's); overrides the four options above (a missing predictor/ "
        "or policy.json keeps the option's)",
    )
    p.add_argument(
        "--policies",
        default=None,
        help="run only these, e.g. 'ar,fixed:k=2,throughput:max_k=8' (ar is always "
        "run first: the baseline); default: every policy of the bench",
    )
    p.add_argument(
        "--no-assisted", action="store_true", help="leave out transformers' assisted generation"
    )
    add_threads_arg(
        p, 1, "while decoding (1: as the committed cost models were calibrated; 0: torch's)"
    )
    p.add_argument(
        "--no-bound",
        action="store_true",
        help="leave out the oracle (bound and replay): measured figures only, faster",
    )
    p.add_argument(
        "--bound-at",
        default=None,
        metavar="TEMPS",
        help="solve the bound only at these temperatures, e.g. 0 (at T > 0 every "
        "policy's text differs, so each needs its own solve); default: all",
    )
    add_lmax_arg(p, 12, "of the bound")
    add_out_arg(
        p, Path("out/bench_online"), "rows.jsonl, each row (or failed policy) as it is scored"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="only ar, fixed k = 1..4 and throughput, no assisted generation",
    )
    p.add_argument(
        "--allow-costmodel-mismatch",
        action="store_true",
        help="use a cost model measured on another device, dtype, experts implementation or "
        "checkpoints (its prices then describe that other setting)",
    )
    args = p.parse_args(argv)
    if args.artifacts is not None:
        if not args.artifacts.is_dir():
            p.error(f"--artifacts {args.artifacts}: not a directory")
        paths, notes = artifact_paths(args.artifacts, args.predictor, args.policy)
        for key, path in paths.items():
            setattr(args, key, path)
        for note in notes:
            print(f"[bench_online] {note}", flush=True)
    if args.policies is not None:
        try:
            args.policies = parse_policy_specs(args.policies)
            for name, knobs in args.policies:
                validate_knobs(name, knobs)
        except ValueError as exc:
            p.error(f"--policies: {exc}")
    try:
        args.bound_at = (
            None
            if args.bound_at is None
            else [float(t) for t in args.bound_at.split(",") if t.strip()]
        )
    except ValueError:
        p.error("--bound-at takes comma-separated numbers")
    if min(args.temperatures) < 0:
        p.error("--temperatures needs at least one value, none negative")
    if args.bound_at is not None and (
        args.no_bound or not set(args.bound_at) <= set(args.temperatures)
    ):
        p.error("--bound-at: temperatures among --temperatures, and not with --no-bound")
    if args.threads < 0:
        p.error("--threads must be >= 0 (0: torch's default)")
    if min(args.limit, args.max_new_tokens, args.lmax, args.runs) < 1:
        p.error("--limit, --max-new-tokens, --lmax and --runs must be >= 1")
    if args.domains is not None:
        names = [d.strip().lower() for d in args.domains.split(",") if d.strip()]
        args.domains = list(DOMAINS) if names == ["all"] else names
        unknown = [d for d in args.domains if d not in DOMAINS]
        if unknown or not args.domains or len(set(args.domains)) < len(args.domains):
            p.error(
                f"--domains {args.domains}: give distinct names among "
                f"{', '.join(DOMAINS)}, or 'all'"
            )
    return args


def _bound_arg(args: argparse.Namespace) -> bool | list[float]:
    if args.no_bound:
        return False
    return True if args.bound_at is None else args.bound_at


def _bench_source(
    args: argparse.Namespace,
    pair,
    artifacts,
    log: ResultLog,
    bounds: dict,
    name: str,
    run: int,
) -> OnlineBenchResult:
    """One prompt source's (a domain's or --source's) bench in run ``run`` (from 0), each row
    written to ``log`` as it is scored, the table printed as it finishes; ``bounds`` are the
    oracle's solutions so far (another run's identical T = 0 texts are not solved again)."""
    chosen = load_prompts(name, args.limit)
    trained = set(artifacts.acceptance.meta.get("prompts", [])) if artifacts.acceptance else set()
    seen = sorted(p.prompt_id for p in chosen if p.prompt_id in trained)
    if seen and run == 0:
        print(
            f"[bench_online] warning: {name}: {len(seen)} prompts ({', '.join(seen[:4])}"
            f"{', ...' if len(seen) > 4 else ''}) are in the acceptance model's training set;"
            " its policies are then scored in-sample",
            flush=True,
        )
    prompts = [encode(pair.tokenizer, p.text, keep_last=512) for p in chosen]
    where = f"run {run + 1}/{args.runs}, " if args.runs > 1 else ""
    result = run_online_bench(
        pair,
        artifacts,
        prompts,
        args.temperatures,
        args.max_new_tokens,
        args.lmax,
        quick=args.quick,
        policies=args.policies,
        assisted=False if args.no_assisted else None,
        bound=_bound_arg(args),
        progress=lambda line: print(f"[bench_online] {where}{name}: {line}", flush=True),
        record=lambda result: log.write({"source": name, "run": run + 1, **result}),
        first_seed=run * args.limit,
        bounds=bounds,
    )
    if args.domains:
        print(f"\n=== domain {name} ===")
    print(format_online_bench(result))
    return result


def main(argv: list[str] | None = None) -> list[BenchRow]:
    args = parse_args(argv)
    pair = load_pair(args.target, args.draft, args.device, args.dtype, args.experts_implementation)
    if pair.draft_is_head and not args.no_assisted:
        print("[bench_online] an EAGLE-3 head: no transformers assisted generation", flush=True)
        args.no_assisted = True
    artifacts = load_artifacts(
        args.predictor, args.costmodel, args.policy, str(pair.device), args.acceptance
    )
    # Before any policy runs: the bound at --lmax prices m = 1 .. lmax + 1.
    artifacts.cost.require_m(range(1, args.lmax + 2), f"the bound at --lmax {args.lmax}")
    artifacts.check_pair(pair, allow_mismatch=args.allow_costmodel_mismatch)
    sources = args.domains or [args.source]
    log = ResultLog(args.out / "rows.jsonl")
    with torch_threads(args.threads or None):
        bench = repeat_bench(
            partial(_bench_source, args, pair, artifacts, log, {}),
            sources,
            args.runs,
            lambda text: print(text, flush=True),
            by_domain=bool(args.domains),
        )
    drift = price_drift(bench.rows())
    if drift is not None:
        temps = ",".join(f"{t:g}" for t in args.temperatures)  # as typed: 0,1
        print("\n" + "\n".join(drift.lines(args.target, args.draft, temps)))
    params = {**vars(args), "policies": str(args.policies)}
    with tracked_run("bench_online", params=params) as mlrun:
        for run_index in range(args.runs):  # one step per run
            mlrun.log_metrics(bench.run_metrics(run_index, bool(args.domains)), step=run_index)
        pooled = bench.pooled()
        if pooled is not None:
            mlrun.log_metrics({f"runs_{k}": v for k, v in domain_metrics(pooled).items()})
        if drift is not None:
            mlrun.log_metrics(drift.metrics())
    print(f"\nrows written to {log.path}")
    raise_failures("bench_online", bench.failures(bool(args.domains)))  # after the rest is out
    return bench.rows()


if __name__ == "__main__":
    run(main)
