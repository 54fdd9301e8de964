"""The informed ceiling with draft trees: how much a policy could gain over the best fixed
draft length if at every state it could verify a chain or a small tree of the draft's
candidates, knowing each one's acceptance exactly, on text the target samples at the
decoding temperature (pipeline.acceptance.ceiling is the chains-only ceiling).

Multi-candidate verification (pipeline.decode.acceptance) tries a node's children in order and
accepts child x with probability r(x), r starting as the target's p and losing each rejected
sibling's mass, renormalised. The chance that child i is the one accepted telescopes:

    prod_{j<i} (1 - r_j(x_j)) * r_i(x_i)
        = (1 - sum_{j<i} p(x_j)) * p(x_i) / (1 - sum_{j<i} p(x_j)) = p(x_i),

so a node is reached with the product of p along its path (each p the target's probability of
the node's token after its ancestors; at T = 0 one-hot at the argmax, the greedy rule), and
P(accepted depth >= d) is the sum of that over the depth-d nodes. After a step the text moves
on by the accepted depth plus one, as in the chain ceiling (the sampled text stands for where
decoding goes).

Actions at a state: a chain of k = 0 .. K tokens (k = 0: a plain step; its P(j | k) from the
chain acceptances a_t), or the rule's first k = 1 .. K tree nodes, priced T_D(levels) +
T_T(k + 1, U(k + 1), L) like a chain of as many positions. The expected cost of the text is
C(t) = min_action cost + sum_a P(a | action) C(t + a + 1); each ceiling restricts the actions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.decode.types import SamplingConfig
from pipeline.extract.draft_trees import TreeRule
from pipeline.extract.sampled_trees import forced_along, sampled_trees
from pipeline.extract.teacher_forced import TeacherForced
from pipeline.models.loading import ModelPair

# step(forwards, m, t): the modelled cost at text position t of a step that runs ``forwards``
# draft forwards and verifies m positions.
TreeStepCost = Callable[[int, int, int], float]


def depth_distribution(
    parents: Sequence[int], p: Sequence[float], depth: Sequence[int]
) -> np.ndarray:
    """P(accepted depth = a), a = 0 .. len(parents), of a tree under multi-candidate
    verification: ``parents[j]`` < j (-1: the root), ``p[j]`` the target's probability of node
    j's token after its ancestors, ``depth[j]`` >= 1 its depth. Siblings must hold distinct
    tokens (the draft's top-b are)."""
    k = len(parents)
    reach = np.zeros(k)
    at_least = np.zeros(k + 2)
    at_least[0] = 1.0
    for j, (parent, pj, d) in enumerate(zip(parents, p, depth, strict=True)):
        reach[j] = pj * (1.0 if parent < 0 else reach[parent])
        at_least[d] += reach[j]
    return at_least[: k + 1] - at_least[1 : k + 2]


def chain_table(acc: np.ndarray, k_max: int) -> np.ndarray:
    """``P[t, k, a]``: a chain of k = 0 .. k_max tokens drafted at text position t accepts a
    of them, from ``acc[t]`` (the chain ceiling's a_t); zero rows where k > n - t."""
    n = len(acc)
    probs = np.zeros((n, k_max + 1, k_max + 1))
    for t in range(n):
        for k in range(min(k_max, n - t) + 1):
            survive = 1.0
            for a in range(k):
                probs[t, k, a] = survive * (1 - acc[t + a])
                survive *= acc[t + a]
            probs[t, k, k] = survive
    return probs


def tree_table(
    trees: Sequence[tuple[Sequence[int], Sequence[float], Sequence[int]]], k_max: int
) -> tuple[np.ndarray, np.ndarray]:
    """``P[t, k, a]`` for the first k = 1 .. k_max nodes of each state's tree (``trees[t]`` =
    (parents, p, depth) in selection order; k = 0 unavailable, that is the chain's plain
    step) and the draft forwards building them (the levels those nodes reach)."""
    n = len(trees)
    probs = np.zeros((n, k_max + 1, k_max + 1))
    forwards = np.zeros((n, k_max + 1), dtype=np.int64)
    for t, (parents, p, depth) in enumerate(trees):
        for k in range(1, min(k_max, len(parents), n - t) + 1):
            probs[t, k, : k + 1] = depth_distribution(parents[:k], p[:k], depth[:k])
            forwards[t, k] = max(depth[:k])
    return probs, forwards


def expected_cost(probs: np.ndarray, cost: np.ndarray, fixed: np.ndarray | None = None) -> float:
    """C(0) of a text: ``probs[t, action, a]`` (an all-zero row: the action is unavailable
    there), ``cost[t, action]`` in ms; the minimum over available actions at every state, or
    with ``fixed[t]`` the action taken at t."""
    n = probs.shape[0]
    value = np.zeros(n + 1)
    for t in range(n - 1, -1, -1):
        nxt = value[np.minimum(t + 1 + np.arange(probs.shape[2]), n)]
        totals = cost[t] + probs[t] @ nxt
        ok = probs[t].sum(axis=1) > 0.5
        if fixed is not None:
            value[t] = totals[fixed[t]]
        else:
            value[t] = totals[ok].min()
    return float(value[0])


@dataclass
class TreeCeiling:
    """One group of texts: total expected costs (ms) of the best fixed chain length, the
    chains-only ceiling, the trees-only one (a plain step allowed) and chain-or-tree."""

    best_fixed: float
    chain: float
    tree: float
    chain_or_tree: float

    def over_best_fixed(self) -> dict[str, float]:
        return {
            "chain": self.best_fixed / self.chain,
            "tree": self.best_fixed / self.tree,
            "chain_or_tree": self.best_fixed / self.chain_or_tree,
        }


def text_costs(
    acc: np.ndarray,
    trees: Sequence[tuple[Sequence[int], Sequence[float], Sequence[int]]],
    step: TreeStepCost,
    k_max: int,
    fixed_ks: Sequence[int],
) -> dict[str, float]:
    """One text's expected costs: ``fixed K`` for each K in ``fixed_ks``, then ``chain``,
    ``tree`` and ``chain_or_tree``."""
    n = len(acc)
    if len(trees) != n:
        raise ValueError(f"{len(trees)} trees for a text of {n} positions")
    chain = chain_table(acc, k_max)
    tree, forwards = tree_table(trees, k_max)
    ks = np.arange(k_max + 1)
    chain_cost = np.array([[step(int(k), int(k) + 1, t) for k in ks] for t in range(n)])
    tree_cost = np.array(
        [
            [step(int(f), int(k) + 1, t) for k, f in zip(ks, row, strict=True)]
            for t, row in enumerate(forwards)
        ]
    )
    plain = np.zeros_like(tree)
    plain[:, 0, 0] = 1.0  # trees-only still takes plain steps
    out = {
        f"fixed {k}": expected_cost(chain, chain_cost, np.minimum(k, n - np.arange(n)))
        for k in sorted({0, *fixed_ks})
    }
    out["chain"] = expected_cost(chain, chain_cost)
    out["tree"] = expected_cost(tree + plain, np.where(ks == 0, chain_cost, tree_cost))
    both = np.concatenate([chain, tree[:, 1:]], axis=1)
    out["chain_or_tree"] = expected_cost(
        both, np.concatenate([chain_cost, tree_cost[:, 1:]], axis=1)
    )
    return out


def tree_ceiling(per_text: Sequence[dict[str, float]]) -> TreeCeiling:
    """Summed over texts; the best fixed K is the one of least total cost (K = 0: `ar`)."""
    total = {key: sum(c[key] for c in per_text) for key in per_text[0]}
    fixed = min((v, key) for key, v in total.items() if key.startswith("fixed "))[0]
    return TreeCeiling(fixed, total["chain"], total["tree"], total["chain_or_tree"])


def texts_tree_ceiling(
    pair: ModelPair,
    texts: Sequence[tuple[list[int], Sequence[int], np.ndarray, TreeStepCost]],
    sampling: SamplingConfig,
    rule: TreeRule,
    k_max: int,
    fixed_ks: Sequence[int],
    each_forced: Callable[[TeacherForced], None] | None = None,
) -> TreeCeiling:
    """The ceilings of a group of texts, each (prompt ids, the text the target sampled at
    ``sampling``, its chain acceptances a_t, its step cost); trees of ``rule`` up to k_max
    nodes built along each text (pipeline.extract.sampled_trees). ``each_forced`` gets each
    text's teacher-forced pass, in order (another study of the same texts reads it too)."""
    per_text = []
    for ids, tokens, acc, step in texts:
        forced = forced_along(pair, list(ids), [int(t) for t in tokens])
        if each_forced is not None:
            each_forced(forced)
        trees = sampled_trees(
            pair, list(ids), [int(t) for t in tokens], sampling, rule, k_max, forced=forced
        )
        rows = [(s.parents, s.p, s.depth) for s in trees]
        per_text.append(text_costs(acc, rows, step, k_max, fixed_ks))
    return tree_ceiling(per_text)
