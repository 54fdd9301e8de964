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

    python -m jobs.acceptance_ceiling                                   # the embedded pair
    python -m jobs.acceptance_ceiling --draft models/draft-2layer --artifacts models/draft-2layer
    python -m jobs.acceptance_ceiling --trees eagle2:b=2 --max-k 8      # trees beside chains
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jobs.cli import add_model_args, parser, run, torch_threads
from pipeline.acceptance.ceiling import Ceiling, ceiling
from pipeline.acceptance.model import AcceptanceModel
from pipeline.acceptance.traces import collect_traces, load_traces, prompt_ids, save_traces
from pipeline.acceptance.tree_ceiling import TreeCeiling, texts_tree_ceiling
from pipeline.cost.model import CostModel
from pipeline.data.domains import DOMAINS, load_domain
from pipeline.decode.types import SamplingConfig
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
    p.add_argument("--limit", type=int, default=8, help="prompts per domain, the bench's (8)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (64)")
    p.add_argument("--temperatures", default="0,1", help="comma-separated (0,1)")
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
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    args = p.parse_args(argv)
    try:
        args.trees = TreeRule.parse(args.trees) if args.trees else None
    except ValueError as exc:
        p.error(f"--trees: {exc}")
    if args.trees is not None and args.trees.selection != "eagle2":
        p.error("--trees takes an eagle2 rule (the ecospec rule needs the expert predictor)")
    try:
        args.temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
        args.fixed = [int(k) for k in args.fixed.split(",") if k.strip()]
    except ValueError:
        p.error("--temperatures takes numbers and --fixed integers, comma-separated")
    if not args.temperatures or min(args.temperatures) < 0:
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
    prompts = {name: load_domain(name, args.limit) for name in DOMAINS}
    flat = [p for chosen in prompts.values() for p in chosen]
    if args.traces is not None and args.traces.exists():
        traces, _, _ = load_traces(args.traces)
        if any(t.depth is not None for t in traces):
            raise ValueError(
                f"{args.traces} holds an EAGLE-3 head's chains (jobs.train_acceptance's); the "
                "ceiling replays positions one after another: give another --traces path"
            )
        print(f"{len(traces)} traces read from {args.traces}", flush=True)
    else:
        print(
            f"tracing {len(flat)} prompts x T in {args.temperatures}, {args.max_new_tokens} "
            "tokens each",
            flush=True,
        )
        with torch_threads(args.threads):
            traces, unions = collect_traces(
                pair,
                flat,
                args.temperatures,
                args.max_new_tokens,
                1,
                log=lambda line: print(line, flush=True),
                chains=False,  # the ceiling replays positions one after another
            )
        if args.traces is not None:
            save_traces(args.traces, traces, unions, {"prompts": [p.prompt_id for p in flat]})
    ids_of = {p.prompt_id: prompt_ids(pair, p) for p in flat}
    context = {name: len(ids) for name, ids in ids_of.items()}

    def step_for(prompt_id: str):
        def step(k: int, t: int) -> float:
            return cost.t_draft(k) + cost.t_target(
                k + 1, acceptance.union(k + 1), context[prompt_id] + t
            )

        return step

    results: dict[tuple[str, float], Ceiling] = {}
    print("\ndomain  T    best fixed K  ceiling over best fixed  ceiling over ar  (modelled)")
    for temp in args.temperatures:
        for name, chosen in prompts.items():
            ids = {p.prompt_id for p in chosen}
            mine = [t for t in traces if t.temperature == temp and t.prompt_id in ids]
            if not mine:
                raise ValueError(
                    f"no traces of {name} at T={temp:g} in {args.traces}: remove "
                    "the file to trace again"
                )
            res = ceiling(
                [t.labels for t in mine],
                lambda i, mine=mine: step_for(mine[i].prompt_id),
                args.max_k,
                args.fixed,
            )
            results[(name, temp)] = res
            print(
                f"{name:6s}  {temp:<4g} {res.best_k:>12d}  {res.gain_over_best_fixed:>22.3f}x"
                f"  {res.speedup_over_ar:>14.3f}x",
                flush=True,
            )
            if args.trees is not None:
                res.tree = _with_trees(pair, mine, temp, args, cost, acceptance, ids_of)
    if args.trees is not None:
        print(f"\nover the best fixed K, trees of {args.trees.name} up to {args.max_k} nodes")
        print("domain  T    chains  trees  chain-or-tree  (modelled)")
        for (name, temp), res in results.items():
            gains = res.tree.over_best_fixed()
            print(
                f"{name:6s}  {temp:<4g} {gains['chain']:>6.3f}x {gains['tree']:>6.3f}x "
                f"{gains['chain_or_tree']:>13.3f}x"
            )
    with tracked_run("acceptance_ceiling", params={k: str(v) for k, v in vars(args).items()}) as t:
        t.log_metrics(
            {
                f"{n}_T{temp:g}_ceiling_over_best_fixed": r.gain_over_best_fixed
                for (n, temp), r in results.items()
            }
        )
        t.log_metrics(
            {
                f"{n}_T{temp:g}_{kind}_over_best_fixed": gain
                for (n, temp), r in results.items()
                if r.tree is not None
                for kind, gain in r.tree.over_best_fixed().items()
            }
        )
    return results


def _with_trees(
    pair,
    traces: list,
    temp: float,
    args: argparse.Namespace,
    cost: CostModel,
    acceptance: AcceptanceModel,
    ids_of: dict[str, list[int]],
) -> TreeCeiling:
    """The group's tree ceilings along its traces' texts: a step priced T_D(draft forwards) +
    T_T(m, U(m), L), a chain of k tokens as m = k + 1 with k forwards like the chain ceiling's."""
    if any(t.tokens is None for t in traces):
        raise ValueError(
            f"{args.traces} holds traces without their texts (saved before --trees existed): "
            "remove the file to trace again"
        )
    texts = []
    for t in traces:
        ctx = len(ids_of[t.prompt_id])

        def step(forwards: int, m: int, pos: int, ctx: int = ctx) -> float:
            return cost.t_draft(forwards) + cost.t_target(m, acceptance.union(m), ctx + pos)

        texts.append((ids_of[t.prompt_id], t.tokens, t.labels, step))
    with torch_threads(args.threads):
        return texts_tree_ceiling(
            pair, texts, SamplingConfig(temperature=temp), args.trees, args.max_k, args.fixed
        )


if __name__ == "__main__":
    run(main)
