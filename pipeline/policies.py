"""Draft policies: propose candidates with the draft, update from the outcome (one small
interface, as transformers' candidate generators separate proposing from adapting).

    ar          no draft: plain autoregressive steps through the same engine
    fixed       a chain of K tokens
    heuristic   transformers' schedule: K += 2 after a fully accepted chain, else K -= 1
    confidence  extend the chain while the draft's confidence stays >= a threshold
    tree        EAGLE-2 style: expand the top-b children of the best nodes per depth, keep the
                top gamma nodes by path probability
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.engine import Candidates, Drafter, StepOutcome


class Policy:
    name = "policy"

    def reset(self) -> None:
        """Called at the start of every generation."""

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        raise NotImplementedError

    def update(self, outcome: StepOutcome) -> None:
        """Adapt from the last step (most policies do not)."""


def draft_chain(
    drafter: Drafter, committed: list[int], k: int, min_conf: float = 0.0
) -> Candidates:
    """Up to k draft tokens, sampled (or argmax when greedy); stops early once the draft's
    confidence in its own token falls below ``min_conf`` (at least one token is drafted)."""
    cands = Candidates()
    probs = drafter.begin(committed)
    for j in range(k):
        token = drafter.sample(probs)
        conf = float(probs[token])
        if j > 0 and conf < min_conf:
            break
        cands.tokens.append(token)
        cands.parents.append(j - 1)
        cands.q.append(None if drafter.sampling.greedy else probs)
        cands.confidences.append(conf)
        if j + 1 < k:
            probs = drafter.extend(token)
    return cands


class AutoregressivePolicy(Policy):
    name = "ar"

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        return Candidates()


@dataclass
class FixedPolicy(Policy):
    k: int = 4
    name = "fixed"

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"fixed: k must be >= 1, got {self.k}")

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        return draft_chain(drafter, committed, self.k)


@dataclass
class HeuristicPolicy(Policy):
    """transformers' "heuristic" schedule for num_assistant_tokens."""

    start_k: int = 5
    max_k: int = 20
    name = "heuristic"

    def reset(self) -> None:
        self.k = self.start_k

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        return draft_chain(drafter, committed, self.k)

    def update(self, outcome: StepOutcome) -> None:
        if outcome.accepted == len(outcome.candidates):
            self.k = min(self.max_k, self.k + 2)
        else:
            self.k = max(1, self.k - 1)


@dataclass
class ConfidencePolicy(Policy):
    threshold: float = 0.4
    max_k: int = 10
    name = "confidence"

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"confidence: threshold must lie in [0, 1], got {self.threshold}")

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        return draft_chain(drafter, committed, self.max_k, min_conf=self.threshold)


@dataclass
class TreePolicy(Policy):
    """EAGLE-2 style dynamic tree: at each depth expand the top-``branch`` children of the
    ``branch`` best frontier nodes (by path probability), then keep the ``gamma`` best nodes
    overall. Nodes are chosen deterministically (top-b), so verification uses the
    multi-candidate rule for deterministic proposals."""

    depth: int = 4
    branch: int = 2
    gamma: int = 8
    name = "tree"

    def __post_init__(self) -> None:
        if self.depth < 1 or self.branch < 1 or self.gamma < 1:
            raise ValueError("tree: depth, branch and gamma must be >= 1")

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        tree = build_tree(drafter, committed, self.depth, self.branch)
        keep = sorted(range(len(tree.tokens)), key=lambda j: -tree.path_p[j])[: self.gamma]
        return tree.subset(keep)


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]  # -1: child of the last committed token
    path_p: list[float]  # cumulative draft probability from the root
    conf: list[float]  # the draft's probability of the node given its parent
    # The draft hidden state each node was proposed from (its parent's), for expert predictors.
    contexts: list[torch.Tensor | None] = field(default_factory=list)

    def path(self, node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def subset(self, nodes: list[int]) -> Candidates:
        """Candidates made of ``nodes`` and all their ancestors (verification is
        prefix-closed), in tree order."""
        keep = set()
        for j in nodes:
            keep.update(self.path(j))
        kept = sorted(keep)
        remap = {old: new for new, old in enumerate(kept)}
        return Candidates(
            tokens=[self.tokens[j] for j in kept],
            parents=[remap[self.parents[j]] if self.parents[j] >= 0 else -1 for j in kept],
            q=[None] * len(kept),
            confidences=[self.conf[j] for j in kept],
        )


def build_tree(drafter: Drafter, committed: list[int], depth: int, branch: int) -> DraftTree:
    """EAGLE-2 style expansion: at each depth the top-``branch`` children of the ``branch``
    best nodes so far (by path probability); one packed draft forward per depth."""
    tree = DraftTree([], [], [], [])
    probs = drafter.begin(committed).unsqueeze(0)
    frontier_ctx = drafter.hidden[-1:]
    frontier, frontier_p = [-1], [1.0]
    for level in range(depth):
        new_tokens, new_parents, new_p, new_conf = [], [], [], []
        for row, (node, pp) in enumerate(zip(frontier, frontier_p, strict=True)):
            top = torch.topk(probs[row], branch)
            for value, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                new_tokens.append(token)
                new_parents.append(node)
                new_p.append(pp * value)
                new_conf.append(value)
                tree.contexts.append(frontier_ctx[row])
        start = len(tree.tokens)
        tree.tokens += new_tokens
        tree.parents += new_parents
        tree.path_p += new_p
        tree.conf += new_conf
        order = sorted(range(len(new_tokens)), key=lambda j: -new_p[j])[:branch]
        frontier = [start + j for j in order]
        frontier_p = [new_p[j] for j in order]
        if level == depth - 1:
            break
        # Every node of the level is appended (so candidate and cache indices agree); only
        # the frontier's distributions are used.
        probs = drafter.expand(new_tokens, new_parents)[order]
        frontier_ctx = drafter.hidden[order]
    return tree


POLICIES: dict[str, type[Policy]] = {
    "ar": AutoregressivePolicy,
    "fixed": FixedPolicy,
    "heuristic": HeuristicPolicy,
    "confidence": ConfidencePolicy,
    "tree": TreePolicy,
}


# Cost-aware policies (pipeline.cost_aware) read the expert predictor, the cost model and the
# oracle's lambda; they are built through the same factory.
COST_AWARE_NAMES = ("ecospec", "ecospec-global", "marginal")
POLICY_NAMES = (*POLICIES, *COST_AWARE_NAMES)


def make_policy(name: str, artifacts: Any = None, /, **knobs: Any) -> Policy:
    """A policy by name with its knobs; unknown names or knobs raise a clear ValueError.
    ``artifacts`` (pipeline.policy_artifacts.PolicyArtifacts) serve the cost-aware policies;
    by default they are loaded from beside the embedded models."""
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    try:
        if name in COST_AWARE_NAMES:
            from pipeline.cost_aware import build_cost_aware

            return build_cost_aware(name, knobs, artifacts)
        return POLICIES[name](**knobs)
    except TypeError as exc:
        raise ValueError(f"bad knobs for policy {name!r}: {exc}") from exc
