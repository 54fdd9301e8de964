"""Calibrate the verification-cost model on this device from timed speculative rounds.

Runs greedy speculative decoding with a fixed chain of K draft tokens for every K in --ks
(K = 0: plain one-token steps, the m = 1 rounds the autoregressive baseline needs) over a
prompt set, writes the `rounds` table, fits T_T = beta0(m) + alpha(m) U + c L (clustered by
generation, GroupKFold(5) out-of-sample metrics), the pooled linear-K model, the draft line
T_D = a K + b and factor importance, and writes costmodel.json, per-K summaries (DuckDB,
sql/calibration_per_k.sql) and plots. Everything is logged to MLflow.

    python -m jobs.calibrate --limit 8 --ks 0-8 --out out/calibration
    ray job submit --working-dir . -- python -m jobs.calibrate --out /abs/path/calibration
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jobs.cli import add_model_args, parser, run
from pipeline.calibrate import collect_rounds
from pipeline.calibration_plots import plot_draft_vs_k, plot_target_vs_experts
from pipeline.calibration_report import fit_metrics, format_report
from pipeline.costfit import fit_cost_model
from pipeline.models import load_pair
from pipeline.prompts import load_prompts
from pipeline.shards import write_table_atomic
from pipeline.sql import run_query
from pipeline.tracking import tracked_run, tracking_uri


def parse_ks(text: str) -> list[int]:
    """'0-10' or '1,2,4,8' or '0-3,6'."""
    ks: set[int] = set()
    try:
        for part in text.split(","):
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                ks.update(range(lo, hi + 1))
            elif part.strip():
                ks.add(int(part))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad budget list {text!r}: {exc}") from exc
    if not ks or min(ks) < 0:
        raise argparse.ArgumentTypeError(f"budgets must be a non-empty set of K >= 0: {text!r}")
    return sorted(ks)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.calibrate", __doc__)
    add_model_args(p)
    p.add_argument("--source", default="humaneval", help="'humaneval' or a JSONL prompt file")
    p.add_argument("--limit", type=int, default=8, help="prompts (8)")
    p.add_argument("--ks", type=parse_ks, default=parse_ks("0-10"), help="budgets K (0-10)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per generation (64)")
    p.add_argument("--warmup-tokens", type=int, default=16, help="discarded warm-up per K")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="time each pass this many times, keep the median (default: 1 on GPU, 3 on CPU)",
    )
    p.add_argument("--out", type=Path, default=Path("out/calibration"))
    args = p.parse_args(argv)
    if args.limit < 2:
        p.error("--limit must be >= 2 (the fit clusters and cross-validates by generation)")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    pair = load_pair(args.target, args.draft, args.device, args.dtype, args.experts_implementation)
    prompts = load_prompts(args.source, args.limit)
    print(f"calibrating on {pair.device} ({pair.dtype}, experts={pair.experts_implementation}): "
          f"{len(prompts)} prompts x K in {args.ks}", flush=True)  # fmt: skip
    repeats = args.repeats or (1 if pair.device.type == "cuda" else 3)
    rounds = collect_rounds(
        pair, prompts, args.ks, args.max_new_tokens, args.warmup_tokens, repeats=repeats
    )
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    rounds_path = out / "rounds.parquet"
    write_table_atomic(rounds, rounds_path)
    df = rounds.to_pandas()
    meta = {
        "device": str(pair.device),
        "device_name": _device_name(pair.device),
        "dtype": str(pair.dtype).replace("torch.", ""),
        "experts_implementation": pair.experts_implementation,
        "target_model": pair.target_path,
        "draft_model": pair.draft_path,
        "batch_size": 1,
        "timing_repeats": repeats,
    }
    fit = fit_cost_model(df, meta)
    fit.model.save(out / "costmodel.json")
    per_k = run_query("calibration_per_k", rounds=rounds_path)
    per_k.to_csv(out / "per_k.csv", index=False)
    fit.per_m.to_csv(out / "fit_per_m.csv", index=False)
    fit.factors.to_csv(out / "factor_importance.csv", index=False)
    (out / "pooled_and_draft.json").write_text(
        json.dumps({"pooled_linear_k": fit.pooled, "draft": fit.draft}, indent=2) + "\n"
    )
    fig1 = plot_target_vs_experts(df, fit.model, out / "target_vs_experts.png")
    fig2 = plot_draft_vs_k(df, fit.model, out / "draft_vs_k.png")

    params = {**{k: str(v) for k, v in vars(args).items()}, **meta}
    artifacts = ["costmodel.json", "rounds.parquet", "per_k.csv", "fit_per_m.csv",
                 "factor_importance.csv", "pooled_and_draft.json"]  # fmt: skip
    with tracked_run("calibrate", params=params) as run:
        run.log_metrics(fit_metrics(fit, df))
        for path in [*(out / a for a in artifacts), fig1, fig2]:
            run.log_artifact(str(path))
        run_id = run.run_id

    print()
    print(format_report(fit, per_k))
    print(
        f"\nwrote {out}/costmodel.json, rounds.parquet, plots; MLflow run {run_id} at "
        f"{tracking_uri()}"
    )
    return {"fit": fit, "out": str(out)}


def _device_name(device) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    run(main)
