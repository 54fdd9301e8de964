"""Extract what the oracle needs from reference sequences, sharded over a Ray cluster.

For every reference sequence: the draft's and the target's probabilities of each reference token
(at --temperature), the experts the target's router selected for it, and the target's routing of
counterfactual junk tails (docs/contract.md), written as Parquet tables sequences/, tokens/,
tails/ under --out.
Resumable: a rerun with the same parameters skips the shards already written.

Junk tails (what the verifier is shown after the chain matched x_1..x_s and failed at x_{s+1})
come in one set per acceptance rule the oracle can bound, and per independent draw:
  surrogate  the paper's: y_1 from the draft at x_<=s with x_{s+1} removed, then draft samples
  greedy     T = 0 speculation: the draft's argmax at x_<=s, then its greedy continuation
             (deterministic: one draw only)
  sampling   speculative sampling at --temperature: y_1 from the rejected proposals
             norm(max(q - pi, 0)), then draft samples
Cost: every (acceptance, draw) set holds about N * Lmax tail tokens per sequence of N tokens in
shared mode (N * Lmax^3 / 6 in paper mode), each routed by the target and drafted by the draft;
the default (3 acceptances, 2 draws: 5 sets) costs 5x the tails of a single set.

--trees adds the trees/ table for the tree bound (python -m jobs.oracle prints it): at every
state, the nodes each selection rule verifies up to --tree-budget draft nodes, in selection
order, with the target's routing of each (off-path nodes in packed tree-masked forwards):
  eagle2     EAGLE-2 / the `tree` policy: the top path probabilities of the draft's tree
  ecospec    EcoSpec / the `ecospec` policy: path probability over new predicted experts
             (reads the expert predictor, --predictor)
each with the tree's branch and depth cap, e.g. eagle2:b=2,d=4 (default b=2, no depth cap).

    python -m jobs.extract --limit 16 --lmax 12 --trees eagle2,ecospec --out out/extract

    python -m jobs.extract --source humaneval --limit 16 --out out/extract
    ray job submit --working-dir . -- python -m jobs.extract --source humaneval --limit 16
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from jobs.cli import (
    add_limit_arg,
    add_lmax_arg,
    add_max_new_tokens_arg,
    add_model_args,
    add_num_cpus_arg,
    add_out_arg,
    add_predictor_arg,
    add_seed_arg,
    add_source_arg,
    add_threads_arg,
    parser,
    ray_session,
    run,
)
from pipeline.data.domains import load_prompts
from pipeline.extract.draft_trees import TreeRule
from pipeline.extract.junk_tails import ACCEPTANCES, TAIL_MODES, draws_per_acceptance
from pipeline.extract.ray_pipeline import ExtractConfig, run_extraction
from pipeline.models.eagle3_formats import head_format
from pipeline.tracking import tracked_run, tracking_uri


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.extract", __doc__)
    add_model_args(p)
    add_source_arg(p)
    add_limit_arg(p, None)
    add_out_arg(p, Path("out/extract"))
    add_lmax_arg(p, 8, "priced")
    p.add_argument("--tail-mode", choices=TAIL_MODES, default="shared", help="junk-tail sampling")
    add_seed_arg(p, "of the junk-tail sampling")
    p.add_argument(
        "--acceptance",
        default=",".join(ACCEPTANCES),
        help="comma list of junk-tail sets to extract (default: all): surrogate for the "
        "paper's bound, greedy for T = 0 speculation, sampling for speculative sampling; "
        "each set costs about N * Lmax tail tokens per sequence and draw",
    )
    p.add_argument(
        "--draws",
        type=int,
        default=2,
        help="independent tail draws per acceptance (2; greedy always 1): the oracle chooses "
        "k* on one draw and prices it on another (cross-fitting); each draw is another "
        "N * Lmax tail tokens per sequence",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="temperature of draft_prob, target_prob and the sampled tails (1.0); "
        "greedy tails do not depend on it",
    )
    p.add_argument(
        "--trees",
        default="",
        help="comma list of draft-tree selection rules "
        "for the tree bound (eagle2, ecospec, with :b=BRANCH,d=DEPTH); default none",
    )
    p.add_argument(
        "--tree-budget",
        type=int,
        default=12,
        help="draft nodes per state kept for each rule (12: gamma <= 13)",
    )
    add_predictor_arg(p)
    add_max_new_tokens_arg(p, 128, "the reference's length budget")
    p.add_argument(
        "--use-given",
        action="store_true",
        help="use the source's references (the first turn's; of a list of answers, the first)",
    )
    p.add_argument("--shard-size", type=int, default=4, help="sequences per shard (4)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="sequences decoded and teacher-forced together (16; 1: one at a time); batches "
        "form within a shard, so a shard smaller than this caps them",
    )
    p.add_argument("--actors", type=int, default=None, help="actor pool size (default: auto)")
    p.add_argument("--cpus-per-actor", type=float, default=None, help="CPU actors' num_cpus")
    add_threads_arg(p, 0, "per CPU actor (0: the node's cores shared among the actors)")
    p.add_argument(
        "--address",
        default=None,
        help="Ray address, e.g. auto (default: the job's cluster "
        "under `ray job submit`, else a new local one)",
    )
    add_num_cpus_arg(p)
    p.add_argument("--overwrite", action="store_true", help="discard an earlier run in --out")
    args = p.parse_args(argv)
    for name in ("lmax", "max_new_tokens", "shard_size", "batch_size", "tree_budget"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be >= 1")
    args.acceptance = tuple(a.strip() for a in args.acceptance.split(",") if a.strip())
    try:
        draws_per_acceptance(args.acceptance, args.draws)
    except ValueError as err:
        p.error(f"--acceptance/--draws: {err}")
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        p.error("--temperature must be a positive number")
    args.trees = tuple(r.strip() for r in args.trees.split(",") if r.strip())
    try:
        rules = [TreeRule.parse(r) for r in args.trees]
    except ValueError as err:
        p.error(f"--trees: {err}")
    if len({r.name for r in rules}) != len(rules):
        p.error("--trees: a rule is given twice")
    args.trees = tuple(r.name for r in rules)
    if args.trees and head_format(args.draft) is not None:
        p.error(
            "--trees: draft trees are built by a separate draft model's forwards; the draft "
            f"{args.draft} is an EAGLE-3 head (extract its chains without --trees)"
        )
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    prompts = load_prompts(args.source, args.limit)
    config = ExtractConfig(
        target=str(args.target),
        draft=str(args.draft),
        out=str(args.out.resolve()),
        lmax=args.lmax,
        mode=args.tail_mode,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        use_given=args.use_given,
        device=args.device,
        dtype=args.dtype,
        experts_implementation=args.experts_implementation,
        threads=args.threads,
        acceptances=args.acceptance,
        draws=args.draws,
        temperature=args.temperature,
        batch_size=args.batch_size,
        trees=args.trees,
        tree_budget=args.tree_budget,
        predictor=str(args.predictor.resolve()) if args.trees else None,
    )
    with (
        ray_session(args.address, args.num_cpus),
        tracked_run(
            "extract",
            params={**config.manifest(args.source, args.limit, args.shard_size), "out": config.out},
        ) as run,
    ):
        result = run_extraction(
            config,
            prompts,
            args.source,
            args.limit,
            shard_size=args.shard_size,
            actors=args.actors,
            cpus_per_actor=args.cpus_per_actor,
            overwrite=args.overwrite,
        )
        stats = result["stats"]
        seconds = max(stats.seconds, 1e-9)
        run.log_metrics(
            {
                "sequences": stats.sequences,
                "reference_tokens": stats.reference_tokens,
                "tail_tokens": stats.tail_tokens,
                "tails": stats.tails,
                "shards_done": result["shards_done"],
                "shards_skipped": result["shards_skipped"],
                "nodes": len(result["nodes"]),
                "reference_tokens_per_s": stats.reference_tokens / seconds,
                "target_forwards_per_reference_token": stats.target_token_forwards
                / max(1, stats.reference_tokens),
                "tree_nodes": stats.tree_nodes,
                "tree_target_forwards_per_reference_token": stats.tree_target_token_forwards
                / max(1, stats.reference_tokens),
                "seconds": stats.seconds,
            }
        )
        run.log_params({"output_path": config.out})
        run_id = run.run_id
    print(
        f"\nextracted {stats.sequences} sequences ({stats.reference_tokens:,} reference tokens, "
        f"{stats.tail_tokens:,} tail tokens) in {stats.seconds:.0f}s on {len(result['nodes'])} "
        f"node(s); {result['shards_skipped']} shard(s) were already complete"
    )
    if args.trees:
        per_token = stats.tree_target_token_forwards / max(1, stats.reference_tokens)
        print(
            f"trees ({', '.join(args.trees)}): {stats.tree_nodes:,} node rows; "
            f"{per_token:.2f} target token-forwards per reference token for their off-path "
            "nodes (the rest is teacher-forced)"
        )
    print(
        f"tables under {config.out}/{{sequences,tokens,tails,trees}}; MLflow run {run_id} at "
        f"{tracking_uri()}"
    )
    return result


if __name__ == "__main__":
    run(main)
