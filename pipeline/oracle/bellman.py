"""The Bellman oracle (docs/contract.md): optimal draft length at every position of a reference
sequence, the speedup bound it implies, and its visitation.

Everything is an array over (state i, budget k, accepted a), indexed ``[i, k, a]`` with
k = 0..lmax: P(a | k) from the per-position acceptance r_j, Cost(i, k, a) from U(i, k, a) and
the cost model. k = 0 is a plain step (m = 1, no draft, next state i + 1); with it available
dp[0] <= the autoregressive cost, so the bound is >= 1. An action (i, k) is available iff its
row ``probs[i, k]`` is a distribution (acceptance_table zeroes the others: k > N - i, and
k = 0 when ``plain_step=False``, the paper's k >= 1). The backward pass is one loop over
states (the state graph is a DAG); k and a are vectorised.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.cost.model import CostModel


def acceptance_table(r: np.ndarray, lmax: int, plain_step: bool = True) -> np.ndarray:
    """``P[i, k, a]`` = P(a | k) at state i, k = 0..lmax, from ``r[t]``, the probability that
    the verifier accepts reference token x_t drafted after x_<t, t = 1..N (``r[0]`` is x_0's
    and unused): accept a, reject the (a+1)-th; P(k | k) = the product of all k. k = 0 puts
    all mass on a = 0 (unavailable, all zero, when ``plain_step`` is False). Cells with
    k > N - i are zero."""
    r = np.asarray(r, dtype=float)
    n = len(r) - 1
    padded = np.concatenate([r[1:], np.zeros(lmax)])
    window = np.lib.stride_tricks.sliding_window_view(padded, lmax)[:n]  # [N, lmax]: r_j
    prefix = np.concatenate([np.ones((n, 1)), np.cumprod(window, axis=1)], axis=1)  # [N, lmax+1]
    k = np.arange(lmax + 1).reshape(1, -1, 1)
    a = np.arange(lmax + 1).reshape(1, 1, -1)
    reject = np.concatenate([1 - window, np.ones((n, 1))], axis=1)  # 1 - r_a (a = lmax unused)
    probs = np.where(a < k, prefix[:, None, :] * reject[:, None, :], 0.0)
    probs = np.where(a == k, prefix[:, None, :], probs)
    return np.where(available(n, lmax, plain_step)[:, :, None], probs, 0.0)


def available(n: int, lmax: int, plain_step: bool = True) -> np.ndarray:
    """``[N, lmax + 1]``: budget k may be taken at state i (k <= N - i; k = 0 iff plain_step)."""
    k = np.arange(lmax + 1)[None, :]
    ok = k <= (n - np.arange(n))[:, None]
    return ok & (k >= (0 if plain_step else 1))


def cost_table(
    model: CostModel, union: np.ndarray, prompt_len: int, alpha_scale: float = 1.0
) -> np.ndarray:
    """``Cost[i, k, a]`` = T_D(k) + T_T(k + 1, U(i, k, a), L_prompt + i) in ms, k = 0..lmax
    (T_D(0) = 0: a plain step drafts nothing); NaN where the cell does not exist.
    ``alpha_scale = 0`` removes the expert term (the ablation)."""
    n, kk, _ = union.shape
    ks = np.arange(kk)
    beta0 = np.array([model.beta0[k + 1] for k in ks])
    alpha = np.array([model.alpha[k + 1] for k in ks]) * alpha_scale
    draft = np.array([model.t_draft(int(k)) for k in ks])
    ctx = model.c * (prompt_len + np.arange(n))
    return (draft + beta0)[None, :, None] + alpha[None, :, None] * union + ctx[:, None, None]


def ar_cost(model: CostModel, token_experts: np.ndarray, prompt_len: int) -> float:
    """Autoregressive cost of the same text: sum over i < N of T_T(1, |E(i)|, L_prompt + i)
    (the DP's cost of k = 0 at every state)."""
    n = len(token_experts) - 1
    ctx = prompt_len + np.arange(n)
    return float(np.sum(model.beta0[1] + model.alpha[1] * token_experts[:n] + model.c * ctx))


@dataclass(frozen=True)
class OracleSolution:
    dp: np.ndarray  # [N + 1] expected remaining cost, dp[N] = 0
    q: np.ndarray  # [N, lmax + 1] expected cost-to-go of each budget (inf where unavailable)
    k_star: np.ndarray  # [N] optimal budget, 0 = a plain step
    e_accept: np.ndarray  # [N, lmax + 1] E[a | k]
    e_cost: np.ndarray  # [N, lmax + 1] E[Cost | k] of the round alone
    e_experts: np.ndarray  # [N, lmax + 1] E[U | k]
    visit: np.ndarray  # [N + 1] probability of visiting each state under k*

    def mean_draft_length(self) -> float:
        v = self.visit[:-1]
        return float((v * self.k_star).sum() / v.sum())

    def mean_accepted(self) -> float:
        v = self.visit[:-1]
        chosen = self.e_accept[np.arange(len(v)), self.k_star]
        return float((v * chosen).sum() / v.sum())


def _round_moments(probs: np.ndarray, cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Availability ``[N, K]`` and E[Cost | k] of the round, ignoring cells that do not exist."""
    valid = probs.sum(axis=2) > 0.5  # a distribution or all zero
    kk = probs.shape[1]
    cell = valid[:, :, None] & (np.arange(kk)[None, None, :] <= np.arange(kk)[None, :, None])
    return valid, (probs * np.where(cell, cost, 0.0)).sum(axis=2)


def solve(probs: np.ndarray, cost: np.ndarray, union: np.ndarray | None = None) -> OracleSolution:
    """Backward Bellman pass and forward visitation for one sequence.

    ``probs`` and ``cost`` are ``[N, lmax + 1, lmax + 1]`` (acceptance_table, cost_table);
    unavailable actions (all-zero rows of ``probs``) are never chosen. Ties go to the smaller k.
    """
    return solve_many(probs, cost, [probs.shape[1] - 1], union)[0]


def solve_many(
    probs: np.ndarray, cost: np.ndarray, lmaxes: list[int], union: np.ndarray | None = None
) -> list[OracleSolution]:
    """``solve`` with budgets capped at each of ``lmaxes`` in one backward pass over the
    states (the tables of a larger Lmax hold every cell of a smaller one)."""
    n, kk, _ = probs.shape
    a = np.arange(kk)
    valid0, e_cost = _round_moments(probs, cost)
    caps = np.asarray(lmaxes)
    valid = valid0[None] & (a[None, None, :] <= caps[:, None, None])  # [B, N, K]
    if not valid.any(axis=2).all():
        raise ValueError("some state has no available action (lmax < 1 without a plain step?)")
    e_accept = (probs * a).sum(axis=2)
    e_experts = (probs * np.nan_to_num(union)).sum(axis=2) if union is not None else e_cost * 0
    b = len(caps)
    dp = np.zeros((b, n + 1))
    q = np.full((b, n, kk), np.inf)
    k_star = np.zeros((b, n), dtype=np.int64)
    for i in range(n - 1, -1, -1):
        qi = e_cost[i][None, :] + dp[:, np.minimum(i + a + 1, n)] @ probs[i].T  # [B, K]
        qi[~valid[:, i]] = np.inf
        q[:, i] = qi
        k_star[:, i] = np.argmin(qi, axis=1)
        dp[:, i] = qi[np.arange(b), k_star[:, i]]
    visit = visitation(probs, k_star)
    return [
        OracleSolution(dp[j], q[j], k_star[j], e_accept, e_cost, e_experts, visit[j])
        for j in range(b)
    ]


def visitation(probs: np.ndarray, k_policy: np.ndarray) -> np.ndarray:
    """``v[0] = 1``, ``v[min(i + a + 1, N)] += v[i] P(a | k(i))``: the probability that a policy
    starting at state 0 ever stands at each state (``[N + 1]``; v[N] = 1). ``k_policy`` may be
    ``[B, N]`` (B schedules at once, ``[B, N + 1]`` out)."""
    n, kk, _ = probs.shape
    k_policy = np.asarray(k_policy)
    batch = np.atleast_2d(k_policy)
    rows = np.arange(len(batch))[:, None]
    a = np.arange(kk)
    visit = np.zeros((len(batch), n + 1))
    visit[:, 0] = 1.0
    for i in range(n):
        flow = visit[:, i, None] * probs[i, batch[:, i]]  # [B, K]
        np.add.at(visit, (rows, np.minimum(i + a + 1, n)[None, :]), flow)
    return visit if k_policy.ndim == 2 else visit[0]


def evaluate_policy(probs: np.ndarray, cost: np.ndarray, k_policy: np.ndarray) -> np.ndarray:
    """Expected remaining cost ``[N + 1]`` of a fixed schedule (budget ``k_policy[i]`` at i),
    e.g. k* chosen on one tail draw priced with another draw's ``cost`` (cross-fitting).
    ``k_policy`` may be ``[B, N]`` (B schedules priced at once, ``[B, N + 1]`` out)."""
    n, kk, _ = probs.shape
    a = np.arange(kk)
    valid, e_cost = _round_moments(probs, cost)
    k_policy = np.asarray(k_policy, dtype=np.int64)
    batch = np.atleast_2d(k_policy)
    out_of_range = (batch < 0) | (batch >= kk)
    ok = valid[np.arange(n)[None, :], np.clip(batch, 0, kk - 1)] & ~out_of_range
    if not ok.all():
        j, i = (int(x[0]) for x in np.nonzero(~ok))
        raise ValueError(f"the policy takes unavailable budget k = {batch[j, i]} at state {i}")
    value = np.zeros((len(batch), n + 1))
    for i in range(n - 1, -1, -1):
        ks = batch[:, i]
        nxt = value[:, np.minimum(i + a + 1, n)]
        value[:, i] = e_cost[i, ks] + (probs[i, ks] * nxt).sum(axis=1)
    return value if k_policy.ndim == 2 else value[0]
