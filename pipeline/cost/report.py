"""Readable text and MLflow metrics from a cost-model fit."""

from __future__ import annotations

import math

import pandas as pd

from pipeline.cost.design_stats import beta0_monotone
from pipeline.cost.fit import CostFit


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def fit_metrics(fit: CostFit, rounds: pd.DataFrame) -> dict[str, float]:
    model = fit.model
    metrics: dict[str, float] = {
        "rounds": len(rounds),
        "generations": rounds["gen_id"].nunique(),
        "c": model.c,
        "draft_a": model.draft_a,
        "draft_b": model.draft_b,
        "pooled_oos_mape": fit.pooled["oos_mape"],
        "draft_oos_mape": fit.draft["oos_mape"],
        "draft_oos_r2": fit.draft["oos_r2"],
        "draft_oos_mape_fixed": fit.draft["oos_mape_fixed"],
        "draft_oos_mape_look": fit.draft["oos_mape_look"],
    }
    for r in fit.per_m.itertuples():
        for name in ("beta0", "alpha", "alpha_p", "r2", "oos_r2", "oos_rmse", "oos_mape"):
            metrics[f"{name}_m{r.m}"] = getattr(r, name)
    metrics.update({f"pooled_{k}": v for k, v in fit.pooled["coef"].items()})
    for r in fit.factors.itertuples():
        metrics[f"factor_oos_r2_{r.factor}"] = r.oos_r2
    return {k: float(v) for k, v in metrics.items() if v is not None and pd.notna(v)}


def format_report(fit: CostFit, per_k: pd.DataFrame) -> str:
    model = fit.model
    cols = [
        "k",
        "m",
        "draft_forwards",
        "rounds",
        "mean_t_target_ms",
        "mean_t_draft_ms",
        "mean_u_bar",
    ]
    lines = [
        "per-K rounds (sql/calibration_per_k.sql):",
        per_k[[*cols, "mean_accepted"]].to_string(index=False, float_format="{:.3f}".format),
        "",
        f"T_T = beta0(m) + alpha(m) U + c L,  c = {model.c * 1000:.4f} ms per 1000 tokens",
        "   m      n   beta0 ms  alpha ms/expert  (clustered SE, p)       R2  OOS R2  OOS MAPE",
    ]
    for r in fit.per_m.itertuples():
        lines.append(
            f"{r.m:>4} {r.n:>6} {r.beta0:>10.3f} {r.alpha:>16.4f}  "
            f"({_fmt(r.alpha_se, '.4f')}, p={_fmt(r.alpha_p, '.1e')}) "
            f"{_fmt(r.r2):>9} {_fmt(r.oos_r2):>7} {_fmt(r.oos_mape, '.2f'):>8}%"
        )
    pc, d = fit.pooled["coef"], fit.draft
    lines += [
        "",
        f"T_D = {model.draft_a:.4f} n + {model.draft_b:.4f} ms over n draft forwards "
        f"(fixed chains n = K, looks n = K + 1): OOS R2 {_fmt(d['oos_r2'])}, MAPE "
        f"{d['oos_mape']:.2f}% (MedAPE {d['oos_medape']:.2f}%); fixed {d['rounds_fixed']} "
        f"rounds {_fmt(d['oos_mape_fixed'], '.2f')}%, looks {d['rounds_look']} rounds "
        f"{_fmt(d['oos_mape_look'], '.2f')}%",
        f"pooled: T_T = {pc['const']:.3f} + {pc['u_bar']:.4f} U + {pc['ctx_len']:.2e} L "
        f"+ {pc['k']:.4f} K (OOS MAPE {fit.pooled['oos_mape']:.2f}%)",
        "",
        "factor importance (OOS R2 alone; RMSE reduction over U alone, ms):",
        fit.factors.to_string(index=False, float_format="{:.4f}".format),
    ]
    lines += [f"note: {note}" for note in fit.notes]
    return "\n".join(lines)


def format_design_comparison(
    comparison: pd.DataFrame, cells: pd.DataFrame | None, summary: dict | None = None
) -> str:
    """Both designs per m, beside the designed model's error on the observational rounds,
    overall (``summary``: design_summary.json) and the timing noise left per (m, U) cell."""
    lines = [
        "designs side by side (forced: routing set, every U; observational: the router's own):",
        "   m | forced: beta0 +- SE   alpha +- SE   R2  OOS R2 | observational: beta0 +- SE   "
        "alpha +- SE   R2  OOS R2 | forced on observational rounds: R2  MAPE",
    ]
    for r in comparison.itertuples():
        lines.append(
            f"{r.m:>4} | {_fmt(r.beta0_forced):>8} {_fmt(r.beta0_se_forced):>6} "
            f"{_fmt(r.alpha_forced, '.4f'):>8} {_fmt(r.alpha_se_forced, '.4f'):>6} "
            f"{_fmt(r.r2_forced, '.2f'):>5} {_fmt(r.oos_r2_forced, '.2f'):>6} | "
            f"{_fmt(r.beta0_observational):>8} {_fmt(r.beta0_se_observational):>6} "
            f"{_fmt(r.alpha_observational, '.4f'):>8} "
            f"{_fmt(r.alpha_se_observational, '.4f'):>6} {_fmt(r.r2_observational, '.2f'):>5} "
            f"{_fmt(r.oos_r2_observational, '.2f'):>6} | {_fmt(r.heldout_r2, '.2f'):>5} "
            f"{_fmt(r.heldout_mape, '.2f'):>6}%"
        )
    forced = comparison.rename(
        columns={
            "beta0_forced": "beta0",
            "beta0_se_forced": "beta0_se",
            "alpha_se_forced": "alpha_se",
        }
    )
    problems = beta0_monotone(forced[["m", "beta0", "beta0_se", "alpha_se"]])
    lines.append(
        "forced beta0(m) monotone within 95% intervals (m with a slope): "
        + ("yes" if not problems else "no: " + "; ".join(problems))
    )
    labels = {
        "designed_on_observational_rounds": "forced model on the rounds (held out)",
        "observational_on_own_rounds": "observational model on its own rounds",
    }
    for key, label in labels.items() if summary else ():
        e = summary[key]
        lines.append(
            f"{label}: bias {e['bias_pct']:+.2f}%, MAPE {e['mape_pct']:.2f}% per round "
            f"(MedAPE {e['medape_pct']:.2f}%), {e['generation_total_mape_pct']:.2f}% on "
            f"the total of each of {e['generations']} generations"
        )
    if cells is not None and len(cells):
        rel = cells["rel_mad_pct"]
        lines.append(
            f"noise left per (m, U) cell (robust SD / median): median "
            f"{rel.median():.1f}%, max {rel.max():.1f}% over {len(cells)} "
            "cells"
        )
    return "\n".join(lines)
