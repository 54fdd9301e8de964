"""The Bellman oracle over an extraction: the optimal draft length at every position, the
speedup bound per Lmax, delta space and the boundary slope lambda, and the alpha = 0 ablation.

Reads the extraction's tables (tokens, tails, sequences) and a calibrated costmodel.json;
writes decisions.parquet and summary.parquet (DESIGN section 4), lmax_sweep.csv/.png,
delta_space.png, policy.json (lambda, for the online `marginal` policy) and
ablation_alpha0.json under --out. Sequences are solved in parallel Ray tasks.

    python -m jobs.oracle --extract out/extract --costmodel out/calibration/costmodel.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jobs.cli import parse_ks, ray_session, run
from pipeline.cost.model import CostModel
from pipeline.models.adapters import moe_spec
from pipeline.models.loading import DEFAULT_TARGET, load_config, load_tokenizer
from pipeline.oracle.fanout import ACCEPTANCE_MODES, extraction_lmax
from pipeline.oracle.study import format_study, run_study
from pipeline.tracking import tracked_run, tracking_uri


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jobs.oracle",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--extract", type=Path, default=Path("out/extract"), help="extraction dir")
    p.add_argument("--costmodel", type=Path, default=Path("out/calibration/costmodel.json"))
    p.add_argument("--target", default=str(DEFAULT_TARGET), help="target (layout, tokenizer)")
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
        help="P(a|k) from draft probabilities, or exact greedy matches",
    )
    p.add_argument("--out", type=Path, default=Path("out/oracle"))
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of a new local Ray")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not (args.extract / "manifest.json").is_file():
        raise ValueError(f"{args.extract} is not an extraction directory (no manifest.json)")
    extracted = extraction_lmax(args.extract)
    lmaxes = args.lmax or list(range(1, extracted + 1))
    if max(lmaxes) > extracted or min(lmaxes) < 1:
        raise ValueError(f"Lmax sweep {lmaxes} must lie in 1..{extracted} (the extraction's Lmax)")
    decisions_lmax = args.decisions_lmax or max(lmaxes)
    model = CostModel.load(
        args.costmodel, range(1, max(lmaxes) + 2), f"the oracle at Lmax {max(lmaxes)}"
    )
    spec = moe_spec(load_config(args.target))
    tokenizer = load_tokenizer(args.target)
    with ray_session(num_cpus=args.num_cpus):
        params = {**{k: str(v) for k, v in vars(args).items()}, "lmax_sweep": str(lmaxes)}
        with tracked_run("oracle", params=params) as run:
            result = run_study(
                args.extract, model, spec, lmaxes, decisions_lmax, args.out, args.acceptance,
                decode=lambda ids: tokenizer.decode(ids),
            )  # fmt: skip
            overall = result.sweep[result.sweep["category"] == "all"]
            metrics = {f"speedup_lmax{int(r.lmax)}": r.speedup_bound for r in overall.itertuples()}
            metrics.update({f"mean_k_lmax{int(r.lmax)}": r.mean_draft_len
                            for r in overall.itertuples()})  # fmt: skip
            metrics.update({f"delta_{k}": v for k, v in result.delta.items() if v is not None})
            metrics.update(ablation_share_changed=result.ablation["share_changed"])
            run.log_metrics(metrics)
            for path in result.paths.values():
                run.log_artifact(str(path))
            run_id = run.run_id
    print()
    print(format_study(result))
    print(f"\nwrote {args.out}/ (decisions, summary, policy.json, plots); MLflow run {run_id} at "
          f"{tracking_uri()}")  # fmt: skip
    return {"result": result}


if __name__ == "__main__":
    run(main)
