"""The tree bound against the tree policies: on the same prompts, at T = 0, the
chain bound and the tree bound of each selection rule (EAGLE-2's top path probability,
EcoSpec's expert-aware rule) per largest budget K (gamma <= K + 1 verified positions), and the
fraction of its rule's bound each tree policy (`tree`, `ecospec`) captures, modelled/modelled
and measured, with the extraction cost of the tree tables per reference token.

`ar` and the policies decode every prompt interleaved, --repeats times (measured speedups per
repeat); `ar`'s text is the reference the bounds are solved on. Everything is priced with the
artifacts' costmodel.json, measured on this machine's kind of setup. Before decoding, the cost
model must price every step each policy may take (m up to its gamma); each policy's score is
appended to OUT/policies.jsonl when it is done, and a policy whose scoring fails is reported
at the end (non-zero exit) without losing the others'.

    python -m jobs.bench_tree                                   # 16 HumanEval prompts x 128
    python -m jobs.bench_tree --limit 4 --max-new-tokens 32 --repeats 1   # a quick look
    python -m jobs.bench_tree --policies tree:depth=4:branch=2:gamma=9,ecospec --rules eagle2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

from jobs.cli import (
    add_limit_arg,
    add_max_new_tokens_arg,
    add_model_args,
    add_out_arg,
    add_repeats_arg,
    add_source_arg,
    add_threads_arg,
    parse_ks,
    parse_policy_specs,
    parser,
    run,
    torch_threads,
)
from pipeline.bench.guard import ResultLog, raise_failures
from pipeline.bench.tree_bound import (
    DEFAULT_RULES,
    SELECTION_OF,
    format_tree_bench,
    policy_rule,
    run_tree_bench,
)
from pipeline.data.domains import load_prompts
from pipeline.data.prompts import encode
from pipeline.decode.policies.artifacts import MODELS_DIR, load_artifacts
from pipeline.decode.policies.registry import validate_knobs
from pipeline.extract.draft_trees import TreeRule
from pipeline.models.loading import load_pair
from pipeline.tracking import tracked_run, tracking_uri

DEFAULT_POLICIES = "tree:depth=4:branch=2:gamma=9,tree:depth=3:branch=2:gamma=4,ecospec"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.bench_tree", __doc__)
    add_model_args(p)
    add_source_arg(p)
    add_limit_arg(p, 16)
    add_max_new_tokens_arg(p, 128)
    p.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help=f"tree policies, name:knob=value:... (default: {DEFAULT_POLICIES}); "
        "unset knobs take the policy's defaults",
    )
    p.add_argument(
        "--rules",
        default=",".join(DEFAULT_RULES),
        help="selection rules of the per-budget table (eagle2, ecospec, with "
        ":b=BRANCH,d=DEPTH; default: eagle2,ecospec, branch 2, no depth cap)",
    )
    p.add_argument(
        "--budgets",
        type=parse_ks,
        default=parse_ks("1,2,3,4,6,8,12"),
        help="largest budgets K in draft nodes (1,2,3,4,6,8,12); the cost model "
        "must cover m = K + 1",
    )
    add_repeats_arg(p, 3, "interleaved decoding repeats")
    add_threads_arg(p, 1, "as a serving replica runs")
    p.add_argument(
        "--artifacts",
        type=Path,
        default=MODELS_DIR,
        metavar="DIR",
        help="predictor/, costmodel.json and policy.json from DIR (default: the "
        "embedded pair's, models/)",
    )
    add_out_arg(p, Path("out/bench_tree"), "policies.jsonl, each policy's score as it is done")
    args = p.parse_args(argv)
    if not args.artifacts.is_dir():
        p.error(f"--artifacts {args.artifacts}: not a directory")
    if min(args.limit, args.max_new_tokens, args.repeats, args.threads, min(args.budgets)) < 1:
        p.error("--limit, --max-new-tokens, --repeats, --threads and --budgets must be >= 1")
    try:
        args.specs = []
        for name, knobs in parse_policy_specs(args.policies):
            if name not in SELECTION_OF:
                raise ValueError(f"{name} is not a tree policy ({', '.join(SELECTION_OF)})")
            args.specs.append((name, validate_knobs(name, knobs)))
            policy_rule(name, knobs)
        args.rules = tuple(TreeRule.parse(r).name for r in args.rules.split(",") if r.strip())
    except ValueError as exc:
        p.error(f"--policies/--rules: {exc}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with torch_threads(args.threads):
        pair = load_pair(
            args.target, args.draft, args.device, args.dtype, args.experts_implementation
        )
        d = args.artifacts
        artifacts = load_artifacts(
            d / "predictor",
            d / "costmodel.json",
            d / "policy.json",
            str(pair.device),
            d / "acceptance.json",
        )
        artifacts.check_pair(pair)
        prompts = [encode(pair.tokenizer, p.text) for p in load_prompts(args.source, args.limit)]
        print(
            f"{len(prompts)} {args.source} prompts x {args.max_new_tokens} tokens, T=0, "
            f"{args.repeats} interleaved repeats, budgets {args.budgets}",
            flush=True,
        )
        bench = run_tree_bench(
            pair,
            artifacts,
            prompts,
            args.max_new_tokens,
            args.specs,
            args.rules,
            tuple(args.budgets),
            args.repeats,
            record=ResultLog(args.out / "policies.jsonl").write,
        )
    header = (
        f"{len(prompts)} {args.source} prompts x {args.max_new_tokens} tokens, T=0, "
        f"{pair.device}, {pair.dtype}, {pair.experts_implementation} experts"
    )
    table = format_tree_bench(bench, header)
    params = {k: str(v) for k, v in vars(args).items() if k != "specs"}
    with tracked_run("bench_tree", params=params) as tracked:
        tracked.log_metrics(
            {f"{r.bound}_k{r.budget}": r.speedup for r in bench.budgets.itertuples()}
        )
        tracked.log_metrics(
            {
                "of_bound_" + re.sub(r"[^\w.-]+", "_", s.label): s.of_bound_modelled
                for s in bench.policies
            }
        )
        tracked.log_metrics({"tree_target_forwards_per_token": bench.target_forwards_per_token})
        tracked.log_text(table, "bench_tree.txt")
        tracked.log_text(
            json.dumps([dataclasses.asdict(s) for s in bench.policies], indent=1), "policies.json"
        )
        run_id = tracked.run_id
    print(table)
    print(f"\nMLflow run {run_id} at {tracking_uri()}; scores in {args.out / 'policies.jsonl'}")
    raise_failures("bench_tree", bench.failures)  # after every other result is out
    return {"bench": bench}


if __name__ == "__main__":
    run(main)
