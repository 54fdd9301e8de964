"""Extraction benchmarks on the same prompts in one run.

Batching: references generated and extracted one sequence at a time against --batch-size at a
time (jobs.extract's default tails: every acceptance, 2 draws, shared mode). Prints reference
tokens/s of the greedy generation alone and end to end (generation + teacher-forced passes +
junk tails), the ratios, and how many rows are identical.

Junk-tail modes (on the batched references): `paper` (an independent tail per (i, k, a), the
paper's literal procedure) against `shared` (one tail per divergence point), on one set of tails
(surrogate acceptance, one draw; jobs.extract's default extracts 5 such sets). Prints wall time,
target token-forwards per reference token and the mean of U(i, k, a) under each mode (they must
agree: both give every cell a correctly distributed tail), and the ratios.

    python -m jobs.bench_extract --limit 16 --max-new-tokens 128 --lmax 8 --batch-size 16
"""

from __future__ import annotations

import argparse

from jobs.cli import (
    add_limit_arg,
    add_lmax_arg,
    add_max_new_tokens_arg,
    add_model_args,
    add_seed_arg,
    add_source_arg,
    parser,
    run,
)
from pipeline.bench.extract_batching import compare_batching, format_batching
from pipeline.bench.tail_modes import compare_tail_modes, format_comparison
from pipeline.data.domains import load_prompts
from pipeline.models.loading import load_pair
from pipeline.tracking import tracked_run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.bench_extract", __doc__)
    add_model_args(p)
    add_source_arg(p)
    add_limit_arg(p, 8, "each a reference sequence")
    add_max_new_tokens_arg(p, 128, "the reference's length")
    add_lmax_arg(p, 8)
    add_seed_arg(p, "of the junk-tail sampling")
    p.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="sequences per batch, compared against one at a time (16)",
    )
    p.add_argument("--skip-tail-modes", action="store_true", help="only the batching comparison")
    args = p.parse_args(argv)
    if args.batch_size < 1:
        p.error("--batch-size must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    pair = load_pair(args.target, args.draft, args.device, args.dtype, args.experts_implementation)
    prompts = load_prompts(args.source, args.limit)
    print(f"{len(prompts)} prompts, Lmax {args.lmax}, {pair.device}", flush=True)
    batching, refs = compare_batching(
        pair, prompts, args.max_new_tokens, args.lmax, args.seed, args.batch_size
    )
    print(format_batching(batching), flush=True)
    summary = {f"batching_{k}": v for k, v in batching.metrics().items()}
    if not args.skip_tail_modes:
        print(f"\n{len(refs)} sequences, {sum(r.n_tokens for r in refs)} reference tokens")
        result = compare_tail_modes(pair, refs, args.lmax, args.seed)
        print(format_comparison(result))
        summary.update(result.metrics())
    with tracked_run("bench_extract", params=vars(args)) as tracked:
        tracked.log_metrics(summary)
    return summary


if __name__ == "__main__":
    run(main)
