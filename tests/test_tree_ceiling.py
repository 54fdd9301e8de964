"""The tree ceiling (pipeline/acceptance/tree_ceiling.py, pipeline/extract/sampled_trees.py):
the accepted depth of a tree under the engine's multi-candidate rule against exact enumeration
of that rule's draws, the expected-cost solve against every policy, chain-shaped trees at T = 0
against the chain ceiling, and the forest's node probabilities against plain forwards."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pipeline.acceptance import ceiling
from pipeline.acceptance.tree_ceiling import (
    chain_table,
    depth_distribution,
    expected_cost,
    text_costs,
    tree_ceiling,
)
from pipeline.data.references import ReferenceSequence
from pipeline.decode.acceptance import accept
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.simple import AutoregressivePolicy
from pipeline.decode.types import Candidates, SamplingConfig
from pipeline.extract.draft_trees import TreeRule
from pipeline.extract.sampled_trees import sampled_trees
from pipeline.extract.teacher_forced import teacher_forced
from pipeline.models.loading import load_pair


class _Branch(Exception):
    def __init__(self, outcomes: list[tuple[object, float]]) -> None:
        self.outcomes = outcomes


class _ScriptedRng:
    """Replays ``script``; at the first draw it does not cover, raises every outcome."""

    def __init__(self, script: list[object]) -> None:
        self.script, self.used = script, 0

    def _next(self, outcomes: list[tuple[object, float]]) -> object:
        if self.used < len(self.script):
            self.used += 1
            return self.script[self.used - 1]
        raise _Branch(outcomes)

    def bernoulli(self, p: float) -> bool:
        return bool(self._next([(True, p), (False, 1 - p)]))

    def categorical(self, probs: torch.Tensor) -> int:
        return int(
            self._next([(x, float(probs[x])) for x in torch.nonzero(probs).view(-1).tolist()])
        )


def _exact_accepted(cands: Candidates, probs: torch.Tensor, sampling: SamplingConfig) -> np.ndarray:
    """P(len(accepted) = a) of accept(), by enumerating every draw."""
    dist = np.zeros(len(cands) + 1)
    stack: list[tuple[list[object], float]] = [([], 1.0)]
    while stack:
        script, weight = stack.pop()
        try:
            _, accepted = accept(cands, probs, sampling, _ScriptedRng(script))
        except _Branch as branch:
            stack += [([*script, x], weight * w) for x, w in branch.outcomes if w > 0]
            continue
        dist[len(accepted)] += weight
    return dist


TREES = [
    [-1],
    [-1, -1, -1],
    [-1, 0, 1, 2],
    [-1, -1, 0, 0, 1, 2],
    [-1, 0, 0, 1, 1, 3, -1],
]


@pytest.mark.parametrize("parents", TREES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_depth_distribution_is_the_engines_multi_candidate_rule(parents, temperature):
    """Random target distributions over 6 tokens at the root and after every node, siblings
    holding distinct tokens: the formula's P(depth) equals accept()'s, enumerated exactly."""
    gen = torch.Generator().manual_seed(len(parents))
    vocab = 6
    probs = torch.distributions.Dirichlet(torch.full((vocab,), 0.7)).sample((len(parents) + 1,))
    tokens: list[int] = []
    for j, parent in enumerate(parents):
        taken = {tokens[s] for s in range(j) if parents[s] == parent}
        free = [x for x in torch.randperm(vocab, generator=gen).tolist() if x not in taken]
        # At T = 0 half the trees put the target's argmax among the children.
        tokens.append(
            int(probs[parent + 1].argmax()) if temperature == 0 and not taken else free[0]
        )
    sampling = SamplingConfig(temperature)
    cands = Candidates(tokens, list(parents), [None] * len(parents), [0.0] * len(parents))
    if temperature == 0:
        p = [
            float(int(probs[par + 1].argmax()) == tok)
            for par, tok in zip(parents, tokens, strict=True)
        ]
    else:
        p = [float(probs[par + 1, tok]) for par, tok in zip(parents, tokens, strict=True)]
    depth = []
    for par in parents:
        depth.append(1 if par < 0 else depth[par] + 1)
    got = depth_distribution(parents, p, depth)
    want = _exact_accepted(cands, probs, sampling)
    assert got == pytest.approx(want, abs=1e-6)
    assert got.sum() == pytest.approx(1.0)


def _forward_value(probs: np.ndarray, cost: np.ndarray, policy: tuple[int, ...]) -> float:
    """A policy's expected cost by pushing the state distribution forward (independent of the
    backward solve)."""
    n = probs.shape[0]
    mass, total = np.zeros(n + 1), 0.0
    mass[0] = 1.0
    for t in range(n):
        act = policy[t]
        total += mass[t] * cost[t, act]
        for a, pa in enumerate(probs[t, act]):
            mass[min(t + a + 1, n)] += mass[t] * pa
    return total


def test_the_solve_is_the_best_policy_by_brute_force():
    rng = np.random.default_rng(3)
    n, actions, a_max = 5, 3, 3
    probs = rng.dirichlet(np.ones(a_max), size=(n, actions))
    probs[1, 2] = 0.0  # unavailable there
    probs[3, 0] = 0.0
    cost = rng.uniform(1.0, 5.0, size=(n, actions))
    best = np.inf
    for policy in itertools.product(range(actions), repeat=n):
        if any(probs[t, act].sum() < 0.5 for t, act in enumerate(policy)):
            continue
        value = _forward_value(probs, cost, policy)
        assert expected_cost(probs, cost, np.array(policy)) == pytest.approx(value)
        best = min(best, value)
    assert expected_cost(probs, cost) == pytest.approx(best)


def test_chain_table_matches_the_chain_ceiling():
    acc = np.random.default_rng(1).uniform(0.2, 0.95, 17)

    def step(k: int, t: int) -> float:
        return 1.3 * k + 9.0 + 0.7 * (k + 1) + 0.01 * t

    costs = np.array([[step(k, t) for k in range(5)] for t in range(17)])
    assert expected_cost(chain_table(acc, 4), costs) == pytest.approx(
        ceiling.expected_cost(acc, step, 4)
    )


@pytest.fixture(scope="module")
def pair():
    return load_pair()


@pytest.fixture(scope="module")
def text(pair):
    ids = pair.tokenizer("def fib(n):\n    if n < 2:\n", add_special_tokens=False)["input_ids"]
    gen = SpeculativeEngine(pair).generate(
        ids, AutoregressivePolicy(), 20, SamplingConfig(1.0), seed=5, stop_at_eos=False
    )
    return ids, gen.tokens


def test_chain_shaped_trees_at_t0_are_the_chain_ceiling(pair, text):
    """Branch 1: each state's tree is the draft's greedy chain and at T = 0 (on the target's
    greedy text) its accepted depth is the chain's, so every ceiling is the chain ceiling."""
    ids, _ = text
    tokens = SpeculativeEngine(pair).generate(ids, AutoregressivePolicy(), 20).tokens
    trees = sampled_trees(pair, ids, tokens, SamplingConfig(0.0), TreeRule("eagle2", 1), 4)
    forced = teacher_forced(pair, ReferenceSequence("t", "", "greedy", tuple(ids), tuple(tokens)))
    acc = (forced.draft_logits.argmax(-1) == torch.tensor(tokens)).float().numpy()

    def step(forwards: int, m: int, t: int) -> float:
        return 2.0 * forwards + 8.0 + 1.5 * m + 0.02 * t

    costs = text_costs(acc, [(s.parents, s.p, s.depth) for s in trees], step, 4, [1, 2, 3])
    assert costs["tree"] == pytest.approx(costs["chain"])
    assert costs["chain_or_tree"] == pytest.approx(costs["chain"])
    result = tree_ceiling([costs])
    assert result.best_fixed == min(v for k, v in costs.items() if k.startswith("fixed"))
    assert result.over_best_fixed()["chain"] >= 1.0


def test_node_probabilities_are_the_targets_after_each_path(pair, text):
    """At T = 1 (branch 2, 5 nodes): a node's probability from the packed forest equals the
    target's plain forward over prompt, text so far and the node's ancestors."""
    ids, tokens = text
    sampling = SamplingConfig(1.0)
    trees = sampled_trees(pair, ids, tokens, sampling, TreeRule("eagle2", 2), 5)
    assert len(trees) == len(tokens)
    for i in (0, 7, len(tokens) - 1):
        tree = trees[i]
        assert tree.depth[0] == 1 and len(tree.p) == 5
        for j in range(len(tree.parents)):
            path, node = [], j
            while node >= 0:
                path.insert(0, tree.tokens[node])
                node = tree.parents[node]
            assert tree.depth[j] == len(path)
            ids_j = torch.tensor([ids + tokens[:i] + path[:-1]])
            with torch.no_grad():
                logits = pair.target(ids_j).logits[0, -1]
            want = float(sampling.probs(logits)[path[-1]])
            assert tree.p[j] == pytest.approx(want, rel=1e-4, abs=1e-6), (i, j)
