"""Calibrate the batch > 1 cost model: T_T(P, U, A) of a packed verification pass over P
positions (summed over the batch's generations) whose union of experts is U per layer, with
attention work A (each generation's positions times its cached context, summed); T_D(n) of a
draft round of n generations; the bookkeeping per step; and how the union grows with
positions, U(P). It decodes the prompts continuously batched at each --batch-sizes, once per K
of --ks with every generation drafting a chain of K, and fits the steps' packed forwards.

The result goes into the batch-1 cost model's file as its "batch" section (the `batch` policy
reads it); the file must have been measured on this setup (device, dtype, experts
implementation, checkpoints), as every cost model is bound to where it was measured.

    python -m jobs.calibrate_batch                                  # models/costmodel.json
    python -m jobs.calibrate_batch --draft models/draft-2layer \
        --costmodel models/draft-2layer/costmodel.json
    python -m jobs.calibrate_batch --batch-sizes 1,4,8 --ks 0-6 --out out/costmodel.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jobs.cli import (
    add_batch_sizes_arg,
    add_limit_arg,
    add_max_new_tokens_arg,
    add_model_args,
    add_out_arg,
    add_prompt_tokens_arg,
    add_source_arg,
    add_threads_arg,
    parse_ks,
    parser,
    run,
    torch_threads,
)
from pipeline.cost.batch_calibration import calibrate_batch
from pipeline.cost.model import CostModel
from pipeline.cost.provenance import pair_provenance
from pipeline.data.domains import load_prompts
from pipeline.data.prompts import encode
from pipeline.models.loading import load_pair
from pipeline.tracking import tracked_run, tracking_uri


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.calibrate_batch", __doc__)
    add_model_args(p)
    add_source_arg(p)
    add_limit_arg(p, 16)
    add_batch_sizes_arg(p, "1,2,4,8,16")
    p.add_argument(
        "--ks",
        type=parse_ks,
        default=parse_ks("0-8"),
        help="fixed chain lengths the generations draw from (0-8; 0: plain steps)",
    )
    add_max_new_tokens_arg(p, 48)
    add_prompt_tokens_arg(p)
    p.add_argument(
        "--costmodel",
        type=Path,
        default=Path("models/costmodel.json"),
        help="the pair's batch-1 cost model, which gains the batch section",
    )
    add_out_arg(p, None, "the cost model with its batch section (default: --costmodel, in place)")
    add_threads_arg(p, 1, "as a serving replica runs")
    p.add_argument(
        "--allow-costmodel-mismatch",
        action="store_true",
        help="add to a cost model measured on another setup anyway",
    )
    args = p.parse_args(argv)
    if args.limit < 2 or args.max_new_tokens < 4:
        p.error("--limit must be >= 2 and --max-new-tokens >= 4")
    if min(args.batch_sizes) < 1:
        p.error("--batch-sizes must be >= 1")
    if args.threads < 1:
        p.error("--threads must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with torch_threads(args.threads):
        return _calibrate(args)


def _calibrate(args: argparse.Namespace) -> dict:
    pair = load_pair(args.target, args.draft, args.device, args.dtype, args.experts_implementation)
    cost = CostModel.load(args.costmodel)
    cost.check_measured_on(pair_provenance(pair), args.allow_costmodel_mismatch)
    prompts = [
        encode(pair.tokenizer, p.text, keep_last=args.prompt_tokens)
        for p in load_prompts(args.source, args.limit)
    ]
    print(
        f"batch calibration on {pair.device} ({pair.dtype}, experts="
        f"{pair.experts_implementation}): {len(prompts)} prompts x {args.max_new_tokens} "
        f"tokens at batch sizes {args.batch_sizes}, K in {args.ks}",
        flush=True,
    )
    result = calibrate_batch(pair, prompts, args.batch_sizes, args.ks, args.max_new_tokens)
    fit = result.cost
    cost.meta["batch"] = fit.to_json()
    out = args.out or args.costmodel
    out.parent.mkdir(parents=True, exist_ok=True)
    cost.save(out)
    metrics = {
        "r2_target": fit.r2_target,
        "r2_draft": fit.r2_draft,
        "b0": fit.b0,
        "b_pos": fit.b_pos,
        "b_union": fit.b_union,
        "b_ctx": fit.b_ctx,
        "d0": fit.d0,
        "d_tok": fit.d_tok,
        "s0": fit.s0,
        "s_row": fit.s_row,
        "union_decay": fit.union_decay,
        "passes": fit.records,
        "seconds": result.seconds,
    }
    with tracked_run("calibrate_batch", params={k: str(v) for k, v in vars(args).items()}) as t:
        t.log_metrics(metrics)
        t.log_artifact(str(out))
        run_id = t.run_id
    print(
        f"\nT_T(P, U, A) = {fit.b0:.3f} + {fit.b_pos:.4f} P + {fit.b_union:.4f} U + "
        f"{fit.b_ctx:.7f} A ms  (R^2 {fit.r2_target:.3f}; A = sum of positions x context)"
    )
    print(
        f"T_D(n)       = {fit.d0:.3f} + {fit.d_tok:.4f} n ms per draft round of n  "
        f"(R^2 {fit.r2_draft:.3f})"
    )
    print(
        f"S(B)         = {fit.s0:.3f} + {fit.s_row:.4f} B ms of bookkeeping per step  "
        f"(R^2 {fit.r2_step:.3f})"
    )
    print(
        f"U(P)         = {fit.experts} - {fit.experts - fit.top_k} x {fit.union_decay:.4f}^(P-1)"
        f"  (U(8) = {fit.union(8):.1f}, U(40) = {fit.union(40):.1f})"
    )
    print(
        f"one more position in a pass of 8 / 40: {fit.marginal_target(8, 1):.3f} / "
        f"{fit.marginal_target(40, 1):.3f} ms"
    )
    print(
        f"\nwrote the batch section of {out} ({fit.records} passes, {result.seconds:.0f} s); "
        f"MLflow run {run_id} at {tracking_uri()}"
    )
    return {"batch": fit, "out": str(out)}


if __name__ == "__main__":
    run(main)
