"""EcoSpec's selection on the paper's Figure 3 example, the buffer update, the budget contract
(gamma verified positions with the root, a prefix-closed selection), and losslessness."""

from __future__ import annotations

import numpy as np

from pipeline.data.references import greedy_continuation
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.ecospec import EcoSpecGlobalPolicy, EcoSpecPolicy, select_nodes
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.policies.tree import TreePolicy
from pipeline.decode.policies.tree_builder import DraftTree, select_prefix_closed
from pipeline.predictor.model import TokenExpertPredictor
from tests.test_engine import perturbed_pair


def test_figure_3_selects_t0_then_t2():
    # The paper's "gamma = 2 draft tokens" is gamma = 3 here (the root is verified too).
    # t0 (a root child) covers {E1..E4}; t1 and t2 extend it. t1 has the higher path
    # probability (0.53) but adds three new experts; t2 (0.40) adds two: 0.53/3 = 0.177 <
    # 0.40/2 = 0.20, so the buffer-aware selection takes {t0, t2}.
    path_p = [0.9, 0.53, 0.40]
    footprints = [[{1, 2, 3, 4}], [{1, 2, 3, 4, 5, 6, 7}], [{1, 2, 3, 4, 5, 8}]]
    parents = [-1, 0, 0]
    assert select_nodes(path_p, footprints, parents, gamma=3, buffer=[set()]) == [0, 2]
    # Without the buffer (the global-cost ablation) t1 wins: 0.53/7 = 0.076 > 0.40/6 = 0.067.
    assert select_nodes(path_p, footprints, parents, gamma=3, buffer=[set()], use_buffer=False) == [
        0,
        1,
    ]


def test_buffer_update_decides_the_later_picks():
    # a and b are root children, a slightly more probable; c is a's child and reuses a's
    # experts. Once a is selected the buffer makes c free (score P / eps), so it is picked
    # before the more probable b; without the buffer b comes second and c third.
    path_p = [0.5, 0.45, 0.3]
    footprints = [[{0, 1}], [{2, 3}], [{0, 1}]]
    parents = [-1, -1, 0]
    assert select_nodes(path_p, footprints, parents, gamma=4, buffer=[set()]) == [0, 2, 1]
    assert select_nodes(path_p, footprints, parents, gamma=4, buffer=[set()], use_buffer=False) == [
        0,
        1,
        2,
    ]
    # The third pick depends on the second: with gamma = 3 only [a, c] is verified.
    assert select_nodes(path_p, footprints, parents, gamma=3, buffer=[set()]) == [0, 2]
    # An initial buffer holding a's experts makes a and c free from the start.
    assert select_nodes(path_p, footprints, parents, gamma=3, buffer=[{0, 1}]) == [0, 2]


def test_a_child_that_outscores_its_parent_waits_for_it():
    # c (a child of b) scores above everything (scores need not shrink along a path for
    # this function); it is eligible only once b is in, so the budget still holds.
    path_p = [0.5, 0.2, 0.9, 0.5]
    footprints = [[{0}], [{1}], [{1}], [{0}]]
    parents = [-1, -1, 1, 0]
    assert select_nodes(path_p, footprints, parents, gamma=2, buffer=[set()]) == [0]
    assert select_nodes(path_p, footprints, parents, gamma=3, buffer=[set()]) == [0, 3]
    assert select_nodes(path_p, footprints, parents, gamma=4, buffer=[set()]) == [0, 3, 1]
    assert select_nodes(path_p, footprints, parents, gamma=5, buffer=[set()]) == [0, 3, 1, 2]


def _random_tree(rng: np.random.Generator) -> DraftTree:
    n = int(rng.integers(1, 16))
    parents = [-1] + [int(rng.integers(-1, j)) for j in range(1, n)]
    # Arbitrary scores, ties included: a child may outscore its parent here.
    path_p = [float(rng.choice([0.1, 0.3, 0.5, 0.5, 0.9])) for _ in range(n)]
    return DraftTree(list(range(n)), parents, path_p, path_p)


def test_the_verified_set_never_exceeds_gamma_on_random_trees():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tree = _random_tree(rng)
        gamma = int(rng.integers(2, 10))
        footprints = [[set(rng.choice(8, 2).tolist())] for _ in tree.tokens]
        for use_buffer in (True, False):
            buffer = [set(rng.choice(8, 2).tolist())]
            chosen = select_nodes(
                tree.path_p, footprints, tree.parents, gamma, buffer, use_buffer=use_buffer
            )
            by_p = select_prefix_closed(tree.parents, gamma, tree.path_p.__getitem__)  # `tree`
            for picks in (chosen, by_p):
                assert len(picks) == min(gamma - 1, len(tree.tokens))
                done: set[int] = set()
                for j in picks:  # prefix-closed in selection order
                    assert tree.parents[j] < 0 or tree.parents[j] in done
                    done.add(j)
                cands = tree.subset(picks)
                assert len(cands) + 1 <= gamma  # m = draft nodes + the root
                assert len(cands) == len(picks)  # no ancestor was added behind the budget


def test_tree_and_ecospec_verify_gamma_positions_with_the_root():
    pair = perturbed_pair("mixtral", noise=0.3)
    rng = np.random.default_rng(1)
    samples = [(t, np.sort(rng.choice(8, (3, 2), replace=True), axis=1)) for t in range(256)]
    predictor = TokenExpertPredictor.fit(samples, num_experts=8, top_k=2)
    engine = SpeculativeEngine(pair)
    for gamma in (2, 4, 6):
        for policy in (
            TreePolicy(3, 2, gamma),
            EcoSpecPolicy(predictor, 3, 2, gamma),
            EcoSpecGlobalPolicy(predictor, 3, 2, gamma),
        ):
            gen = engine.generate([5, 9, 2], policy, max_new_tokens=6, stop_at_eos=False)
            assert {s.verified for s in gen.steps} == {gamma}, (policy.name, gamma)
            assert {s.drafted for s in gen.steps} == {gamma - 1}, (policy.name, gamma)
    default = make_policy("tree")  # depth 4, branch 2 grow 14 nodes; 8 kept, as before
    gen = engine.generate([5, 9, 2], default, max_new_tokens=4, stop_at_eos=False)
    assert {s.verified for s in gen.steps} == {default.gamma} == {9}


def test_ecospec_policies_are_lossless_under_greedy_decoding():
    pair = perturbed_pair("mixtral", noise=0.3)
    rng = np.random.default_rng(1)
    samples = [(t, np.sort(rng.choice(8, (3, 2), replace=True), axis=1)) for t in range(256)]
    predictor = TokenExpertPredictor.fit(samples, num_experts=8, top_k=2)
    engine = SpeculativeEngine(pair)
    for policy in (EcoSpecPolicy(predictor), EcoSpecGlobalPolicy(predictor)):
        accepted = 0
        for prompt in ([5, 9, 2], [100, 3, 7, 7], [1, 2, 3, 4, 5, 6], [42, 42]):
            gen = engine.generate(prompt, policy, max_new_tokens=16, stop_at_eos=False)
            assert gen.tokens == greedy_continuation(pair.target, prompt, 16, eos_id=None)
            accepted += sum(s.accepted for s in gen.steps)
        assert accepted > 0, policy.name
