"""Cascade's schedule: each K of the ladder tested for test_steps steps, then set_steps at the
K of best utility (the AR price of its tokens over its steps' price), or no draft at all when
no K pays. Driven with synthetic step outcomes and cost models whose answer is known; its
losslessness, knobs and step work are covered with every registered policy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeline.cost.model import CostModel
from pipeline.decode.policies.cascade import CascadePolicy, ladder
from pipeline.decode.types import StepOutcome, StepRecord


def _cost(draft_ms: float) -> CostModel:
    ms = range(1, 10)
    return CostModel(
        beta0={m: 10.0 for m in ms},
        alpha={m: 0.0 for m in ms},
        c=0.0,
        draft_a=draft_ms,
        draft_b=0.0,
    )


class _StubDrafter:
    """What propose() reaches through draft_chain: a greedy draft over a 2-token vocabulary,
    and the pair's MoE spec (top_k prices a plain step)."""

    pair = SimpleNamespace(spec=SimpleNamespace(top_k=2))
    sampling = SimpleNamespace(greedy=True)

    def begin(self, committed: list[int]) -> torch.Tensor:
        return torch.tensor([0.9, 0.1])

    def extend(self, token: int) -> torch.Tensor:
        return torch.tensor([0.9, 0.1])

    def sample(self, probs: torch.Tensor) -> int:
        return int(probs.argmax())


def _run(policy: CascadePolicy, steps: int, accepted_of) -> list[int]:
    """K of each step, proposed and updated as the engine does (each proposal made twice, as a
    session timing its steps twice does); accepted_of(k) of a chain of k accepted."""
    ks, drafter = [], _StubDrafter()
    for _ in range(steps):
        cands = policy.propose(drafter, [1] * 100)
        assert len(policy.propose(drafter, [1] * 100)) == len(cands)  # no state advanced
        k = len(cands)
        ks.append(k)
        a = accepted_of(k)
        record = StepRecord(k, k + 1, a, a + 1, [2 + k] * 2, 0.0, 0.0, k)
        policy.update(StepOutcome(cands, a, record))
    return ks


def test_ladder_is_powers_of_two_and_max_k():
    assert ladder(8) == [1, 2, 4, 8] and ladder(6) == [1, 2, 4, 6] and ladder(1) == [1]


def test_speculation_switches_off_when_no_k_pays():
    # A draft forward costs as much as a verification and nothing is ever accepted.
    policy = CascadePolicy(_cost(10.0), max_k=4, test_steps=2, set_steps=5)
    ks = _run(policy, 6 + 5 + 6, lambda k: 0)
    assert ks[:6] == [1, 1, 2, 2, 4, 4]  # the test phase, up the ladder
    assert ks[6:11] == [0] * 5  # the set phase: plain steps
    assert policy.choices[0][0] == 0 and policy.choices[0][1] < 1
    assert ks[11:] == [1, 1, 2, 2, 4, 4]  # tested again: the text may change


def test_the_k_of_best_utility_is_set():
    # Cheap drafts, every token accepted up to 2: K = 2 yields 3 tokens per 10 + 2 ms.
    policy = CascadePolicy(_cost(1.0), max_k=4, test_steps=1, set_steps=3)
    ks = _run(policy, 3 + 3, lambda k: min(k, 2))
    assert ks[3:] == [2, 2, 2]
    k, utility = policy.choices[0]
    assert k == 2 and utility == pytest.approx(3 * 10.0 / (10.0 + 2.0))


def test_each_generation_starts_afresh_and_max_k_defaults_to_the_cost_model():
    policy = CascadePolicy(_cost(1.0), test_steps=1, set_steps=2)
    assert policy.max_k == 8  # DEFAULT_MAX_K within the model's m = 1..9
    assert _run(policy, 5, lambda k: k) == [1, 2, 4, 8, 8]  # set at the longest, all accepted
    policy.reset()
    assert policy.next_k == 1
    with pytest.raises(ValueError, match="max_k must lie in"):
        CascadePolicy(_cost(1.0), max_k=9)
