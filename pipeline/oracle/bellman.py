"""The Bellman oracle (DESIGN section 3): optimal draft length at every position of a reference
sequence, the speedup bound it implies, and its visitation.

Everything is an array over (state i, budget k, accepted a): P(a | k) from the draft's
confidences, Cost(i, k, a) from U(i, k, a) and the cost model. The backward pass is one loop
over states (the state graph is a DAG); k and a are vectorised.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.cost.model import CostModel


def acceptance_table(p: np.ndarray, lmax: int) -> np.ndarray:
    """``P[i, k - 1, a]`` = P(a | k) at state i, from ``p[t]`` = P_draft(x_t | x_<t), t = 1..N
    (``p[0]`` is x_0's and unused). Surrogate rule: accept a, reject the (a+1)-th; P(k | k) =
    the product of all k. Cells with k > N - i are zero."""
    n = len(p) - 1
    padded = np.concatenate([p[1:], np.zeros(lmax)])
    window = np.lib.stride_tricks.sliding_window_view(padded, lmax)[:n]  # [N, lmax]: p_j
    prefix = np.concatenate([np.ones((n, 1)), np.cumprod(window, axis=1)], axis=1)  # [N, lmax+1]
    k = np.arange(1, lmax + 1).reshape(1, -1, 1)
    a = np.arange(lmax + 1).reshape(1, 1, -1)
    reject = np.concatenate([1 - window, np.ones((n, 1))], axis=1)  # 1 - p_a (a = lmax unused)
    probs = np.where(a < k, prefix[:, None, :] * reject[:, None, :], 0.0)
    probs = np.where(a == k, prefix[:, None, :], probs)
    valid = k.reshape(1, -1) <= (n - np.arange(n)).reshape(-1, 1)
    return np.where(valid[:, :, None], probs, 0.0)


def cost_table(
    model: CostModel, union: np.ndarray, prompt_len: int, alpha_scale: float = 1.0
) -> np.ndarray:
    """``Cost[i, k - 1, a]`` = T_D(k) + T_T(k + 1, U(i, k, a), L_prompt + i) in ms (NaN where
    the cell does not exist). ``alpha_scale = 0`` removes the expert term (the ablation)."""
    n, lmax, _ = union.shape
    ks = np.arange(1, lmax + 1)
    beta0 = np.array([model.beta0[k + 1] for k in ks])
    alpha = np.array([model.alpha[k + 1] for k in ks]) * alpha_scale
    draft = np.array([model.t_draft(int(k)) for k in ks])
    ctx = model.c * (prompt_len + np.arange(n))
    return (draft + beta0)[None, :, None] + alpha[None, :, None] * union + ctx[:, None, None]


def ar_cost(model: CostModel, token_experts: np.ndarray, prompt_len: int) -> float:
    """Autoregressive cost of the same text: sum over i < N of T_T(1, |E(i)|, L_prompt + i)."""
    n = len(token_experts) - 1
    ctx = prompt_len + np.arange(n)
    return float(np.sum(model.beta0[1] + model.alpha[1] * token_experts[:n] + model.c * ctx))


@dataclass(frozen=True)
class OracleSolution:
    dp: np.ndarray  # [N + 1] expected remaining cost, dp[N] = 0
    q: np.ndarray  # [N, lmax] expected cost-to-go of each budget (inf where invalid)
    k_star: np.ndarray  # [N] optimal budget (1-based)
    e_accept: np.ndarray  # [N, lmax] E[a | k]
    e_cost: np.ndarray  # [N, lmax] E[Cost | k] of the round alone
    e_experts: np.ndarray  # [N, lmax] E[U | k]
    visit: np.ndarray  # [N + 1] probability of visiting each state under k*

    def mean_draft_length(self) -> float:
        v = self.visit[:-1]
        return float((v * self.k_star).sum() / v.sum())

    def mean_accepted(self) -> float:
        v = self.visit[:-1]
        chosen = self.e_accept[np.arange(len(v)), self.k_star - 1]
        return float((v * chosen).sum() / v.sum())


def solve(probs: np.ndarray, cost: np.ndarray, union: np.ndarray | None = None) -> OracleSolution:
    """Backward Bellman pass and forward visitation for one sequence.

    ``probs`` and ``cost`` are ``[N, lmax, lmax + 1]``; cells with k > N - i are ignored.
    """
    n, lmax, _ = probs.shape
    a = np.arange(lmax + 1)
    k = np.arange(1, lmax + 1)
    valid = k[None, :] <= (n - np.arange(n))[:, None]  # [N, lmax]
    cell = valid[:, :, None] & (a[None, None, :] <= k[None, :, None])
    safe_cost = np.where(cell, cost, 0.0)
    e_cost = (probs * safe_cost).sum(axis=2)
    e_accept = (probs * a).sum(axis=2)
    e_experts = (
        (probs * np.where(cell, union, 0.0)).sum(axis=2) if union is not None else e_cost * 0
    )
    dp = np.zeros(n + 1)
    q = np.full((n, lmax), np.inf)
    k_star = np.zeros(n, dtype=np.int64)
    for i in range(n - 1, -1, -1):
        nxt = dp[np.minimum(i + a + 1, n)]  # [lmax + 1]
        qi = e_cost[i] + probs[i] @ nxt
        qi[~valid[i]] = np.inf
        q[i] = qi
        best = int(np.argmin(qi))
        k_star[i] = best + 1
        dp[i] = qi[best]
    visit = np.zeros(n + 1)
    visit[0] = 1.0
    for i in range(n):
        if visit[i]:
            np.add.at(visit, np.minimum(i + a + 1, n), visit[i] * probs[i, k_star[i] - 1])
    return OracleSolution(dp, q, k_star, e_accept, e_cost, e_experts, visit)


def evaluate_policy(probs: np.ndarray, cost: np.ndarray, k_policy: np.ndarray) -> np.ndarray:
    """Expected remaining cost ``[N + 1]`` of a fixed policy (budget ``k_policy[i]`` at i)."""
    n, lmax, _ = probs.shape
    a = np.arange(lmax + 1)
    k = np.arange(1, lmax + 1)
    cell = (k[None, :, None] <= (n - np.arange(n))[:, None, None]) & (
        a[None, None, :] <= k[None, :, None]
    )
    e_cost = (probs * np.where(cell, cost, 0.0)).sum(axis=2)
    value = np.zeros(n + 1)
    for i in range(n - 1, -1, -1):
        kk = int(k_policy[i]) - 1
        value[i] = e_cost[i, kk] + probs[i, kk] @ value[np.minimum(i + a + 1, n)]
    return value
