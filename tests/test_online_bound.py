"""The oracle's bound on generated text, and the oracle-replay check: decoding greedily with
the oracle's k*(i) visits exactly the oracle's states, accepts exactly its a, and the oracle's
dp[0] is the modelled cost of that path."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.bench.online_bound import replay, sequence_bounds
from pipeline.cost.model import CostModel
from pipeline.data.references import greedy_continuation
from tests.test_engine import perturbed_pair

COST = CostModel({m: 5.0 + 0.3 * m for m in range(1, 10)}, {m: 0.4 for m in range(1, 10)},
                 0.001, 0.5, 0.1)  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_replaying_k_star_reproduces_the_oracle_path_and_cost(family):
    pair = perturbed_pair(family, noise=0.3)
    prompts = [[5, 9, 2], [100, 3, 7, 7, 1]]
    outputs = [greedy_continuation(pair.target, p, 24, eos_id=None) for p in prompts]
    bound = sequence_bounds(pair, prompts, outputs, COST, lmax=6, acceptance="greedy")
    assert bound.speedup > 0 and bound.lmax == 6
    steps_with_drafts = 0
    for j, seq_bound in enumerate(bound.sequences):
        rep = replay(pair, seq_bound, prompts[j], COST)
        assert rep.output == outputs[j]
        assert rep.accepted == rep.oracle_accepted
        # The visited states are exactly those the oracle's visitation reaches (probability 1).
        visit = seq_bound.solution.visit[:-1]
        assert rep.states == [i for i in range(len(visit)) if visit[i] > 0.5]
        assert np.isclose(sum(rep.modelled_ms), seq_bound.dp0_ms)
        steps_with_drafts += sum(a > 0 for a in rep.accepted)
        assert len(rep.measured_ms) == len(rep.states) == len(rep.modelled_online_u_ms)
        assert all(ms > 0 for ms in rep.modelled_online_u_ms)
    assert steps_with_drafts > 0


def test_surrogate_bound_and_bad_acceptance():
    pair = perturbed_pair("qwen3_moe", noise=0.3)
    prompts = [[5, 9, 2]]
    outputs = [greedy_continuation(pair.target, prompts[0], 16, eos_id=None)]
    bound = sequence_bounds(pair, prompts, outputs, COST, lmax=4, acceptance="surrogate")
    greedy = sequence_bounds(pair, prompts, outputs, COST, lmax=4, acceptance="greedy")
    assert bound.ar_ms == pytest.approx(greedy.ar_ms)
    assert bound.speedup > 0
    with pytest.raises(ValueError, match="acceptance must be"):
        sequence_bounds(pair, prompts, outputs, COST, lmax=4, acceptance="exact")
