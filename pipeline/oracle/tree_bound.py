"""The tree bound: the Bellman limit for draft trees under a selection rule R.

Conditioned on the reference, a clairvoyant choice of nodes collapses to the chain along the
reference, so the action is reference-blind: at state i a budget of k = 0..K draft nodes
(gamma = k + 1 verified positions, the root included; k = 0 is a plain step) for a fixed rule
R applied to the tree the draft builds at x_{<=i} (pipeline.extract.draft_trees). At T = 0 on
the target's greedy text the step is deterministic:

* accepted a(i, k): how many of R's first k nodes lie on the reference path (the path's depth
  in the tree: greedy verification accepts exactly it);
* cost: T_D(draft forwards) + T_T(m, U(i, k), L_prompt + i) with m = 1 + the nodes
  verified and U the mean per MoE layer of the union of the experts of the root and of EVERY
  verified node (off-path ones routed as the target routes them: the ``trees`` table). The
  draft forwards: a rule with a depth cap d builds min(d, k) levels whatever it selects (the
  `tree` policy runs its ``depth``); one without builds exactly the levels its first k nodes
  reach (the tree the pass needs);
* dp[i] = min_k cost(i, k) + dp[i + a(i, k) + 1].

The arrays take the chain bound's shape ``[N, K + 1, K + 1]`` (P(a | k) one-hot at a(i, k)),
so pipeline.oracle.bellman solves them unchanged, with the chain's availability (k <= N - i,
k = 0 always). When R builds a chain (branch 1) its nodes are the draft's greedy chain and every
array equals the chain bound's under greedy acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.cost.model import CostModel
from pipeline.data.schemas import experts_to_numpy
from pipeline.extract.draft_trees import TreeRule
from pipeline.models.adapters import MoESpec
from pipeline.oracle.bellman import OracleSolution, available, evaluate_policy, solve_many
from pipeline.oracle.expert_union import bitmasks, mean_popcount


@dataclass(frozen=True)
class TreeInput:
    """One sequence under one rule, budgets k = 0..K."""

    seq_id: str
    rule: TreeRule
    prompt_len: int
    accepted: np.ndarray  # [N, K + 1] a(i, k)
    union: np.ndarray  # [N, K + 1] U(i, k)
    verified: np.ndarray  # [N, K + 1] m(i, k) = 1 + nodes verified (a small tree may hold < k)
    forwards: np.ndarray  # [N, K + 1] draft forwards that build the tree (0 at k = 0)

    @property
    def n(self) -> int:
        return self.accepted.shape[0]

    @property
    def k_max(self) -> int:
        return self.accepted.shape[1] - 1


def tree_input(
    seq_id: str,
    prompt_len: int,
    routing: np.ndarray,
    trees: pa.Table,
    rule: TreeRule,
    k_max: int,
    spec: MoESpec,
) -> TreeInput:
    """From one sequence's ``tokens`` routing (``[N + 1, layers, top_k]``, x_0..x_N) and its
    ``trees`` rows (any rules: those of ``rule`` are used)."""
    rows = trees.filter(
        pc.and_(pc.equal(trees.column("seq_id"), seq_id), pc.equal(trees.column("rule"), rule.name))
    )
    rows = rows.filter(pc.less_equal(rows.column("j"), k_max))
    n = len(routing) - 1
    i = rows.column("i").to_numpy().astype(np.int64)
    j = rows.column("j").to_numpy().astype(np.int64)
    if rows.num_rows == 0 or i.max() >= n:
        raise ValueError(
            f"{seq_id}: no trees of rule {rule.name} for its {n} states (extract with --trees)"
        )
    token_masks = bitmasks(routing, spec.num_experts)
    node_masks = np.zeros((n, k_max + 1, *token_masks.shape[1:]), dtype=np.uint64)
    node_masks[:, 0] = token_masks[:n]  # the root x_i
    node_masks[i, j] = bitmasks(
        experts_to_numpy(rows.column("experts"), spec.num_moe_layers, spec.top_k), spec.num_experts
    )
    union = mean_popcount(np.bitwise_or.accumulate(node_masks, axis=1))
    on_path = np.zeros((n, k_max + 1), dtype=np.int64)
    on_path[i, j] = rows.column("on_path").to_numpy(zero_copy_only=False)
    nodes = np.zeros(n, dtype=np.int64)
    np.maximum.at(nodes, i, j)
    verified = 1 + np.minimum(np.arange(k_max + 1)[None, :], nodes[:, None])
    if rule.depth is None:  # the levels its first k nodes reach
        depth = np.zeros((n, k_max + 1), dtype=np.int64)
        depth[i, j] = rows.column("depth").to_numpy()
        forwards = np.maximum.accumulate(depth, axis=1)
    else:  # the `tree` policy's depth: min(depth, k) levels whatever it selects
        forwards = np.broadcast_to([rule.levels(k) for k in range(k_max + 1)], (n, k_max + 1))
    return TreeInput(
        seq_id, rule, prompt_len, np.cumsum(on_path, axis=1), union, verified, np.asarray(forwards)
    )


def tree_tables(model: CostModel, tin: TreeInput) -> tuple[np.ndarray, np.ndarray]:
    """``P[i, k, a]`` (one-hot at a(i, k), zero where k is unavailable) and ``Cost[i, k, a]``
    in ms (the same for every a: the step is deterministic), for pipeline.oracle.bellman."""
    n, kk = tin.accepted.shape
    ok = available(n, kk - 1)
    probs = np.zeros((n, kk, kk))
    ii, ks = np.nonzero(ok)
    probs[ii, ks, tin.accepted[ii, ks]] = 1.0
    missing = model.missing_m(np.unique(tin.verified).tolist())
    if missing:
        raise ValueError(
            f"the tree bound at budget {kk} (rule {tin.rule.name}) needs "
            + model.missing_m_message(missing)
        )
    beta0 = np.vectorize(model.beta0.__getitem__)(tin.verified)
    alpha = np.vectorize(model.alpha.__getitem__)(tin.verified)
    draft = np.where(tin.forwards > 0, model.draft_a * tin.forwards + model.draft_b, 0.0)
    ctx = model.c * (tin.prompt_len + np.arange(n))
    step = draft + beta0 + alpha * tin.union + ctx[:, None]
    return probs, np.repeat(step[:, :, None], kk, axis=2)


def solve_tree(
    model: CostModel,
    tin: TreeInput,
    caps: list[int],
    tables: tuple[np.ndarray, np.ndarray] | None = None,
) -> list[OracleSolution]:
    """The tree bound with budgets capped at each k in ``caps`` (gamma <= k + 1);
    ``tables``: tree_tables(model, tin) if already built."""
    probs, cost = tables if tables is not None else tree_tables(model, tin)
    union = np.repeat(tin.union[:, :, None], tin.k_max + 1, axis=2)
    return solve_many(probs, cost, caps, union)


def fixed_budgets_ms(probs: np.ndarray, cost: np.ndarray, ks: list[int]) -> np.ndarray:
    """Expected cost of one budget k at every state, for each k in ``ks`` (k capped at N - i
    near the end), of a chain's or a rule's tables: a static policy (fixed K, or `tree` /
    `ecospec` at one gamma) priced by the same model. One pass for all of them."""
    n = probs.shape[0]
    schedules = np.minimum(np.asarray(ks)[:, None], n - np.arange(n)[None, :])
    return evaluate_policy(probs, cost, schedules)[:, 0]


def fixed_budget_ms(model: CostModel, tin: TreeInput, k: int) -> float:
    """fixed_budgets_ms of one rule at one budget."""
    return float(fixed_budgets_ms(*tree_tables(model, tin), [k])[0])


def solve_either(tables: list[tuple[np.ndarray, np.ndarray]], cap: int) -> tuple[float, list]:
    """The bound when every state may take any action of several deterministic tables (the
    chain's greedy arrays and a rule's, say: the best of a chain or that rule's tree at each
    state), budgets k <= ``cap``: dp[0] and the optimal path's steps (k + 1, a) from state 0."""
    steps, costs, nexts = [], [], []
    for probs, cost in tables:
        kk = min(cap + 1, probs.shape[1])
        p, c = probs[:, :kk], cost[:, :kk]
        a = p.argmax(axis=2)
        if not np.all((p.max(axis=2) == 1.0) | (p.sum(axis=2) == 0)):
            raise ValueError("solve_either needs deterministic tables (greedy acceptance)")
        ok = p.sum(axis=2) > 0.5
        costs.append(np.where(ok, np.take_along_axis(c, a[:, :, None], 2)[:, :, 0], np.inf))
        nexts.append(a)
        steps.append(np.broadcast_to(np.arange(kk), a.shape))
    cost, accepted, ks = (np.concatenate(x, axis=1) for x in (costs, nexts, steps))
    n = cost.shape[0]
    dp = np.zeros(n + 1)
    best = np.zeros(n, dtype=np.int64)
    for i in range(n - 1, -1, -1):
        q = cost[i] + dp[np.minimum(i + accepted[i] + 1, n)]
        best[i] = int(np.argmin(q))
        dp[i] = q[best[i]]
    path, i = [], 0
    while i < n:
        path.append((int(ks[i, best[i]]) + 1, int(accepted[i, best[i]])))
        i += int(accepted[i, best[i]]) + 1
    return float(dp[0]), path
