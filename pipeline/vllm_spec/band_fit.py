"""Least squares per batch-size band that forgets old steps but never its prior (numpy only:
it runs in vLLM's engine process): the fit under pipeline.vllm_spec.online_step_cost.

Each band holds the information matrix and vector of its steps and the prior, updated as an
inverse-covariance fit with forgetting would be, except that the prior's share is re-added at
every step: what the band's recent steps do not measure stays at, or returns to, the prior.
"""

from __future__ import annotations

import numpy as np


class BandFit:
    def __init__(self, prior_info: np.ndarray, prior_theta: np.ndarray):
        """``prior_info``: bands x terms x terms, each band's prior precision."""
        self.prior_info = np.asarray(prior_info, dtype=float)
        self.anchor(prior_theta)

    def anchor(self, theta) -> None:
        """Every band from ``theta``, kept as the prior."""
        self.prior_theta = np.asarray(theta, dtype=float).copy()
        self.info = self.prior_info.copy()
        self.info_theta = self.prior_info @ self.prior_theta
        self.theta = np.repeat(self.prior_theta[None], len(self.prior_info), axis=0)
        self.unsolved: set[int] = set()  # bands updated since their last solve

    def set(self, theta) -> None:
        """Every band's coefficients, until that band's next update."""
        self.theta[:] = np.asarray(theta, dtype=float)
        self.unsolved.clear()

    def solved(self, b: int) -> tuple[np.ndarray, bool]:
        """Band ``b``'s coefficients, and whether this call solved them anew."""
        if b not in self.unsolved:
            return self.theta[b], False
        self.theta[b] = np.linalg.solve(self.info[b], self.info_theta[b])
        self.unsolved.discard(b)
        return self.theta[b], True

    def update(self, b: int, x: np.ndarray, y: np.ndarray, forget: float) -> None:
        """Band ``b`` after the steps ``x`` (steps x terms) measured at ``y``, in order, each
        forgetting ``1 - forget`` of what came before it."""
        n = len(y)
        weight = forget ** np.arange(n - 1, -1, -1.0)  # the later a step, the less forgotten
        held = (1.0 - forget) * float(weight.sum())  # the prior's share, re-added every step
        prior = self.prior_info[b]
        self.info[b] = forget**n * self.info[b] + (x * weight[:, None]).T @ x + held * prior
        self.info_theta[b] = (
            forget**n * self.info_theta[b] + x.T @ (weight * y) + held * (prior @ self.prior_theta)
        )
        self.unsolved.add(b)
