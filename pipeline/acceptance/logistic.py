"""The ridge logistic regression the acceptance model is fitted with: scikit-learn's
line-searched Newton-Cholesky on soft labels (the sampled mode's sum min(p, q)) with row
weights, and what it says about convergence."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression


@dataclass(frozen=True)
class LogisticFit:
    weights: np.ndarray  # [bias, slopes]: the columns of x
    iterations: int
    converged: bool
    note: str = ""  # why it did not converge

    def report(self) -> dict:
        return {
            "solver": "newton-cholesky",
            "iterations": self.iterations,
            "converged": self.converged,
        }


def fit_logistic(
    x: np.ndarray,
    y: np.ndarray,
    l2: float = 1e-3,
    weights: np.ndarray | None = None,
    max_iter: int = 100,
) -> LogisticFit:
    """The (soft-label, row-weighted) cross-entropy with a ridge of l2 * sum(weights) / 2 on
    the slopes (column 0 of ``x`` is the bias, all ones, unpenalised)."""
    if len(x) and not np.all(x[:, 0] == 1.0):
        raise ValueError("column 0 of the design must be the bias (all ones)")
    sw = np.ones(len(y)) if weights is None else np.asarray(weights, dtype=float)
    if not (np.any(sw * y > 0) and np.any(sw * (1 - y) > 0)):
        # Every label one way (a tiny greedy fit): no finite optimum, the bias would run off
        # to infinity. The bias of the clipped mean instead, reported as not converged.
        mean = np.clip(np.average(y, weights=sw) if sw.sum() > 0 else 0.5, 1e-6, 1 - 1e-6)
        bias = float(np.log(mean / (1 - mean)))
        note = "every label is 0 or every label is 1: no finite optimum"
        return LogisticFit(np.r_[bias, np.zeros(x.shape[1] - 1)], 0, False, note)
    # A label y in [0, 1] is its row twice, as 1 with weight w y and as 0 with weight w (1 - y):
    # the cross-entropy is linear in y, so this is the same loss.
    xs = np.concatenate([x[:, 1:], x[:, 1:]])
    ys = np.concatenate([np.ones(len(y)), np.zeros(len(y))])
    ws = np.concatenate([sw * y, sw * (1 - y)])
    keep = ws > 0  # rows of weight 0 carry no loss
    # scikit-learn minimises sum(w loss) + |slopes|^2 / (2 C).
    c = np.inf if l2 <= 0 else 1.0 / (l2 * sw.sum())
    model = LogisticRegression(C=c, solver="newton-cholesky", tol=1e-10, max_iter=max_iter)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        model.fit(xs[keep], ys[keep], sample_weight=ws[keep])
    # It warns when Newton stops at max_iter or falls back to L-BFGS on the way.
    trouble = [str(w.message) for w in caught if issubclass(w.category, ConvergenceWarning)]
    return LogisticFit(
        np.concatenate([model.intercept_, model.coef_[0]]),
        int(np.max(model.n_iter_)),
        not trouble,
        "; ".join(trouble),
    )


def kept_weights(
    name: str, fit: LogisticFit, kept: dict | None = None, key: str = ""
) -> np.ndarray:
    """The fit's weights, warning when it did not converge; ``kept[key]`` gets its report."""
    if kept is not None:
        kept[key] = fit.report()
    if not fit.converged:
        msg = f"{fit.iterations} iterations: {fit.note}"
        warnings.warn(f"acceptance fit {name} did not converge ({msg})", RuntimeWarning, 2)
    return fit.weights
