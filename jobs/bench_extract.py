"""Junk-tail modes compared on the same sequences in one run: `paper` (an independent tail per
(i, k, a), the paper's literal procedure) against `shared` (one tail per divergence point).

Prints wall time, target token-forwards per reference token and the mean of U(i, k, a) under
each mode (they must agree: both give every cell a correctly distributed tail), and the ratios.

    python -m jobs.bench_extract --limit 8 --max-new-tokens 128 --lmax 8
"""

from __future__ import annotations

import argparse

from jobs.cli import add_model_args, parser, run
from pipeline.extract_bench import bench_mode
from pipeline.models import load_pair
from pipeline.prompts import load_prompts
from pipeline.reference import build_references
from pipeline.tracking import tracked_run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.bench_extract", __doc__)
    add_model_args(p, experts=False)
    p.add_argument("--source", default="humaneval")
    p.add_argument("--limit", type=int, default=8, help="sequences (8)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="reference length (128)")
    p.add_argument("--lmax", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    pair = load_pair(args.target, args.draft, args.device, args.dtype)
    refs = build_references(
        load_prompts(args.source, args.limit), pair.target, pair.tokenizer, args.max_new_tokens
    )
    print(
        f"{len(refs)} sequences, {sum(r.n_tokens for r in refs)} reference tokens, "
        f"Lmax {args.lmax}, {pair.device}",
        flush=True,
    )
    results = {mode: bench_mode(pair, refs, args.lmax, mode, args.seed)
               for mode in ("shared", "paper")}  # fmt: skip
    shared, paper = results["shared"], results["paper"]
    print(f"\n{'mode':<8}{'wall s':>9}{'tail tokens':>13}{'target fwd/ref tok':>20}"
          f"{'mean U':>9}{'cells':>8}")  # fmt: skip
    for r in results.values():
        print(f"{r.mode:<8}{r.seconds:>9.2f}{r.tail_tokens:>13,}"
              f"{r.target_forwards_per_ref_token:>20.2f}{r.mean_u:>9.3f}{r.cells:>8,}")  # fmt: skip
    speedup = paper.seconds / shared.seconds
    u_gap = abs(shared.mean_u - paper.mean_u) / paper.mean_u
    print(f"\nshared is {speedup:.1f}x faster than paper (wall time, same sequences, one run)")
    fwd_shared = shared.target_forwards_per_ref_token
    fwd_paper = paper.target_forwards_per_ref_token
    print(
        f"target token-forwards per reference token: shared {fwd_shared:.2f} "
        f"(aim <= Lmax + 2 = {args.lmax + 2}), paper {fwd_paper:.2f}; without the prompt "
        f"prefill: shared {shared.target_forwards_per_ref_token_excl_prompt:.2f}, "
        f"paper {paper.target_forwards_per_ref_token_excl_prompt:.2f}"
    )
    print(
        f"mean U(i,k,a): shared {shared.mean_u:.3f} vs paper {paper.mean_u:.3f} "
        f"({u_gap:.2%} apart; must be < 3%)"
    )
    summary = {
        "speedup_shared_over_paper": speedup,
        "mean_u_gap": u_gap,
        **{f"{m}_{k}": v for m, r in results.items() for k, v in vars(r).items() if k != "mode"},
    }
    with tracked_run("bench_extract", params=vars(args)) as run:
        run.log_metrics(summary)
    return summary


if __name__ == "__main__":
    run(main)
