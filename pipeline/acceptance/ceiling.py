"""The informed ceiling: how much any chain policy can gain over the best fixed draft length
when all it could ever learn is each position's acceptance probability.

Along a text, a_i is the probability that the draft's token at position i is accepted given the
tokens before it were (T = 0: 0 or 1, whether the draft's argmax is the target's token; T > 0:
sum_x min(p_i(x), q_i(x))). A policy that knows every a_i exactly, but not the draws, chooses k
at each position to minimise the expected modelled cost of the whole text:

    C(t) = min_k  step(k, t) + sum_j P_t(j accepted | k) C(t + j + 1),   C(n) = 0

with P_t(j | k) = a_t ... a_{t+j-1} (1 - a_{t+j}) for j < k and a_t ... a_{t+k-1} for j = k.
No online policy knows more than the a_i (it sees the draft's side and the past), so at T > 0
C_fixed / C_clairvoyant bounds the gain of any chain policy over the best fixed K. At T = 0
the a_i are the outcomes themselves and the same solve is the oracle's bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pipeline.acceptance.tree_ceiling import TreeCeiling

# step(k, t): the modelled cost of a step at text position t that drafts k tokens.
StepCost = Callable[[int, int], float]


def expected_cost(acc: np.ndarray, step: StepCost, max_k: int, fixed: int | None = None) -> float:
    """C(0) above over ``acc`` (the a_i of one text); ``fixed``: every step drafts that many
    (fewer near the end of the text, where nothing is left to accept)."""
    n = len(acc)
    cost = np.zeros(n + 1)
    choices = range(max_k + 1) if fixed is None else (fixed,)
    for t in range(n - 1, -1, -1):
        best = np.inf
        for k in choices:
            k_eff = min(k, n - t)  # tokens past the text's end are never judged
            total, survive = step(k_eff, t), 1.0
            for j in range(k_eff):
                total += survive * (1 - acc[t + j]) * cost[t + j + 1]
                survive *= acc[t + j]
            total += survive * cost[min(t + k_eff + 1, n)]
            best = min(best, total)
        cost[t] = best
    return float(cost[0])


@dataclass
class Ceiling:
    """One group of texts (a domain at a temperature): total expected costs."""

    clairvoyant: float
    fixed: dict[int, float]  # K -> cost with every step drafting K
    tree: TreeCeiling | None = None  # with trees beside chains (pipeline.acceptance.tree_ceiling)

    @property
    def best_k(self) -> int:
        return min(self.fixed, key=self.fixed.__getitem__)

    @property
    def gain_over_best_fixed(self) -> float:
        return self.fixed[self.best_k] / self.clairvoyant

    @property
    def speedup_over_ar(self) -> float:
        return self.fixed[0] / self.clairvoyant


def ceiling(
    texts: list[np.ndarray], step_for: Callable[[int], StepCost], max_k: int, fixed_ks: list[int]
) -> Ceiling:
    """Summed over ``texts`` (their a_i); ``step_for(i)`` prices text i's steps."""
    clair = sum(expected_cost(a, step_for(i), max_k) for i, a in enumerate(texts))
    fixed = {
        k: sum(expected_cost(a, step_for(i), max_k, k) for i, a in enumerate(texts))
        for k in sorted({0, *fixed_ks})
    }
    return Ceiling(clair, fixed)
