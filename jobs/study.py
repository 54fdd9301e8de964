"""The whole study on one target/draft pair (the README's main command, `make demo`):

  1. extract   reference sequences from HumanEval, draft confidences, target routing, junk tails
  2. profile   experts used per layer, growth of the expert union over consecutive tokens
  3. calibrate timed speculative rounds, and after each a pass with the routing forced to the
               next (m, U) cell of the design (--calibration-design) -> costmodel.json
  4. oracle    the Bellman bound per Lmax, delta space, lambda, the alpha = 0 ablation, and
               the tree bound of each --trees rule beside the chain bound per budget (T = 0)

Each step is the same code as its own job (jobs.extract, jobs.calibrate, jobs.oracle) and logs
its own MLflow run. Defaults fit 2 CPU cores in a few minutes.

    python -m jobs.study                       # embedded models, HumanEval
    python -m jobs.study --limit 32 --lmax 12 --out out/study
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from jobs import calibrate as calibrate_job
from jobs import extract as extract_job
from jobs import oracle as oracle_job
from jobs.cli import (
    add_limit_arg,
    add_lmax_arg,
    add_max_new_tokens_arg,
    add_model_args,
    add_num_cpus_arg,
    add_out_arg,
    add_predictor_arg,
    add_source_arg,
    ray_session,
    run,
)
from pipeline.cost.calibration import DESIGNS
from pipeline.extract.draft_trees import TreeRule
from pipeline.extract.routing_profile import extraction_profile
from pipeline.extract.tree_rows import tree_predictor
from pipeline.models.adapters import moe_spec
from pipeline.models.eagle3_formats import head_format
from pipeline.models.loading import load_config
from pipeline.tracking import tracked_run, tracking_uri


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jobs.study",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_source_arg(p)
    add_limit_arg(p, 16, "each a reference sequence")
    add_max_new_tokens_arg(p, 128, "the reference's length")
    add_lmax_arg(p, 12, "studied")
    p.add_argument("--calibration-prompts", type=int, default=4, help="prompts timed (4)")
    p.add_argument("--calibration-tokens", type=int, default=48, help="tokens per timed run")
    p.add_argument(
        "--calibration-design",
        choices=DESIGNS,
        default="forced",
        help="how the target's cost is identified (forced, default: routing set "
        "by design at every union size; see jobs.calibrate --design)",
    )
    p.add_argument(
        "--calibration-threads",
        type=int,
        default=1,
        help="torch threads while timing (1: what a serving replica runs, and a "
        "core stays free for Ray's own processes)",
    )
    p.add_argument(
        "--trees",
        default=None,
        help="draft-tree selection rules for the tree bound (jobs.extract --trees; "
        "default: eagle2,ecospec, or eagle2 alone when --predictor does not fit the "
        "target; '' for none)",
    )
    add_predictor_arg(p)
    add_model_args(p)
    add_out_arg(p, Path("out/study"))
    add_num_cpus_arg(p)
    args = p.parse_args(argv)
    for name in ("limit", "max_new_tokens", "lmax", "calibration_tokens", "calibration_threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.calibration_prompts < 2:
        p.error("--calibration-prompts must be >= 2")
    if args.trees is None and head_format(args.draft) is not None:
        print("tree bound: none (draft trees are extracted with separate draft models only)")
        args.trees = ""
    if args.trees is None:
        spec = moe_spec(load_config(args.target))
        try:
            tree_predictor([TreeRule("ecospec")], str(args.predictor), spec, "cpu")
            args.trees = "eagle2,ecospec"
        except (ValueError, OSError) as exc:
            print(f"tree bound: eagle2 only ({exc})")
            args.trees = "eagle2"
    return args


def _banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    out: Path = args.out
    extract_dir, cal_dir, oracle_dir = out / "extract", out / "calibration", out / "oracle"
    models = [
        "--target",
        args.target,
        "--draft",
        args.draft,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--experts-implementation",
        args.experts_implementation,
    ]
    with ray_session(num_cpus=args.num_cpus):
        _banner("1/4 extract")
        extract_job.main(
            [
                "--source",
                args.source,
                "--limit",
                str(args.limit),
                "--lmax",
                str(args.lmax),
                "--max-new-tokens",
                str(args.max_new_tokens),
                "--out",
                str(extract_dir),
                "--trees",
                args.trees,
                "--tree-budget",
                str(args.lmax),
                "--predictor",
                str(args.predictor),
                *models,
            ]
        )

        _banner("2/4 routing profile of the reference tokens")
        profile = extraction_profile(extract_dir, moe_spec(load_config(args.target)))
        print(profile.report())
        with tracked_run("profile_routing", params={"extract": str(extract_dir)}) as run:
            run.log_metrics(
                {f"unique_experts_w{w}": v for w, v in profile.mean_unique_in_window().items()}
            )
            run.log_dict(profile.as_dict(), "routing_profile.json")

        _banner("3/4 calibrate")
        calibrate_job.main(
            [
                "--source",
                args.source,
                "--limit",
                str(args.calibration_prompts),
                "--ks",
                f"0-{args.lmax}",
                "--max-new-tokens",
                str(args.calibration_tokens),
                "--out",
                str(cal_dir),
                "--design",
                args.calibration_design,
                "--threads",
                str(args.calibration_threads),
                *models,
            ]
        )

        oracle_args = [
            "--extract",
            str(extract_dir),
            "--costmodel",
            str(cal_dir / "costmodel.json"),
            "--target",
            args.target,
        ]
        _banner("4/4 oracle (every acceptance rule, with and without the plain step)")
        oracle = oracle_job.main([*oracle_args, "--out", str(oracle_dir)])
        result, trees = oracle["result"], oracle["trees"]

    _banner("study summary")
    overall = result.sweep[result.sweep["category"] == "all"]
    for acc in ("greedy", "sampling", "surrogate"):
        rows = overall[(overall["acceptance"] == acc) & overall["plain_step"]]
        if rows.empty:
            continue
        best = rows.loc[rows["speedup_bound"].idxmax()]
        cross = best["speedup_crossfit"]
        cross_text = "" if acc == "greedy" or cross != cross else f", cross-fitted {cross:.3f}x"
        print(
            f"{acc} acceptance: bound S peaks at {best['speedup_bound']:.3f}x (Lmax "
            f"{int(best['lmax'])}{cross_text}; mean draft {best['mean_draft_len']:.2f}, "
            f"mean accepted {best['mean_accepted']:.2f})"
        )
    if trees is not None:
        top = trees[trees["budget"] == trees["budget"].max()]
        print(
            f"tree bound at K = {int(top['budget'].iloc[0])} (T = 0): "
            + ", ".join(f"{r.bound} {r.speedup:.3f}x" for r in top.itertuples())
            + f" ({oracle_dir}/tree_bound.csv)"
        )
    d = result.delta
    print(
        f"lambda ({result.config.acceptance}) = {d['lambda_ms'] or float('nan'):.4f} ms/token; "
        f"quadrants I/II/III/IV = {d['quadrant_i']:.0f}/{d['quadrant_ii']:.0f}/"
        f"{d['quadrant_iii']:.0f}/{d['quadrant_iv']:.0f}"
    )
    print(
        f"Parquet tables: {extract_dir}/{{sequences,tokens,tails,trees}}, "
        f"{cal_dir}/rounds.parquet, {oracle_dir}/{{decisions,summary}}.parquet"
    )
    print(
        f"plots: {cal_dir}/target_vs_experts.png, {oracle_dir}/lmax_sweep.png, "
        f"{oracle_dir}/delta_space.png; policy: {oracle_dir}/policy.json"
    )
    print(f"MLflow: {tracking_uri()} (experiments extract, profile_routing, calibrate, oracle)")
    print(f"study done in {time.perf_counter() - started:.0f}s")
    return {"result": result}


if __name__ == "__main__":
    run(main)
