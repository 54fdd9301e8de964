"""Train the learned expert predictor (EcoSpec section 4.1) from an extraction's routing traces
and save it beside the models, where the cost-aware policies (ecospec, marginal) load it.

Inputs per draft token: its id and the draft's last-layer hidden state that produced it, which
the drafter has already computed when the token is proposed, so prediction costs one small MLP
call per draft step (measured below against a draft forward). Reports the held-out top-K
overlap accuracy (the paper: 80-93% on large models) next to the lookup-table baseline, and
logs an MLflow run.

    python -m jobs.extract --limit 164 --lmax 1 --max-new-tokens 192 --out out/predictor_traces
    python -m jobs.train_predictor --extract out/predictor_traces --out models/predictor
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jobs.cli import add_model_args, add_out_arg, add_seed_arg, parser, run
from pipeline.models.loading import REPO_ROOT, load_pair
from pipeline.predictor.training import train_predictor
from pipeline.tracking import tracked_run

DEFAULT_OUT = REPO_ROOT / "models" / "predictor"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.train_predictor", __doc__)
    add_model_args(p)
    p.add_argument("--extract", type=Path, required=True, help="extraction dir (tokens table)")
    add_out_arg(p, DEFAULT_OUT)
    p.add_argument("--epochs", type=int, default=30, help="training epochs (30)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--held-out", type=float, default=0.2, help="share of sequences held out")
    add_seed_arg(p)
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        p.error("--epochs and --batch-size must be >= 1")
    if not 0 < args.held_out < 1:
        p.error("--held-out must lie in (0, 1)")
    if not (args.extract / "tokens").is_dir():
        p.error(
            f"{args.extract} holds no extraction (no tokens/ table); create one with "
            f"python -m jobs.extract --lmax 1 --out {args.extract}"
        )
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    pair = load_pair(args.target, args.draft, args.device, args.dtype, args.experts_implementation)
    trained = train_predictor(
        pair,
        args.extract,
        args.out,
        args.epochs,
        args.batch_size,
        args.lr,
        args.held_out,
        args.seed,
        log=lambda line: print(line, flush=True),
    )
    report = trained.report
    print(
        f"held-out top-{pair.spec.top_k} overlap accuracy: "
        f"{report['held_out_topk_overlap']:.1%} (train {report['train_topk_overlap']:.1%}; "
        f"lookup-table baseline {report['lookup_table_topk_overlap']:.1%})"
    )
    print(
        f"cost: {report['predictor_ms']:.3f} ms per call (1 token), "
        f"{report['predictor_ms_8_nodes']:.3f} ms (8 tree nodes) vs "
        f"{report['draft_step_ms']:.3f} ms per draft forward: "
        f"{report['cost_ratio']:.2f}x a draft step"
    )
    print(f"saved {args.out}")
    with tracked_run("train_predictor", params=vars(args)) as mlrun:
        mlrun.log_metrics({k: v for k, v in report.items() if isinstance(v, float | int)})
        mlrun.log_dict(report, "predictor_report.json")
    return {"report": report, "predictor": trained.predictor}


if __name__ == "__main__":
    run(main)
