"""The oracle-driven marginal rule stops where dE[Cost]/dE[a] first exceeds lambda, decides
before it samples, and the engine stays lossless with it (sampling: exactly, in
tests/test_lossless_sampling.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.cost.model import CostModel
from pipeline.data.references import greedy_continuation
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.marginal import MarginalPolicy
from pipeline.decode.types import SamplingConfig
from pipeline.predictor.model import TokenExpertPredictor
from tests.test_engine import perturbed_pair


class ScriptedDrafter:
    """Stands in for the draft model: fixed next-token distributions along one chain."""

    sampling = SamplingConfig()
    root_context = None
    hidden = torch.zeros(1, 4)  # the lookup-table predictor ignores contexts

    def __init__(self, rows: list[list[float]]):
        self.rows = [torch.tensor(r) for r in rows]
        self.calls = 0

    def begin(self, committed):
        self.calls = 0
        return self.rows[0]

    def extend(self, token):
        self.calls += 1
        return self.rows[self.calls]

    draws: list[int] = []  # what sampling draws, in order (greedy: the argmax)

    def sample(self, probs):
        return self.draws.pop(0) if not self.sampling.greedy else int(probs.argmax())


def _setup():
    # One MoE layer, top-2. Root token 9 uses {0, 1}; token 0 reuses them, token 1 adds {2, 3},
    # token 2 uses {0, 2} (already in the buffer by then).
    predictor = TokenExpertPredictor(
        {
            9: np.array([[0, 1]]),
            0: np.array([[0, 1]]),
            1: np.array([[2, 3]]),
            2: np.array([[0, 2]]),
        },
        np.array([[0, 1]]),
    )
    cost = CostModel({m: 5.0 for m in range(1, 6)}, {m: 1.0 for m in range(1, 6)}, 0.0, 0.5, 0.0)
    drafter = ScriptedDrafter(
        [[0.9, 0.05, 0.03, 0.02], [0.1, 0.8, 0.05, 0.05], [0.2, 0.2, 0.5, 0.1]]
    )
    return predictor, cost, drafter


def test_marginal_rule_stops_exactly_where_the_ratio_exceeds_lambda():
    predictor, cost, drafter = _setup()
    # Step ratios by hand: token 0: dA 0.9, dCost 0.5 (one more draft forward, to look at the
    # next position) + 0 experts -> 0.556; token 1: dA 0.72, dCost 0.5 + 2 new experts x 1.0
    # -> 3.47; token 2 (the last of max_k: no look after it, no new expert): dCost 0 -> 0.
    policy = MarginalPolicy(cost, lam=3.0, predictor=predictor, max_k=3)
    cands = policy.propose(drafter, [7, 9])
    assert cands.tokens == [0]
    assert [round(s.ratio, 3) for s in policy.trace] == [0.556, 3.472]
    policy = MarginalPolicy(cost, lam=4.0, predictor=predictor, max_k=3)
    cands = policy.propose(drafter, [7, 9])
    assert cands.tokens == [0, 1, 2]
    assert [round(s.ratio, 3) for s in policy.trace] == [0.556, 3.472, 0.0]
    assert [s.new_experts for s in policy.trace] == [0.0, 2.0, 0.0]
    policy = MarginalPolicy(cost, lam=0.5, predictor=predictor, max_k=3)
    assert policy.propose(drafter, [7, 9]).tokens == []  # a plain step
    with pytest.raises(ValueError, match="lambda must be > 0"):
        MarginalPolicy(cost, lam=0.0, predictor=predictor)


def test_marginal_policy_is_lossless_under_greedy_decoding_with_its_exit_firing():
    """A lambda inside the range of the rule's ratios on this pair: most steps stop early,
    some take a plain step (k = 0); with calibrate=True the learned P(accept | q) drives the
    rule through the engine. Both decode exactly the plain greedy continuation."""
    pair = perturbed_pair("qwen3_moe", noise=0.3, vocab=16, sharpen=6.0)
    rng = np.random.default_rng(0)
    samples = [(int(t), np.sort(rng.choice(8, (2, 2), replace=True), axis=1)) for t in range(16)]
    predictor = TokenExpertPredictor.fit(samples, num_experts=8, top_k=2)
    cost = CostModel(
        {m: 4 + 0.2 * m for m in range(1, 10)}, {m: 0.3 for m in range(1, 10)}, 0.001, 0.4, 0.1
    )
    engine = SpeculativeEngine(pair)
    for calibrate in (False, True):
        policy = MarginalPolicy(cost, lam=5.0, predictor=predictor, max_k=3, calibrate=calibrate)
        sizes = []
        for prompt in ([5, 9, 2], [10, 3, 7, 7], [1, 2, 3, 4, 5, 6]):
            gen = engine.generate(prompt, policy, max_new_tokens=16, stop_at_eos=False)
            assert gen.tokens == greedy_continuation(pair.target, prompt, 16, eos_id=None)
            sizes += [s.drafted for s in gen.steps]
        assert 0 in sizes and max(sizes) >= 2, (calibrate, sizes)  # plain steps and chains
        early = sum(k < 3 for k in sizes)
        assert early >= len(sizes) / 2, (calibrate, sizes)  # the exit fired on most steps
        if calibrate:  # it learned from verified drafts, and what it learned is in use
            assert policy.acceptance.trials.sum() > 10
            assert policy.accept_probability(0.15) != pytest.approx(0.15)


def test_sampling_decides_before_it_draws_and_carries_the_drawn_token():
    """At T > 0 the stop test prices the most likely token (here 0, q 0.9); the drawn token
    (here 1, q 0.05) is appended whatever it is, and P_j and the buffer grow with it."""
    predictor, cost, drafter = _setup()
    drafter.sampling = SamplingConfig(temperature=1.0)
    drafter.draws = [1, 1, 2]
    policy = MarginalPolicy(cost, lam=4.0, predictor=predictor, max_k=3)
    cands = policy.propose(drafter, [7, 9])
    assert cands.tokens == [1]  # kept although its own ratio would be (0.5 + 2) / 0.05 = 50
    assert cands.q[0] is not None and cands.confidences == [pytest.approx(0.05)]
    # Step 0 priced token 0 (0.9, no new experts); step 1 prices token 1 (0.8) after the drawn
    # 1 put {2, 3} in the buffer (no new experts) with P_1 = 0.05: 0.5 / 0.04 = 12.5 > 4.
    assert [s.token for s in policy.trace] == [0, 1]
    assert [s.new_experts for s in policy.trace] == [0.0, 0.0]
    assert [round(s.ratio, 3) for s in policy.trace] == [0.556, 12.5]


def test_predictor_fit_and_overlap():
    samples = [
        (1, np.array([[0, 1], [2, 3]])),
        (1, np.array([[0, 2], [2, 3]])),
        (2, np.array([[4, 5], [6, 7]])),
    ]
    predictor = TokenExpertPredictor.fit(samples, num_experts=8, top_k=2)
    assert predictor.predict(1)[1].tolist() == [2, 3]
    assert predictor.predict(1)[0].tolist()[0] == 0
    assert predictor.overlap_accuracy([(2, np.array([[4, 5], [6, 7]]))]) == 1.0
    assert predictor.predict(99).shape == (2, 2)  # unseen token: the layer's common experts


def test_acceptance_calibrator_starts_at_q_and_learns_from_verified_drafts():
    from pipeline.decode.policies.marginal import AcceptanceCalibrator
    from pipeline.decode.types import Candidates, StepOutcome

    cal = AcceptanceCalibrator(bins=10, prior=4.0)
    assert cal(0.05) == pytest.approx(0.05) and cal(0.93) == pytest.approx(0.93)
    for _ in range(40):
        cal.observe(0.05, True)  # low confidence, yet accepted (greedy argmax matches)
    assert cal(0.05) > 0.9
    # A bin with no evidence borrows the pooled rate instead of its raw confidence.
    assert cal(0.45) > 0.8

    predictor, cost, drafter = _setup()
    policy = MarginalPolicy(cost, lam=4.0, predictor=predictor, max_k=3, calibrate=True)
    cands = Candidates([0, 1, 2], [-1, 0, 1], [None] * 3, [0.9, 0.8, 0.5])
    record = None
    policy.update(StepOutcome(cands, 1, record))  # token 0 accepted, token 1 rejected
    assert policy.acceptance.trials.sum() == 2 and policy.acceptance.hits.sum() == 1
    assert policy.acceptance.trials[9] == 1 and policy.acceptance.hits[9] == 1
    assert policy.acceptance.trials[8] == 1 and policy.acceptance.hits[8] == 0
    assert MarginalPolicy(cost, lam=4.0, predictor=predictor).accept_probability(0.3) == 0.3
