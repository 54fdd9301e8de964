"""The Bellman oracle over an extraction: the optimal draft length at every position, the
speedup bound per Lmax, delta space and the boundary slope lambda, and the alpha = 0 ablation.

Reads the extraction's tables (tokens, tails, sequences) and a calibrated costmodel.json;
writes decisions.parquet and summary.parquet (docs/contract.md, section 2), lmax_sweep.csv/.png,
delta_space.png, policy.json (lambda, for the online `marginal` policy) and
ablation_alpha0.json under --out. Sequences are solved in parallel Ray tasks.

An extraction made with --trees also gets the tree bound beside the chain bound per budget
(T = 0, greedy acceptance; tree_bound.csv): each selection rule's Bellman limit over budgets
gamma <= K + 1, priced with the same cost model (pipeline.oracle.tree_bound).

summary.parquet and the printed table cover every acceptance rule the extraction has tails for
(greedy, sampling, surrogate), with and without the plain step (k = 0), in-sample (the bound)
and cross-fitted (k* chosen on one tail draw, priced on another: the achievable estimate).
--acceptance and --no-plain-step select the configuration of decisions.parquet, delta space,
lambda (policy.json) and the ablation.

    python -m jobs.oracle --extract out/extract --costmodel out/calibration/costmodel.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from jobs.cli import add_num_cpus_arg, add_out_arg, add_target_arg, parse_ks, ray_session, run
from pipeline.cost.model import CostModel
from pipeline.cost.provenance import manifest_provenance
from pipeline.models.adapters import moe_spec
from pipeline.models.loading import load_config, load_tokenizer
from pipeline.oracle.fanout import OracleConfig
from pipeline.oracle.inputs import ACCEPTANCE_MODES, extraction_lmax
from pipeline.oracle.study import StudyResult, format_study, run_study
from pipeline.oracle.tree_study import format_tree_study, study_from_extraction
from pipeline.tracking import tracked_run, tracking_uri


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jobs.oracle",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--extract", type=Path, default=Path("out/extract"), help="extraction dir")
    p.add_argument("--costmodel", type=Path, default=Path("out/calibration/costmodel.json"))
    add_target_arg(p)
    p.add_argument(
        "--lmax", type=parse_ks, default=None, help="Lmax sweep, e.g. 1-12 (default: 1..extracted)"
    )
    p.add_argument(
        "--decisions-lmax", type=int, default=None, help="Lmax of decisions (default: largest)"
    )
    p.add_argument(
        "--acceptance",
        choices=ACCEPTANCE_MODES,
        default="surrogate",
        help="acceptance rule of the decisions, delta space and lambda: surrogate (r_j = draft "
        "probability, the paper's; the units the online marginal rule measures progress in, so "
        "the default), greedy (r_j = draft argmax matches, exact at T = 0) or sampling "
        "(r_j = min(1, draft prob / target prob), speculative sampling at the extraction's T); "
        "each is priced with its own junk tails. The summary covers all three regardless",
    )
    p.add_argument(
        "--no-plain-step",
        dest="plain_step",
        action="store_false",
        help="the selected configuration drafts k >= 1 at every state (the paper's); by default "
        "k = 0, a plain step, is an action too, so the bound is >= 1",
    )
    add_out_arg(p, Path("out/oracle"))
    p.add_argument(
        "--allow-costmodel-mismatch",
        action="store_true",
        help="price with a cost model measured on other checkpoints, dtype or experts "
        "implementation than the extraction's (refused by default)",
    )
    add_num_cpus_arg(p)
    return p.parse_args(argv)


def study_metrics(result: StudyResult) -> dict[str, float]:
    """MLflow metrics: the headline (selected configuration, in-sample) keeps its old names
    (speedup_lmaxL, mean_k_lmaxL); every variant is speedup_<acceptance>_<k0|k1>_lmaxL and
    speedup_crossfit_<acceptance>_<k0|k1>_lmaxL (k0: the plain step available)."""
    selected = result.selected()
    metrics = {f"speedup_lmax{int(r.lmax)}": r.speedup_bound for r in selected.itertuples()}
    metrics.update({f"mean_k_lmax{int(r.lmax)}": r.mean_draft_len for r in selected.itertuples()})
    overall = result.sweep[result.sweep["category"] == "all"]
    for r in overall.itertuples():
        tag = f"{r.acceptance}_{'k0' if r.plain_step else 'k1'}_lmax{int(r.lmax)}"
        metrics[f"speedup_{tag}"] = r.speedup_bound
        if not pd.isna(r.speedup_crossfit):
            metrics[f"speedup_crossfit_{tag}"] = r.speedup_crossfit
    metrics.update({f"delta_{k}": v for k, v in result.delta.items() if v is not None})
    metrics.update(ablation_share_changed=result.ablation["share_changed"])
    return metrics


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not (args.extract / "manifest.json").is_file():
        raise ValueError(f"{args.extract} is not an extraction directory (no manifest.json)")
    extracted = extraction_lmax(args.extract)
    lmaxes = args.lmax or list(range(1, extracted + 1))
    if max(lmaxes) > extracted or min(lmaxes) < 1:
        raise ValueError(f"Lmax sweep {lmaxes} must lie in 1..{extracted} (the extraction's Lmax)")
    decisions_lmax = args.decisions_lmax or max(lmaxes)
    manifest = json.loads((args.extract / "manifest.json").read_text())
    # The bound prices the extraction's routing with this cost model: both must come from the
    # same checkpoints, dtype and experts implementation.
    want_trees = bool(manifest.get("trees")) and "greedy" in manifest.get("acceptances", [])
    if manifest.get("trees") and not want_trees:
        print("no tree bound: the extraction has trees but no greedy tails for the chain bound")
    need = max(max(lmaxes), int(manifest.get("tree_budget", 0)) if want_trees else 0)
    model = CostModel.load(
        args.costmodel,
        range(1, need + 2),
        f"the oracle at Lmax {max(lmaxes)}"
        + (f" and the tree bound at budget {manifest['tree_budget']}" if want_trees else ""),
        provenance=manifest_provenance(manifest),
        allow_mismatch=args.allow_costmodel_mismatch,
    )
    spec = moe_spec(load_config(args.target))
    tokenizer = load_tokenizer(args.target)
    with ray_session(num_cpus=args.num_cpus):
        params = {**{k: str(v) for k, v in vars(args).items()}, "lmax_sweep": str(lmaxes)}
        with tracked_run("oracle", params=params) as run:
            result = run_study(
                args.extract,
                model,
                spec,
                lmaxes,
                decisions_lmax,
                args.out,
                OracleConfig(args.acceptance, args.plain_step),
                decode=lambda ids: tokenizer.decode(ids),
            )
            metrics = study_metrics(result)
            trees = None
            if want_trees:
                trees = study_from_extraction(args.extract, model, spec)
                trees.to_csv(args.out / "tree_bound.csv", index=False)
                run.log_artifact(str(args.out / "tree_bound.csv"))
                metrics.update(
                    {f"tree_bound_{r.bound}_k{r.budget}": r.speedup for r in trees.itertuples()}
                )
            run.log_metrics(metrics)
            for path in result.paths.values():
                run.log_artifact(str(path))
            run_id = run.run_id
    print()
    print(format_study(result))
    if trees is not None:
        print()
        print(format_tree_study(trees))
        print(f"(tree_bound.csv under {args.out})")
    print(
        f"\nwrote {args.out}/ (decisions, summary, policy.json, plots); MLflow run {run_id} at "
        f"{tracking_uri()}"
    )
    return {"result": result, "trees": trees}


if __name__ == "__main__":
    run(main)
