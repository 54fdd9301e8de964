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
from scipy import stats
from sklearn.model_selection import StratifiedGroupKFold

from pipeline.cost.model import CostModel

FACTORS = ("u_bar", "ctx_len", "kv_occupancy", "m", "accepted", "round")


def _design(df: pd.DataFrame, ms: list[int], slope_ms: list[int]) -> np.ndarray:
    """Columns: one intercept per m, one U slope per m (where U varies), shared context."""
    cols = [(df["m"] == m).to_numpy(float) for m in ms]
    cols += [(df["m"] == m).to_numpy(float) * df["u_bar"].to_numpy(float) for m in slope_ms]
    cols.append(df["ctx_len"].to_numpy(float))
    return np.column_stack(cols)


def _codes(groups: pd.Series) -> np.ndarray:
    return pd.factorize(groups)[0]


def _metrics(y: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    keep = np.isfinite(pred)
    y, pred = y[keep], pred[keep]
    if not len(y):
        return {"r2": float("nan"), "rmse": float("nan"), "mape": float("nan")}
    resid = y - pred
    sst = float(((y - y.mean()) ** 2).sum())
    return {
        "r2": 1 - float((resid**2).sum()) / sst if sst > 0 else float("nan"),
        "rmse": float(np.sqrt((resid**2).mean())),
        "mape": float(np.mean(np.abs(resid) / np.abs(y))) * 100,
    }


def _num(x: float) -> float | None:
    """JSON has no NaN: undefined statistics become null."""
    return None if x is None or not np.isfinite(x) else float(x)


def _split(df: pd.DataFrame):
    """GroupKFold(5) by generation, stratified by m: every generation has one K, and unguided
    assignment can put all generations of some m into one test fold (leaving no rows of that m
    to train on) or each K into a fold of its own."""
    splitter = StratifiedGroupKFold(n_splits=_n_splits(df["gen_id"]), shuffle=True, random_state=0)
    return splitter.split(np.zeros(len(df)), df["m"].to_numpy(), _codes(df["gen_id"]))


def _n_splits(groups: pd.Series, wanted: int = 5) -> int:
    n = groups.nunique()
    if n < 2:
        raise ValueError("cross-validation needs rounds from at least 2 generations")
    return min(wanted, n)


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
    groups = _codes(df["gen_id"])
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
    for train, test in _split(df):
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
        ins = _metrics(y[sel], pred[sel])
        out = _metrics(y[sel], oos[sel])
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


def _ols_cv(df: pd.DataFrame, y_col: str, x_cols: list[str]) -> tuple[list[float], list[float]]:
    """Per-fold OOS R2 and RMSE of ``y ~ 1 + x_cols`` under GroupKFold by generation."""
    y = df[y_col].to_numpy(float)
    X = sm.add_constant(df[x_cols].to_numpy(float), has_constant="add")
    r2s, rmses = [], []
    for train, test in _split(df):
        fit = sm.OLS(y[train], X[train]).fit()
        m = _metrics(y[test], X[test] @ fit.params)
        r2s.append(m["r2"])
        rmses.append(m["rmse"])
    return r2s, rmses


def _mean_ci(values: list[float]) -> tuple[float, float]:
    arr = np.asarray(values, float)
    if len(arr) < 2:
        return float(arr.mean()), float("nan")
    half = stats.t.ppf(0.975, len(arr) - 1) * arr.std(ddof=1) / np.sqrt(len(arr))
    return float(arr.mean()), float(half)


def factor_importance(df: pd.DataFrame) -> pd.DataFrame:
    """Standalone OOS R2 of each factor, and the RMSE reduction it adds over U alone (paired
    across folds), like the paper's Table A2."""
    _, base_rmse = _ols_cv(df, "t_target_ms", ["u_bar"])
    rows = []
    for factor in FACTORS:
        if df[factor].std() <= 1e-12:
            continue
        r2s, _ = _ols_cv(df, "t_target_ms", [factor])
        r2, r2_ci = _mean_ci(r2s)
        row = {"factor": factor, "oos_r2": r2, "oos_r2_ci95": r2_ci}
        if factor != "u_bar":
            _, rmses = _ols_cv(df, "t_target_ms", ["u_bar", factor])
            gain, gain_ci = _mean_ci([b - r for b, r in zip(base_rmse, rmses, strict=True)])
            row.update(rmse_reduction_ms=gain, rmse_reduction_ci95=gain_ci)
        rows.append(row)
    return pd.DataFrame(rows).sort_values("oos_r2", ascending=False, ignore_index=True)


def fit_linear(df: pd.DataFrame, y_col: str, x_cols: list[str]) -> dict[str, Any]:
    y = df[y_col].to_numpy(float)
    X = sm.add_constant(df[x_cols].to_numpy(float), has_constant="add")
    res = sm.OLS(y, X).fit(cov_type="cluster", cov_kwds={"groups": _codes(df["gen_id"])})
    r2s, rmses = _ols_cv(df, y_col, x_cols)
    names = ["const", *x_cols]
    oos = np.full(len(df), np.nan)
    for train, test in _split(df):
        oos[test] = X[test] @ sm.OLS(y[train], X[train]).fit().params
    ape = np.abs(y - oos) / np.abs(np.where(y == 0, np.nan, y))
    return {
        "coef": {n: float(v) for n, v in zip(names, res.params, strict=True)},
        "se": {n: float(v) for n, v in zip(names, res.bse, strict=True)},
        "r2": float(res.rsquared),
        "oos_r2": float(np.mean(r2s)),
        "oos_rmse": float(np.mean(rmses)),
        "oos_mape": float(np.nanmean(ape) * 100),
        "oos_medape": float(np.nanmedian(ape) * 100),
    }


def drop_interference(df: pd.DataFrame, z: float = 8.0) -> tuple[pd.DataFrame, int]:
    """Rounds whose target or draft time lies more than ``z`` robust standard deviations
    (1.4826 MAD) above the median of their m: a timer that caught another process's burst or a
    GC pause, not a property of the round. Least squares would chase them."""
    keep = pd.Series(True, index=df.index)
    for col in ("t_target_ms", "t_draft_ms"):
        grouped = df.groupby("m")[col]
        med = grouped.transform("median")
        mad = grouped.transform(lambda x: (x - x.median()).abs().median()) * 1.4826
        keep &= ~(df[col] > med + z * mad.clip(lower=1e-3 * med.abs() + 1e-9))
    return df[keep].reset_index(drop=True), int((~keep).sum())


def fit_cost_model(rounds: pd.DataFrame, meta: dict[str, Any] | None = None) -> CostFit:
    """All fits; the returned CostModel carries the per-m coefficients and the draft line."""
    required = {"gen_id", "k", "m", "t_target_ms", "t_draft_ms", "u_bar", "ctx_len"}
    missing = required - set(rounds.columns)
    if missing:
        raise ValueError(f"rounds table lacks columns: {', '.join(sorted(missing))}")
    df, dropped = drop_interference(rounds.reset_index(drop=True))
    _n_splits(df["gen_id"])  # clustered errors and CV both need several generations
    coef, per_m, notes = fit_per_m(df)
    if dropped:
        notes.append(f"{dropped} of {len(rounds)} rounds dropped as timing interference "
                     "(> 8 robust SD above their m's median)")  # fmt: skip
    spec_rounds = df[df["k"] > 0]
    pooled = fit_linear(spec_rounds, "t_target_ms", ["u_bar", "ctx_len", "k"])
    draft = fit_linear(spec_rounds, "t_draft_ms", ["k"])
    factors = factor_importance(spec_rounds if len(spec_rounds) else df)
    fit_quality = {
        str(int(r.m)): {
            "n": int(r.n),
            "r2": _num(r.r2),
            "oos_r2": _num(r.oos_r2),
            "oos_rmse_ms": _num(r.oos_rmse),
            "oos_mape_pct": _num(r.oos_mape),
            "alpha_se": _num(r.alpha_se),
            "alpha_p": _num(r.alpha_p),
        }
        for r in per_m.itertuples()
    }
    model = CostModel(
        beta0=coef["beta0"],
        alpha=coef["alpha"],
        c=coef["c"],
        draft_a=draft["coef"]["k"],
        draft_b=draft["coef"]["const"],
        meta={
            **(meta or {}),
            "fit": {
                "per_m": fit_quality,
                "c_se": coef["c_se"],
                "draft_oos_mape_pct": draft["oos_mape"],
                "draft_oos_medape_pct": draft["oos_medape"],
                "rounds": len(df),
                "rounds_dropped_as_interference": dropped,
                "generations": int(df["gen_id"].nunique()),
                "notes": notes,
            },
        },
    )
    return CostFit(model, per_m, pooled, draft, factors, notes)
