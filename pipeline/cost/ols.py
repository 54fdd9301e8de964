"""Cross-validated least squares by generation, shared by the cost-model fits: metrics,
GroupKFold splits stratified by m, a linear fit with clustered errors and held-out error, and
factor importance (the paper's Table A2)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import statsmodels.api as sm
from scipy import stats
from sklearn.metrics import mean_absolute_percentage_error, r2_score, root_mean_squared_error
from sklearn.model_selection import StratifiedGroupKFold

FACTORS = ("u_bar", "ctx_len", "kv_occupancy", "m", "accepted", "round")


def codes(groups: pd.Series) -> np.ndarray:
    return pd.factorize(groups)[0]


def metrics(y: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    """R2, RMSE and MAPE (%) over the rows with a finite prediction."""
    keep = np.isfinite(pred)
    y, pred = y[keep], pred[keep]
    if not len(y) or not np.isfinite(y).all():  # sklearn refuses NaN, which made all NaN
        return {"r2": float("nan"), "rmse": float("nan"), "mape": float("nan")}
    # R2 of a constant y is undefined (sklearn's would be 0 or 1, or -inf unforced): NaN.
    return {
        "r2": float(r2_score(y, pred)) if np.ptp(y) > 0 else float("nan"),
        "rmse": float(root_mean_squared_error(y, pred)),
        "mape": float(mean_absolute_percentage_error(y, pred)) * 100,
    }


def num(x: float) -> float | None:
    """JSON has no NaN: undefined statistics become null."""
    return None if x is None or not np.isfinite(x) else float(x)


def split(df: pd.DataFrame):
    """GroupKFold(5) by generation, stratified by m: every generation has one K, and unguided
    assignment can put all generations of some m into one test fold (leaving no rows of that m
    to train on) or each K into a fold of its own."""
    splitter = StratifiedGroupKFold(n_splits=n_splits(df["gen_id"]), shuffle=True, random_state=0)
    return splitter.split(np.zeros(len(df)), df["m"].to_numpy(), codes(df["gen_id"]))


def n_splits(groups: pd.Series, wanted: int = 5) -> int:
    n = groups.nunique()
    if n < 2:
        raise ValueError("cross-validation needs rounds from at least 2 generations")
    return min(wanted, n)


def ols_cv(df: pd.DataFrame, y_col: str, x_cols: list[str]) -> tuple[list[float], list[float]]:
    """Per-fold OOS R2 and RMSE of ``y ~ 1 + x_cols`` under GroupKFold by generation."""
    y = df[y_col].to_numpy(float)
    X = sm.add_constant(df[x_cols].to_numpy(float), has_constant="add")
    r2s, rmses = [], []
    for train, test in split(df):
        fit = sm.OLS(y[train], X[train]).fit()
        m = metrics(y[test], X[test] @ fit.params)
        r2s.append(m["r2"])
        rmses.append(m["rmse"])
    return r2s, rmses


def mean_ci(values: list[float]) -> tuple[float, float]:
    """The mean and the half-width of its 95% t interval (NaN below two values)."""
    arr = np.asarray(values, float)
    if len(arr) < 2:
        return float(arr.mean()), float("nan")
    # t.interval would need a positive scale; identical values give a half-width of 0 here.
    half = stats.t.ppf(0.975, len(arr) - 1) * stats.sem(arr)
    return float(arr.mean()), float(half)


def factor_importance(df: pd.DataFrame) -> pd.DataFrame:
    """Standalone OOS R2 of each factor, and the RMSE reduction it adds over U alone (paired
    across folds), like the paper's Table A2."""
    _, base_rmse = ols_cv(df, "t_target_ms", ["u_bar"])
    rows = []
    for factor in FACTORS:
        if df[factor].std() <= 1e-12:
            continue
        r2s, _ = ols_cv(df, "t_target_ms", [factor])
        r2, r2_ci = mean_ci(r2s)
        row = {"factor": factor, "oos_r2": r2, "oos_r2_ci95": r2_ci}
        if factor != "u_bar":
            _, rmses = ols_cv(df, "t_target_ms", ["u_bar", factor])
            gain, gain_ci = mean_ci([b - r for b, r in zip(base_rmse, rmses, strict=True)])
            row.update(rmse_reduction_ms=gain, rmse_reduction_ci95=gain_ci)
        rows.append(row)
    return pd.DataFrame(rows).sort_values("oos_r2", ascending=False, ignore_index=True)


def fit_linear_oos(df: pd.DataFrame, y_col: str, x_cols: list[str]) -> tuple[dict, np.ndarray]:
    """``y ~ 1 + x_cols``: clustered OLS, GroupKFold metrics, and every row's OOS prediction."""
    y = df[y_col].to_numpy(float)
    X = sm.add_constant(df[x_cols].to_numpy(float), has_constant="add")
    res = sm.OLS(y, X).fit(cov_type="cluster", cov_kwds={"groups": codes(df["gen_id"])})
    names = ["const", *x_cols]
    oos = np.full(len(df), np.nan)
    r2s, rmses = [], []
    for train, test in split(df):
        oos[test] = X[test] @ sm.OLS(y[train], X[train]).fit().params
        fold = metrics(y[test], oos[test])
        r2s.append(fold["r2"])
        rmses.append(fold["rmse"])
    ape = np.abs(y - oos) / np.abs(np.where(y == 0, np.nan, y))
    out = {
        "coef": {n: float(v) for n, v in zip(names, res.params, strict=True)},
        "se": {n: float(v) for n, v in zip(names, res.bse, strict=True)},
        "r2": float(res.rsquared),
        "oos_r2": float(np.mean(r2s)),
        "oos_rmse": float(np.mean(rmses)),
        "oos_mape": float(np.nanmean(ape) * 100),
        "oos_medape": float(np.nanmedian(ape) * 100),
    }
    return out, ape


def fit_linear(df: pd.DataFrame, y_col: str, x_cols: list[str]) -> dict[str, Any]:
    return fit_linear_oos(df, y_col, x_cols)[0]
