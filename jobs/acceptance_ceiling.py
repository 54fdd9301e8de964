"""The informed ceiling (pipeline/acceptance/ceiling.py): per domain and temperature, how much
any chain policy could gain over the best fixed draft length if it knew every position's
acceptance probability exactly, on the benchmark's own prompts and priced by the pair's cost
model. At T > 0 this bounds what an online policy can reach (it knows less); at T = 0 the
probabilities are the outcomes, so it is the oracle's bound.

The target decodes the first --limit prompts of each domain (what `bench_online` runs) at each
temperature; one teacher-forced pass labels every position (pipeline/acceptance/traces.py).

With --trees RULE the draft's trees (RULE: eagle2[:b=BRANCH,d=DEPTH]) are built along the
same texts and the target's probability of every node taken at the temperature: the ceilings
of a policy that may verify a tree of k = 1 .. --max-k nodes instead of a chain, and of one
that may take either at every state (pipeline/acceptance/tree_ceiling.py), beside the chains'.
At T > 0 it also prints how often one of i = 1 .. 4 candidates for a position is accepted,
drawn from the draft and verified by recursive rejection sampling, or the draft's top-i
(pipeline/acceptance/sampled_candidates.py): what multi-draft trees could buy.

    python -m jobs.acceptance_ceiling                                   # the embedded pair
    python -m jobs.acceptance_ceiling --draft models/draft-2layer --artifacts models/draft-2layer
    python -m jobs.acceptance_ceiling --trees eagle2:b=2 --max-k 8      # trees beside chains
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jobs.cli import (
    add_limit_arg,
    add_max_new_tokens_arg,
    add_model_args,
    add_temperatures_arg,
    add_threads_arg,
    parser,
    run,
    torch_threads,
)
from pipeline.acceptance.ceiling import Ceiling
from pipeline.acceptance.ceiling_study import CeilingSettings, ceiling_study
from pipeline.acceptance.model import AcceptanceModel
from pipeline.cost.model import CostModel
from pipeline.data.domains import DOMAINS, load_domain
from pipeline.extract.draft_trees import TreeRule
from pipeline.models.loading import REPO_ROOT, load_pair
from pipeline.tracking import tracked_run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.acceptance_ceiling", __doc__)
    add_model_args(p)
    p.add_argument(
        "--artifacts",
        type=Path,
        default=REPO_ROOT / "models",
        metavar="DIR",
        help="the pair's costmodel.json and acceptance.json (its expert unions by m) (models/)",
    )
    add_limit_arg(p, 8, "per domain, the bench's")
    add_max_new_tokens_arg(p, 64)
    add_temperatures_arg(p, "0,1")
    p.add_argument("--max-k", type=int, default=12, help="longest chain (12)")
    p.add_argument("--fixed", default="1,2,3,4,5,6,8", help="fixed K compared (1,2,3,4,5,6,8)")
    p.add_argument(
        "--traces",
        type=Path,
        default=None,
        help="an .npz to save the traces to, or to read when it exists",
    )
    p.add_argument(
        "--trees",
        default="",
        metavar="RULE",
        help="also the tree and chain-or-tree ceilings, trees of this eagle2 rule "
        "(eagle2:b=2; default: chains only)",
    )
    add_threads_arg(p, 1)
    args = p.parse_args(argv)
    try:
        args.trees = TreeRule.parse(args.trees) if args.trees else None
    except ValueError as exc:
        p.error(f"--trees: {exc}")
    if args.trees is not None and args.trees.selection != "eagle2":
        p.error("--trees takes an eagle2 rule (the ecospec rule needs the expert predictor)")
    try:
        args.fixed = [int(k) for k in args.fixed.split(",") if k.strip()]
    except ValueError:
        p.error("--fixed takes integers, comma-separated")
    if min(args.temperatures) < 0:
        p.error("--temperatures needs at least one value, none negative")
    if args.limit < 1 or args.max_new_tokens < 1 or args.max_k < 1:
        p.error("--limit, --max-new-tokens and --max-k must be >= 1")
    if not args.fixed or min(args.fixed) < 1 or max(args.fixed) > args.max_k:
        p.error(f"--fixed must lie in 1 .. --max-k ({args.max_k})")
    for name in ("costmodel.json", "acceptance.json"):
        if not (args.artifacts / name).exists():
            p.error(f"--artifacts {args.artifacts}: no {name}")
    return args


def main(argv: list[str] | None = None) -> dict[tuple[str, float], Ceiling]:
    args = parse_args(argv)
    pair = load_pair(args.target, args.draft, args.device, args.dtype, args.experts_implementation)
    cost = CostModel.load(args.artifacts / "costmodel.json")
    acceptance = AcceptanceModel.load(args.artifacts / "acceptance.json")
    cost.require_m(range(1, args.max_k + 2), f"--max-k {args.max_k}")
    settings = CeilingSettings(
        args.temperatures,
        args.max_new_tokens,
        args.max_k,
        tuple(args.fixed),
        args.trees,
        args.traces,
    )
    prompts = {name: load_domain(name, args.limit) for name in DOMAINS}
    with torch_threads(args.threads):
        study = ceiling_study(
            pair, prompts, cost, acceptance, settings, log=lambda line: print(line, flush=True)
        )
    if args.trees is not None:
        print("\n" + study.tree_table(args.max_k))
        if study.candidates:
            print("\n" + study.candidates_table())
    with tracked_run("acceptance_ceiling", params={k: str(v) for k, v in vars(args).items()}) as t:
        t.log_metrics(study.metrics())
    return study.results


if __name__ == "__main__":
    run(main)
