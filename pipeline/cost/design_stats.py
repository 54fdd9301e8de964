"""What the designed passes say: per-cell medians and noise, how a cost model prices other
rounds (per m and overall, with the bias and the error on each generation's total), and
whether beta0(m) is monotone within its intervals."""

from __future__ import annotations

import numpy as np
import pandas as pd

from pipeline.cost.model import CostModel
from pipeline.cost.ols import metrics


def cell_medians(rounds: pd.DataFrame) -> pd.DataFrame:
    """One row per (prompt, m, U) cell: the median of its repeated passes (the robust cell
    statistic the fit reads; a timer burst in one repeat moves it little)."""
    keys = ["gen_id", "category", "k", "m", "u_bar", "ctx_len", "kv_tokens", "kv_occupancy"]
    out = rounds.groupby(keys, as_index=False).agg(
        t_target_ms=("t_target_ms", "median"),
        t_draft_ms=("t_draft_ms", "median"),
        draft_forwards=("draft_forwards", "first"),
        accepted=("accepted", "first"),
        round=("round", "min"),
        repeats=("t_target_ms", "size"),
    )
    return out


def cell_dispersion(rounds: pd.DataFrame) -> pd.DataFrame:
    """Per (m, U) cell: passes, median time and the noise left after the design (the MAD,
    1.4826-scaled, relative to the median)."""
    grouped = rounds.groupby(["m", "u_bar"])["t_target_ms"]
    out = grouped.agg(n="size", median_ms="median").reset_index()
    mad = grouped.apply(lambda x: float((x - x.median()).abs().median() * 1.4826))
    out["mad_ms"] = mad.to_numpy()
    out["rel_mad_pct"] = 100 * out["mad_ms"] / out["median_ms"]
    return out


def priced(model: CostModel, rounds: pd.DataFrame) -> np.ndarray:
    """The model's T_T for every round (its m, U and context)."""
    return np.array(
        [model.t_target(int(r.m), float(r.u_bar), float(r.ctx_len)) for r in rounds.itertuples()]
    )


def error_on(model: CostModel, rounds: pd.DataFrame) -> pd.DataFrame:
    """How well ``model`` prices other rounds (the designed model on held-out observational
    rounds: how it will be used): per m and overall, R2, RMSE and MAPE."""
    y = rounds["t_target_ms"].to_numpy(float)
    pred = priced(model, rounds)
    out = []
    for m in sorted(int(m) for m in rounds["m"].unique()):
        sel = (rounds["m"] == m).to_numpy()
        out.append({"m": m, "n": int(sel.sum()), **metrics(y[sel], pred[sel])})
    out.append({"m": "all", "n": len(y), **metrics(y, pred)})
    return pd.DataFrame(out)


def heldout_summary(model: CostModel, rounds: pd.DataFrame) -> dict[str, float | int]:
    """How ``model`` prices rounds it was not fitted on, overall: the mean signed error (bias)
    and MAPE per round, and the MAPE of each generation's total target time (what a bound or
    a policy adds up; per-round timer noise mostly cancels in it). Percentages."""
    y = rounds["t_target_ms"].to_numpy(float)
    pred = priced(model, rounds)
    rel = pred / y - 1
    totals = pd.DataFrame({"g": rounds["gen_id"].to_numpy(), "y": y, "p": pred}).groupby("g")
    sums = totals.sum()
    return {
        "rounds": len(y),
        "bias_pct": float(rel.mean() * 100),
        "mape_pct": float(np.abs(rel).mean() * 100),
        "medape_pct": float(np.median(np.abs(rel)) * 100),
        "generations": len(sums),
        "generation_total_mape_pct": float((sums["p"] / sums["y"] - 1).abs().mean() * 100),
    }


def beta0_monotone(per_m: pd.DataFrame, z: float = 1.96) -> list[str]:
    """Where beta0(m) falls as m grows beyond its intervals (each m against the next): an
    empty list is monotone within the intervals. An m whose slope was not estimated (m = 1:
    U is always top_k there, so beta0 absorbs alpha top_k) is a different intercept and is
    left out."""
    rows = per_m.sort_values("m").reset_index(drop=True)
    if "alpha_se" in rows.columns:
        rows = rows[rows["alpha_se"].notna()].reset_index(drop=True)
    problems = []
    for a, b in zip(rows.itertuples(), rows.iloc[1:].itertuples(), strict=False):
        if b.beta0 + z * b.beta0_se < a.beta0 - z * a.beta0_se:
            problems.append(
                f"beta0({b.m}) = {b.beta0:.3f} +- {z * b.beta0_se:.3f} below "
                f"beta0({a.m}) = {a.beta0:.3f} +- {z * a.beta0_se:.3f}"
            )
    return problems
