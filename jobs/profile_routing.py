"""Routing profile of a MoE target on reference text.

Loads the target and draft (default: the embedded models under models/), builds reference
sequences from a prompt source (the target's greedy continuation, or the source's own
references with --use-given), captures the experts the router selected for every reference
token in one teacher-forced pass, and reports experts used per layer and the mean number of
unique experts per layer in windows of 1..8 consecutive tokens. Logged to MLflow.

    python -m jobs.profile_routing                          # HumanEval, embedded models
    python -m jobs.profile_routing --source prompts.jsonl --limit 50 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from jobs.cli import (
    add_limit_arg,
    add_max_new_tokens_arg,
    add_model_args,
    add_out_arg,
    add_source_arg,
    parser,
    run,
)
from pipeline.data.domains import load_prompts
from pipeline.data.references import build_references
from pipeline.extract.routing_profile import profile_references
from pipeline.models.loading import load_pair
from pipeline.tracking import tracked_run, tracking_uri


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.profile_routing", __doc__)
    add_model_args(p)
    add_source_arg(p)
    add_limit_arg(p, 24)
    add_max_new_tokens_arg(p, 96, "the reference's length budget")
    p.add_argument(
        "--use-given",
        action="store_true",
        help="use the source's references when present (the first turn's; of a list, the first)",
    )
    p.add_argument("--max-window", type=int, default=8, help="largest window (default 8)")
    add_out_arg(p, Path("out/profile"))
    args = p.parse_args(argv)
    if args.limit < 1 or args.max_new_tokens < 1 or args.max_window < 1:
        p.error("--limit, --max-new-tokens and --max-window must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    pair = load_pair(args.target, args.draft, args.device, args.dtype, args.experts_implementation)
    print(
        f"loaded {pair.spec.family} target and draft on {pair.device} ({pair.dtype}, "
        f"experts={pair.experts_implementation})",
        flush=True,
    )
    prompts = load_prompts(args.source, args.limit)
    refs = build_references(
        prompts, pair.target, pair.tokenizer, args.max_new_tokens, use_given=args.use_given
    )
    profile = profile_references(pair.target, pair.spec, refs, args.max_window)

    result = profile.as_dict()
    args.out.mkdir(parents=True, exist_ok=True)
    out_file = args.out / "routing_profile.json"
    out_file.write_text(json.dumps(result, indent=2) + "\n")
    params = {k: str(v) for k, v in vars(args).items()}
    with tracked_run("profile_routing", params=params) as run:
        metrics = {f"unique_experts_w{w}": v for w, v in profile.mean_unique_in_window().items()}
        for layer, used in zip(pair.spec.moe_layers, profile.experts_used_per_layer(), strict=True):
            metrics[f"experts_used_layer{layer}"] = used
        metrics.update(sequences=len(refs), reference_tokens=profile.tokens)
        run.log_metrics(metrics)
        run.log_artifact(str(out_file))
        run_id = run.run_id

    print()
    print(profile.report())
    print()
    print(f"wrote {out_file}; MLflow run {run_id} at {tracking_uri()}")
    print(f"done in {time.perf_counter() - started:.0f}s")
    return result


if __name__ == "__main__":
    run(main)
