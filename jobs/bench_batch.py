"""Continuous batching in-process: output tokens/s of policies decoding the same prompts
continuously batched, at each batch size, interleaved over repeats (the machine's drift slows
every cell alike), with each policy's ratio to the best fixed K at that batch size.

The issue-17 comparison: `batch` (the plan over the whole batch, pricing shared draft rounds
and the shared expert union) against every fixed K and `throughput` (each request's own
cost-aware choice) at 8 generations at once, T = 0:

    python -m jobs.bench_batch                                   # 16 HumanEval prompts, batch 8
    python -m jobs.bench_batch --batch-sizes 1,8,16 --repeats 3 --source sharegpt

Every policy is built before anything decodes; each repeat of each cell is appended to
OUT/cells.jsonl when it is done, and a cell whose decoding fails is reported at the end
(non-zero exit) without losing the others'.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from jobs.cli import (
    add_batch_sizes_arg,
    add_limit_arg,
    add_max_new_tokens_arg,
    add_model_args,
    add_out_arg,
    add_prompt_tokens_arg,
    add_repeats_arg,
    add_source_arg,
    add_temperature_arg,
    add_threads_arg,
    parse_policy_specs,
    parser,
    run,
    torch_threads,
)
from pipeline.bench.batch import bench_batch, format_batch_bench
from pipeline.bench.guard import ResultLog, raise_failures
from pipeline.data.domains import load_prompts
from pipeline.data.prompts import encode
from pipeline.decode.policies.artifacts import load_artifacts
from pipeline.decode.policies.registry import validate_knobs
from pipeline.models.loading import load_pair
from pipeline.tracking import tracked_run, tracking_uri

DEFAULT_SPECS = "ar,fixed:k=2,fixed:k=3,fixed:k=4,fixed:k=5,throughput,batch"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.bench_batch", __doc__)
    add_model_args(p)
    add_source_arg(p)
    add_limit_arg(p, 16)
    add_max_new_tokens_arg(p, 64)
    add_prompt_tokens_arg(p)
    add_batch_sizes_arg(p, "8")
    p.add_argument(
        "--policies",
        default=DEFAULT_SPECS,
        help=f"policies and knobs, name:knob=value,... (default: {DEFAULT_SPECS})",
    )
    add_temperature_arg(p)
    add_repeats_arg(p, 3)
    add_threads_arg(p, 1, "as a serving replica runs")
    add_out_arg(p, Path("out/bench_batch"), "cells.jsonl, each repeat of each cell as it is done")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.limit < 1 or args.max_new_tokens < 1 or args.threads < 1:
        p.error("--repeats, --limit, --max-new-tokens and --threads must be >= 1")
    if min(args.batch_sizes) < 1:
        p.error("--batch-sizes must be >= 1")
    try:
        args.specs = parse_policy_specs(args.policies)
        for name, knobs in args.specs:
            validate_knobs(name, knobs)
    except ValueError as exc:
        p.error(f"--policies: {exc}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with torch_threads(args.threads):
        pair = load_pair(
            args.target, args.draft, args.device, args.dtype, args.experts_implementation
        )
        artifacts = load_artifacts(device=str(pair.device))
        prompts = [
            encode(pair.tokenizer, p.text, keep_last=args.prompt_tokens)
            for p in load_prompts(args.source, args.limit)
        ]
        print(
            f"{len(prompts)} {args.source} prompts x {args.max_new_tokens} tokens, "
            f"T={args.temperature:g}, batch sizes {args.batch_sizes}, {args.repeats} "
            f"interleaved repeats",
            flush=True,
        )
        cells = bench_batch(
            pair,
            prompts,
            args.specs,
            args.batch_sizes,
            args.max_new_tokens,
            args.temperature,
            args.repeats,
            artifacts,
            record=ResultLog(args.out / "cells.jsonl").write,
        )
    header = (
        f"{len(prompts)} {args.source} prompts x {args.max_new_tokens} tokens, "
        f"T={args.temperature:g}, {pair.device}, continuous batching in-process"
    )
    table = format_batch_bench(cells, header)
    params = {k: str(v) for k, v in vars(args).items() if k != "specs"}
    with tracked_run("bench_batch", params=params) as tracked:
        tracked.log_metrics(
            {
                f"b{c.batch}.{c.label.replace(' ', '_').replace('=', '')}": c.mean
                for c in cells
                if c.failed is None
            }
        )
        tracked.log_text(table, "bench_batch.txt")
        tracked.log_text(json.dumps([dataclasses.asdict(c) for c in cells], indent=1), "cells.json")
        run_id = tracked.run_id
    print(table)
    print(f"\nMLflow run {run_id} at {tracking_uri()}; cells in {args.out / 'cells.jsonl'}")
    raise_failures("bench_batch", [c.failed for c in cells if c.failed is not None])
    return {"cells": cells}


if __name__ == "__main__":
    run(main)
