"""Several candidates for a position at T > 0 (pipeline.acceptance.sampled_candidates):
recursive rejection sampling's acceptance against an exact enumeration of every draw (which
also shows its output follows p), the top-k rule's against its definition, and the chains
with sampled leaves in the tree ceiling's form."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pipeline.acceptance.sampled_candidates import (
    leaf_trees,
    sampled_acceptance,
    top_k_acceptance,
)
from pipeline.acceptance.tree_ceiling import depth_distribution, text_costs


def _enumerate_rrs(p: list[float], q: list[float], k: int) -> tuple[list[float], list[float]]:
    """Every draw of x_1 .. x_k ~ q and every accept/reject outcome: (P(accepted by round i),
    i = 1 .. k; the distribution of the emitted token)."""
    vocab = range(len(p))
    accepted_by = [0.0] * k
    out = [0.0] * len(p)
    for xs in itertools.product(vocab, repeat=k):
        weight = 1.0
        for x in xs:
            weight *= q[x]
        if weight == 0:
            continue
        r, reach = list(p), weight
        for i, x in enumerate(xs):
            take = min(1.0, r[x] / q[x])
            out[x] += reach * take
            for j in range(i, k):
                accepted_by[j] += reach * take
            reach *= 1.0 - take
            left = [max(a - b, 0.0) for a, b in zip(r, q, strict=True)]
            total = sum(left)
            if total > 0:
                r = [a / total for a in left]
        for y in vocab:  # every candidate rejected: the residual
            out[y] += reach * r[y]
    return accepted_by, out


@pytest.mark.parametrize("seed", range(6))
def test_recursive_rejection_sampling_matches_every_draw(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab, k = 4, 3
    p = torch.rand(2, vocab, generator=gen, dtype=torch.float64) ** 2
    q = torch.rand(2, vocab, generator=gen, dtype=torch.float64) ** 2
    if seed == 0:
        q[0, 1] = 0.0  # a token the draft never proposes
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    got = sampled_acceptance(p, q, k)
    for row in range(2):
        accepted_by, out = _enumerate_rrs(p[row].tolist(), q[row].tolist(), k)
        assert got[row].tolist() == pytest.approx(accepted_by, abs=1e-12)
        assert out == pytest.approx(p[row].tolist(), abs=1e-12)  # lossless for every k


def test_one_candidate_is_speculative_sampling_and_more_never_hurt():
    gen = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(5, 50, generator=gen), -1)
    q = torch.softmax(torch.randn(5, 50, generator=gen), -1)
    got = sampled_acceptance(p, q, 4)
    assert got[:, 0] == pytest.approx(torch.minimum(p, q).sum(-1).double())
    assert (got[:, 1:] >= got[:, :-1] - 1e-12).all()
    # q = p: the first candidate is always accepted.
    assert torch.allclose(sampled_acceptance(p, p, 2), torch.ones(5, 2, dtype=torch.float64))


def test_top_k_is_the_target_s_mass_on_the_draft_s_top_tokens():
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    q = torch.tensor([[0.5, 0.05, 0.15, 0.3]])  # top: 0, 3, 2
    assert top_k_acceptance(p, q, 3)[0].tolist() == pytest.approx([0.1, 0.5, 0.8])


def test_bad_shapes_and_k_are_refused():
    p = torch.full((1, 4), 0.25)
    with pytest.raises(ValueError, match="k must be in 1 .. vocab"):
        sampled_acceptance(p, p, 0)
    with pytest.raises(ValueError, match=r"\[rows, vocab\]"):
        top_k_acceptance(p[0], p[0], 1)


def test_leaf_trees_price_every_sibling_and_end_a_step_on_a_leaf_as_defined():
    acc = np.array([0.8, 0.5, 0.9])
    wide = np.array([0.9, 0.7, 0.95])  # A_3: one of three candidates accepted
    trees = leaf_trees(acc, wide, 3, 7)
    parents, p, depth = trees[0]
    # Position 0: its chain node and two leaves from the root; position 1 from node 0.
    assert parents == [-1, -1, -1, 0, 0, 0]  # a third position would take the pass past 7
    assert p == pytest.approx([0.8, 0.1, 0.0, 0.5, 0.2, 0.0])
    assert depth == [1, 1, 1, 2, 2, 2]
    dist = depth_distribution(parents, p, depth)
    # P(depth >= 1) = A(0); P(depth >= 2) = a_0 * A(1).
    assert dist[1:].sum() == pytest.approx(0.9)
    assert dist[2:].sum() == pytest.approx(0.8 * 0.7)
    assert len(trees[2][0]) == 3  # the text's end
    with pytest.raises(ValueError, match="width >= 2"):
        leaf_trees(acc, wide, 1, 7)


def test_leaves_worth_nothing_never_beat_the_chains():
    rng = np.random.default_rng(0)
    acc = rng.uniform(0.3, 0.95, 40)

    def step(forwards: int, m: int, t: int) -> float:
        return 1.0 + 0.2 * forwards + 0.1 * m

    same = text_costs(acc, leaf_trees(acc, acc, 2, 8), step, 8, [1, 2, 3])
    assert same["chain_or_tree"] == pytest.approx(same["chain"])
    richer = text_costs(acc, leaf_trees(acc, np.minimum(acc + 0.2, 1.0), 2, 8), step, 8, [1, 2])
    assert richer["chain_or_tree"] < richer["chain"]
