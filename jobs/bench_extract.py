"""Junk-tail modes compared on the same sequences in one run: `paper` (an independent tail per
(i, k, a), the paper's literal procedure) against `shared` (one tail per divergence point), on
one set of tails (surrogate acceptance, one draw; jobs.extract's default extracts 5 such sets).

Prints wall time, target token-forwards per reference token and the mean of U(i, k, a) under
each mode (they must agree: both give every cell a correctly distributed tail), and the ratios.

    python -m jobs.bench_extract --limit 8 --max-new-tokens 128 --lmax 8
"""

from __future__ import annotations

import argparse

from jobs.cli import SOURCE_HELP, add_model_args, parser, run
from pipeline.bench.tail_modes import compare_tail_modes, format_comparison
from pipeline.data.domains import load_prompts
from pipeline.data.references import build_references
from pipeline.models.loading import load_pair
from pipeline.tracking import tracked_run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.bench_extract", __doc__)
    add_model_args(p)
    p.add_argument(
        "--source",
        default="humaneval",
        help=SOURCE_HELP,
    )
    p.add_argument("--limit", type=int, default=8, help="sequences (8)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="reference length (128)")
    p.add_argument("--lmax", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    pair = load_pair(args.target, args.draft, args.device, args.dtype, args.experts_implementation)
    refs = build_references(
        load_prompts(args.source, args.limit), pair.target, pair.tokenizer, args.max_new_tokens
    )
    print(
        f"{len(refs)} sequences, {sum(r.n_tokens for r in refs)} reference tokens, "
        f"Lmax {args.lmax}, {pair.device}",
        flush=True,
    )
    result = compare_tail_modes(pair, refs, args.lmax, args.seed)
    print(format_comparison(result))
    summary = result.metrics()
    with tracked_run("bench_extract", params=vars(args)) as tracked:
        tracked.log_metrics(summary)
    return summary


if __name__ == "__main__":
    run(main)
