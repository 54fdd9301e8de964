"""Calibrate the verification-cost model on this device from timed speculative rounds.

Runs greedy speculative decoding with a fixed chain of K draft tokens for every K in --ks
(K = 0: plain one-token steps, the m = 1 rounds the autoregressive baseline needs) and, for
every K in --look-ks, look rounds (K tokens, then one more draft distribution looked at
before stopping, as policies that decide from the next distribution do: K + 1 draft forwards)
over a prompt set, and writes the `rounds` table. The target's cost
T_T = beta0(m) + alpha(m) U + c L is fitted (clustered by generation, GroupKFold(5)
out-of-sample metrics) on designed passes (--design forced, the default: after every round, a
pass with the routing set to the next (m, U) cell of a design spanning every union size U at
every m, timed at that round's state) and scored on the rounds beside an observational fit of
them. Also fitted on the rounds: the draft line T_D = a n + b over n draft forwards, the pooled
linear-K model and factor importance. Writes costmodel.json (with the device, dtype, experts
implementation and checkpoint fingerprints it was measured on, which every user of it
checks), per-K summaries (DuckDB, sql/calibration_per_k.sql) and
plots. Everything is logged to MLflow.

    python -m jobs.calibrate --limit 8 --ks 0-12 --threads 1 --designed-per-round 2 --out out/cal
    ray job submit --working-dir . -- python -m jobs.calibrate --out /abs/path/calibration
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jobs.cli import (
    add_limit_arg,
    add_max_new_tokens_arg,
    add_model_args,
    add_out_arg,
    add_repeats_arg,
    add_source_arg,
    add_temperatures_arg,
    add_threads_arg,
    parse_ks,
    parser,
    run,
    torch_threads,
)
from pipeline.cost.calibration import DESIGNS, run_calibration
from pipeline.cost.modes import format_modes
from pipeline.cost.report import fit_metrics, format_design_comparison, format_report
from pipeline.data.domains import load_prompts
from pipeline.decode.types import SamplingConfig
from pipeline.models.loading import load_pair
from pipeline.tracking import tracked_run, tracking_uri


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.calibrate", __doc__)
    add_model_args(p)
    add_source_arg(p)
    add_limit_arg(p, 8)
    p.add_argument("--ks", type=parse_ks, default=parse_ks("0-10"), help="budgets K (0-10)")
    p.add_argument(
        "--look-ks",
        default=None,
        help="budgets K that also get look rounds (K + 1 draft forwards), among "
        "--ks; 'none' for none (default: every other K of --ks from the "
        "smallest: 0,2,4,... for 0-10)",
    )
    add_max_new_tokens_arg(p, 64)
    add_temperatures_arg(
        p,
        "0",
        "each a decoding mode of the timed rounds, interleaved per prompt (at T > 0 the "
        "draft's sampling and the acceptance walk are in the timed work); e.g. 0,1 prices both "
        "in one costmodel.json (its `modes`; the first mode also gives the file's own draft line)",
        alias="--temperature",
    )
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus of the sampled modes (1: none)"
    )
    p.add_argument("--warmup-tokens", type=int, default=16, help="discarded warm-up per K")
    add_repeats_arg(
        p,
        None,
        "time each pass this many times back to back, keep the median (1: as decoding runs "
        "it; a repeat finds the weights in cache)",
    )
    p.add_argument(
        "--design",
        choices=DESIGNS,
        default="forced",
        help="how the target's cost is identified. 'forced' (default): after every "
        "round, --designed-per-round passes with the routing set by design to "
        "the next (m, U) cell (every union size U at every m, shuffled), timed "
        "at that round's state like the round itself; 'forced-contexts': the "
        "same cells in a separate shuffled run at --designed-contexts; "
        "'observational': the router's own choices in the rounds. The forced "
        "designs still fit the draft line on the rounds and score the designed "
        "model on them (design_comparison.csv)",
    )
    p.add_argument(
        "--designed-per-round",
        type=int,
        default=1,
        help="designed passes after every round (forced; 1)",
    )
    p.add_argument(
        "--designed-ms",
        type=parse_ks,
        default=None,
        help="m (positions per pass) of the forced design (default: K + 1 for --ks)",
    )
    p.add_argument(
        "--designed-repeats",
        type=int,
        default=5,
        help="timed passes per (m, U) cell per context (forced-contexts; 5)",
    )
    p.add_argument(
        "--max-levels",
        type=int,
        default=8,
        help="U levels per m, evenly spaced over the feasible range (8)",
    )
    p.add_argument(
        "--designed-contexts",
        default="auto",
        help="context lengths (tokens) of forced-contexts, e.g. 128,512,1024; 'auto': 3 "
        "spread over the observational rounds' range; 'prompts': the prompts' own lengths",
    )
    add_threads_arg(p, None, "for the timings; recorded")
    add_out_arg(p, Path("out/calibration"), "costmodel.json, rounds.parquet and plots")
    args = p.parse_args(argv)
    if args.designed_repeats < 1 or args.designed_per_round < 1 or args.max_levels < 2:
        p.error("--designed-repeats and --designed-per-round must be >= 1, --max-levels >= 2")
    if args.designed_ms is not None and min(args.designed_ms) < 1:
        p.error("--designed-ms must be >= 1")
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be >= 1")
    contexts = args.designed_contexts.strip().lower()
    if contexts == "auto":
        args.designed_contexts = None
    elif contexts == "prompts":
        args.designed_contexts = ()
    else:
        try:
            args.designed_contexts = sorted({int(x) for x in contexts.split(",")})
        except ValueError:
            p.error(
                f"--designed-contexts: {args.designed_contexts!r} is not 'auto', "
                "'prompts' or comma-separated integers"
            )
        if min(args.designed_contexts) < 2:
            p.error("--designed-contexts must be >= 2 tokens")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    if args.limit < 2:
        p.error("--limit must be >= 2 (the fit clusters and cross-validates by generation)")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    if not all(t >= 0 for t in args.temperatures):
        p.error(f"--temperatures must be >= 0, got {args.temperatures}")
    if len(set(args.temperatures)) < len(args.temperatures):
        p.error(f"--temperatures: each mode once, got {args.temperatures}")
    sampled = any(t > 0 for t in args.temperatures)
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_p < 1 and not sampled:
        p.error("--top-p needs a temperature > 0 (greedy rounds take the argmax)")
    if sampled and (args.repeats or 1) > 1:
        p.error("--repeats > 1 needs greedy rounds only (a repeated pass would draw again)")
    missing = sorted({k + 1 for k in args.ks} - set(args.designed_ms or ()))
    if args.designed_ms is not None and args.design != "observational" and missing:
        # The designed model must price every round it is tested on (and the oracle, every m).
        p.error(
            f"--designed-ms {args.designed_ms} must include K + 1 for every K of --ks: "
            f"add {missing}"
        )
    if args.look_ks is None:
        args.look_ks = args.ks[::2]
    elif args.look_ks.strip().lower() == "none":
        args.look_ks = []
    else:
        try:
            args.look_ks = parse_ks(args.look_ks)
        except argparse.ArgumentTypeError as exc:
            p.error(f"--look-ks: {exc}")
        if set(args.look_ks) - set(args.ks):
            p.error(f"--look-ks {args.look_ks} must be among --ks {args.ks}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with torch_threads(args.threads):
        return _calibrate(args)


def _calibrate(args: argparse.Namespace) -> dict:
    pair = load_pair(args.target, args.draft, args.device, args.dtype, args.experts_implementation)
    prompts = load_prompts(args.source, args.limit)
    modes = [SamplingConfig(t, args.top_p if t > 0 else 1.0) for t in args.temperatures]
    named = ["greedy" if m.greedy else f"T={m.temperature:g} top-p {m.top_p:g}" for m in modes]
    print(
        f"calibrating on {pair.device} ({pair.dtype}, experts={pair.experts_implementation}): "
        f"{len(prompts)} prompts x K in {args.ks}, looks at K in {args.look_ks}, "
        f"modes: {', '.join(named)}",
        flush=True,
    )
    result = run_calibration(
        pair,
        prompts,
        args.ks,
        args.max_new_tokens,
        args.warmup_tokens,
        args.out,
        args.repeats,
        args.look_ks,
        args.design,
        args.designed_ms or (),
        args.designed_repeats,
        args.max_levels,
        args.designed_contexts,
        args.designed_per_round,
        modes,
    )
    params = {**{k: str(v) for k, v in vars(args).items()}, **result.meta}
    with tracked_run("calibrate", params=params) as tracked:
        tracked.log_metrics(fit_metrics(result.fit, result.rounds))
        for path in result.paths:
            tracked.log_artifact(str(path))
        run_id = tracked.run_id

    print()
    print(format_report(result.fit, result.per_k))
    if result.comparison is not None:
        print()
        print(format_design_comparison(result.comparison, result.cells, result.summary))
    if result.fit.model.meta.get("modes"):
        print()
        print(format_modes(result.fit.model.meta["modes"]))
    print(
        f"\nwrote {args.out}/costmodel.json, rounds.parquet, plots; MLflow run {run_id} at "
        f"{tracking_uri()}"
    )
    return {"fit": result.fit, "out": str(args.out)}


if __name__ == "__main__":
    run(main)
