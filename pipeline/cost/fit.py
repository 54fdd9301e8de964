"""Fitting the verification-cost model on timed rounds, with the protocol of the paper's
Appendix A: OLS with standard errors clustered by generation, GroupKFold(5) by generation for
out-of-sample R2 / RMSE / MAPE, the pooled linear-K model, the draft model and factor importance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import statsmodels.api as sm

from pipeline.cost.model import CostModel
from pipeline.cost.ols import (
    codes,
    factor_importance,
    fit_linear,
    fit_linear_oos,
    metrics,
    n_splits,
    num,
    split,
)


def _design(df: pd.DataFrame, ms: list[int], slope_ms: list[int]) -> np.ndarray:
    """Columns: one intercept per m, one U slope per m (where U varies), shared context."""
    cols = [(df["m"] == m).to_numpy(float) for m in ms]
    cols += [(df["m"] == m).to_numpy(float) * df["u_bar"].to_numpy(float) for m in slope_ms]
    cols.append(df["ctx_len"].to_numpy(float))
    return np.column_stack(cols)


@dataclass
class CostFit:
    model: CostModel
    per_m: pd.DataFrame  # m, n, beta0, alpha and their clustered SE / p, in-sample + OOS metrics
    pooled: dict[str, Any]
    draft: dict[str, Any]
    factors: pd.DataFrame
    notes: list[str] = field(default_factory=list)


def fit_per_m(df: pd.DataFrame) -> tuple[dict, pd.DataFrame, list[str]]:
    ms = sorted(int(m) for m in df["m"].unique())
    notes: list[str] = []
    # With one position per pass (m = 1) U is always top-k: no slope to estimate there.
    slope_ms = [m for m in ms if df.loc[df["m"] == m, "u_bar"].std() > 1e-9]
    for m in ms:
        if m not in slope_ms:
            notes.append(f"m={m}: U is constant, alpha fixed at 0 (beta0 absorbs it)")
    y = df["t_target_ms"].to_numpy(float)
    X = _design(df, ms, slope_ms)
    groups = codes(df["gen_id"])
    res = sm.OLS(y, X).fit(cov_type="cluster", cov_kwds={"groups": groups})
    params, se, pvals = res.params, res.bse, res.pvalues
    nb = len(ms)
    coef = {
        "beta0": {m: float(params[j]) for j, m in enumerate(ms)},
        "alpha": {m: 0.0 for m in ms},
        "c": float(params[-1]),
    }
    alpha_se: dict[int, float] = {}
    alpha_p: dict[int, float] = {}
    for j, m in enumerate(slope_ms):
        coef["alpha"][m] = float(params[nb + j])
        alpha_se[m] = float(se[nb + j])
        alpha_p[m] = float(pvals[nb + j])
    pred = res.fittedvalues

    # Out of sample: GroupKFold by generation, the same specification refit on each fold.
    oos = np.full(len(df), np.nan)
    for train, test in split(df):
        sub = df.iloc[train]
        fold_slopes = [m for m in slope_ms if sub.loc[sub["m"] == m, "u_bar"].std() > 1e-9]
        fold_ms = sorted(int(m) for m in sub["m"].unique())
        fit = sm.OLS(y[train], _design(sub, fold_ms, fold_slopes)).fit()
        held = df.iloc[test]
        pred_test = _design(held, fold_ms, fold_slopes) @ fit.params
        # An m with no training rows in this fold has no coefficients: no prediction for it.
        oos[test] = np.where(held["m"].isin(fold_ms).to_numpy(), pred_test, np.nan)
    rows = []
    for j, m in enumerate(ms):
        sel = (df["m"] == m).to_numpy()
        ins = metrics(y[sel], pred[sel])
        out = metrics(y[sel], oos[sel])
        rows.append(
            {
                "m": m,
                "n": int(sel.sum()),
                "beta0": coef["beta0"][m],
                "beta0_se": float(se[j]),
                "alpha": coef["alpha"][m],
                "alpha_se": alpha_se.get(m, float("nan")),
                "alpha_p": alpha_p.get(m, float("nan")),
                "r2": ins["r2"],
                "oos_r2": out["r2"],
                "oos_rmse": out["rmse"],
                "oos_mape": out["mape"],
            }
        )
    coef["c_se"] = float(se[-1])
    coef["c_p"] = float(pvals[-1])
    return coef, pd.DataFrame(rows), notes


def fit_draft(df: pd.DataFrame) -> dict[str, Any]:
    """The draft line T_D = a n + b on the draft forwards n, pooled over fixed chains (n = k)
    and look rounds (n = k + 1), with the held-out error of each kind: one line has to price
    both, as the online policies run both."""
    rounds = df[df["draft_forwards"] > 0]
    draft, ape = fit_linear_oos(rounds, "t_draft_ms", ["draft_forwards"])
    look = (rounds["draft_forwards"] != rounds["k"]).to_numpy()
    for kind, sel in (("fixed", ~look), ("look", look)):
        draft[f"rounds_{kind}"] = int(sel.sum())
        draft[f"oos_mape_{kind}"] = float(np.nanmean(ape[sel]) * 100) if sel.any() else None
    return draft


def drop_interference(df: pd.DataFrame, z: float = 8.0) -> tuple[pd.DataFrame, int]:
    """Rounds whose target (draft) time lies more than ``z`` robust standard deviations
    (1.4826 MAD) above the median of their m (their draft forwards): a timer that caught another
    process's burst or a GC pause, not a property of the round. Least squares would chase them."""
    keep = pd.Series(True, index=df.index)
    # Draft times grouped by forwards: a look round runs one forward more than its m suggests.
    for col, by in (("t_target_ms", "m"), ("t_draft_ms", "draft_forwards")):
        grouped = df.groupby(by)[col]
        med = grouped.transform("median")
        mad = grouped.transform(lambda x: (x - x.median()).abs().median()) * 1.4826
        keep &= ~(df[col] > med + z * mad.clip(lower=1e-3 * med.abs() + 1e-9))
    return df[keep].reset_index(drop=True), int((~keep).sum())


def fit_cost_model(
    rounds: pd.DataFrame,
    meta: dict[str, Any] | None = None,
    draft_rounds: pd.DataFrame | None = None,
) -> CostFit:
    """All fits; the returned CostModel carries the per-m coefficients and the draft line.
    ``draft_rounds``: speculative rounds for the draft line, the pooled model and factor
    importance, when ``rounds`` are designed passes (no draft, no acceptance)."""
    required = {"gen_id", "k", "m", "t_target_ms", "t_draft_ms", "u_bar", "ctx_len"}
    missing = required - set(rounds.columns)
    if missing:
        raise ValueError(f"rounds table lacks columns: {', '.join(sorted(missing))}")
    rounds = rounds.reset_index(drop=True)
    older = "draft_forwards" not in rounds.columns
    if older:  # a rounds table from before looks were timed: fixed chains only, k forwards
        rounds = rounds.assign(draft_forwards=rounds["k"])
    df, dropped = drop_interference(rounds)
    n_splits(df["gen_id"])  # clustered errors and CV both need several generations
    coef, per_m, notes = fit_per_m(df)
    if older:
        notes.append("rounds without draft_forwards: fixed chains assumed (k forwards)")
    if dropped:
        notes.append(
            f"{dropped} of {len(rounds)} rounds dropped as timing interference "
            "(> 8 robust SD above the median of their m or draft forwards)"
        )
    observed = df
    if draft_rounds is not None:
        observed = draft_rounds.reset_index(drop=True)
        if "draft_forwards" not in observed.columns:
            observed = observed.assign(draft_forwards=observed["k"])
        observed = drop_interference(observed)[0]
    # The pooled linear-K model, the draft line and factor importance describe speculative
    # rounds (accepted counts, round index): the observational ones when designed passes
    # fit the target.
    spec_rounds = observed[observed["k"] > 0]
    pooled = fit_linear(spec_rounds, "t_target_ms", ["u_bar", "ctx_len", "k"])
    draft = fit_draft(observed)
    factors = factor_importance(spec_rounds if len(spec_rounds) else observed)
    fit_quality = {
        str(int(r.m)): {
            "n": int(r.n),
            "r2": num(r.r2),
            "oos_r2": num(r.oos_r2),
            "oos_rmse_ms": num(r.oos_rmse),
            "oos_mape_pct": num(r.oos_mape),
            "beta0_se": num(r.beta0_se),
            "alpha_se": num(r.alpha_se),
            "alpha_p": num(r.alpha_p),
        }
        for r in per_m.itertuples()
    }
    model = CostModel(
        beta0=coef["beta0"],
        alpha=coef["alpha"],
        c=coef["c"],
        draft_a=draft["coef"]["draft_forwards"],
        draft_b=draft["coef"]["const"],
        meta={
            **(meta or {}),
            "fit": {
                "per_m": fit_quality,
                "c_se": coef["c_se"],
                "draft_oos_mape_pct": draft["oos_mape"],
                "draft_oos_medape_pct": draft["oos_medape"],
                "draft": {  # the line over draft forwards, and how well it prices each kind
                    "r2": num(draft["r2"]),
                    "oos_r2": num(draft["oos_r2"]),
                    "rounds_fixed": draft["rounds_fixed"],
                    "rounds_look": draft["rounds_look"],
                    "oos_mape_fixed_pct": num(draft["oos_mape_fixed"]),
                    "oos_mape_look_pct": num(draft["oos_mape_look"]),
                },
                "rounds": len(df),
                "rounds_dropped_as_interference": dropped,
                "generations": int(df["gen_id"].nunique()),
                "notes": notes,
            },
        },
    )
    return CostFit(model, per_m, pooled, draft, factors, notes)
