"""Our `throughput` policy and the two dynamic-length peers added beside it (`adaedl`,
`specdec`): their rules do what they say at the extremes, speculation switches itself off
when acceptance is hopeless (with periodic probes), the declared step work holds, and greedy
text equals plain greedy on the embedded models with the committed artifacts. (Losslessness
under sampling and knob validation: the registry-wide tests.)"""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline.acceptance.features import FEATURE_NAMES
from pipeline.acceptance.model import AcceptanceModel, ModeModel
from pipeline.data.references import greedy_continuation
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.adaedl import AdaEDLPolicy
from pipeline.decode.policies.artifacts import load_artifacts
from pipeline.decode.policies.limits import StepLimits
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.policies.specdec import SpecDecPolicy
from pipeline.decode.policies.throughput import ThroughputPolicy
from pipeline.decode.types import SamplingConfig
from pipeline.models.loading import load_pair

W = len(FEATURE_NAMES)


@pytest.fixture(scope="module")
def pair():
    return load_pair()


@pytest.fixture(scope="module")
def artifacts():
    return load_artifacts()


@pytest.fixture(scope="module")
def ids(pair):
    return pair.tokenizer("def fib(n):\n    if n < 2:\n", add_special_tokens=False)["input_ids"]


def _constant_acceptance(artifacts, bias: float) -> AcceptanceModel:
    """Every token accepted with probability sigmoid(bias), whatever the draft says."""
    weights = [bias] + [0.0] * (W - 1)
    p = 1 / (1 + pow(2.718281828, -bias))
    mode = ModeModel(weights, weights, p, [], [bias])
    return replace(artifacts.acceptance, modes={"greedy": mode, "sampled": mode})


def _run(pair, ids, policy, steps: int, temperature: float = 0.0):
    limits = StepLimits(
        *[getattr(policy.step_work(), f) for f in ("draft_forwards", "draft_tokens", "verified")]
    )
    session = SpeculativeEngine(pair, limits).start(
        ids, policy, SamplingConfig(temperature), seed=0
    )
    for _ in range(steps):
        session.step()
    return session


def test_hopeless_acceptance_switches_speculation_off_with_probes(pair, ids, artifacts):
    policy = ThroughputPolicy(
        artifacts.cost, _constant_acceptance(artifacts, -8.0), max_k=4, probe_every=3
    )
    session = _run(pair, ids, policy, 12)
    drafted = [s.drafted for s in session.steps]
    assert drafted == [0, 0, 0, 1] * 3  # plain steps; every 4th a probe of one token
    assert [s.draft_forwards for s in session.steps] == [0, 0, 0, 1] * 3
    # A probe catches up on the plain steps' tokens: within the declared bound (the run's
    # limits are the declared work, so exceeding it would have raised).
    assert max(s.draft_tokens for s in session.steps) <= policy.step_work().draft_tokens


def test_certain_acceptance_drafts_the_longest_chain(pair, ids, artifacts):
    policy = ThroughputPolicy(artifacts.cost, _constant_acceptance(artifacts, 12.0), max_k=5)
    session = _run(pair, ids, policy, 4)
    assert [s.drafted for s in session.steps] == [5] * 4
    assert [s.draft_forwards for s in session.steps] == [5] * 4  # no look past the chain


def test_the_rate_starts_at_the_stationary_optimum_and_follows_the_steps(pair, ids, artifacts):
    policy = make_policy("throughput", artifacts)
    session = _run(pair, ids, policy, 6)
    prior = policy.stationary_rate(artifacts.acceptance.mode(True).prior)
    plain = policy.cost.t_target(1, artifacts.acceptance.union(1), len(ids))
    assert prior < plain  # the committed pair's speculation pays at its training mean
    assert len(policy.decisions) == len(session.steps) == 6
    assert all(rate > 0 for _, _, rate in policy.decisions)
    assert policy.achieved_rate() != pytest.approx(prior)  # it moved with what happened


@pytest.mark.parametrize("name", ["throughput", "specdec", "adaedl"])
def test_greedy_text_equals_plain_greedy_on_the_embedded_models(name, pair, ids, artifacts):
    gen = SpeculativeEngine(pair).generate(ids, make_policy(name, artifacts), 24, stop_at_eos=False)
    assert gen.tokens == greedy_continuation(pair.target, ids, 24, eos_id=None)
    assert sum(s.accepted for s in gen.steps) > 0


def test_adaedl_thresholds_at_the_extremes(pair, ids):
    never = _run(pair, ids, AdaEDLPolicy(gamma=0.0, lam=0.5, max_k=4), 3)  # bound 1
    assert [s.drafted for s in never.steps] == [4, 4, 4]
    always = _run(pair, ids, AdaEDLPolicy(lam=1.0, max_k=4), 3)
    assert [s.drafted for s in always.steps] == [1, 1, 1]  # the bound is < 1 unless H = 0
    assert [s.draft_forwards for s in always.steps] == [2, 2, 2]  # the look at position 2
    assert AdaEDLPolicy(gamma=0.25).lower_bound(4.0) == pytest.approx(0.0)


def test_specdec_thresholds_at_the_extremes(pair, ids, artifacts):
    eager = _run(pair, ids, SpecDecPolicy(artifacts.acceptance, threshold=1.0, max_k=4), 3)
    assert [s.drafted for s in eager.steps] == [4, 4, 4]
    shy = _run(pair, ids, SpecDecPolicy(artifacts.acceptance, threshold=1e-9, max_k=4), 3)
    assert [s.drafted for s in shy.steps] == [1, 1, 1]
    assert [s.draft_forwards for s in shy.steps] == [1, 1, 1]  # the stop costs no forward


def test_policies_without_an_acceptance_model_say_how_to_get_one(artifacts):
    bare = replace(artifacts, acceptance=None)
    for name in ("throughput", "specdec"):
        with pytest.raises(ValueError, match="jobs.train_acceptance"):
            make_policy(name, bare)


def test_online_correction_moves_the_logit_towards_the_outcomes(pair, ids, artifacts):
    # The model says 4 in 5 whatever happens: the offset follows what did, stays within its
    # bound, and is off at adapt = 0.
    off = ThroughputPolicy(artifacts.cost, _constant_acceptance(artifacts, 1.4), max_k=3, adapt=0.0)
    _run(pair, ids, off, 6)
    assert off._offset == 0.0
    policy = ThroughputPolicy(
        artifacts.cost, _constant_acceptance(artifacts, 1.4), max_k=3, adapt=0.5
    )
    session = _run(pair, ids, policy, 6)
    judged = [(min(s.drafted, s.accepted + 1), s.accepted) for s in session.steps]
    hits = sum(a for _, a in judged)
    misses = sum(j - a for j, a in judged)
    assert hits + misses > 0 and abs(policy._offset) <= 3.0
    # Each judged token moves the logit by adapt * (outcome - predicted), predicted in (0, 1).
    if misses == 0:
        assert policy._offset > 0
    elif hits == 0:
        assert policy._offset < 0
    assert policy._offset != 0.0


def test_retiming_scales_each_side_by_measured_over_modelled(artifacts):
    from pipeline.decode.policies.prices import RETIME_LIMITS, PriceTables
    from pipeline.decode.types import StepRecord

    cost, union = artifacts.cost, artifacts.acceptance.union
    prices = PriceTables(cost, union, 4, retime=True)
    assert prices.scale("draft") == prices.scale("target") == 1.0
    t_d = cost.t_draft(3)
    t_t = cost.t_target(4, 7.0, 100)
    for _ in range(40):  # the draft runs twice as slow as modelled, the target as modelled
        record = StepRecord(3, 4, 2, 3, [7] * 4, 2 * t_d, t_t, draft_forwards=3)
        prices.step_price(record, 100)
    assert prices.scale("draft") == pytest.approx(2.0, rel=0.02)
    assert prices.scale("target") == pytest.approx(1.0)
    prices.refresh()
    assert prices.td[3] == pytest.approx(prices.scale("draft") * cost.t_draft(3))
    plain = StepRecord(0, 1, 0, 1, [4] * 4, 0.01, 100 * t_t, draft_forwards=0)
    for _ in range(40):  # plain steps leave the draft's scale alone; a scale is bounded
        prices.step_price(plain, 100)
    assert prices.scale("draft") == pytest.approx(2.0, rel=0.02)
    assert prices.scale("target") == RETIME_LIMITS[1]
    off = PriceTables(cost, union, 4, retime=False)
    off.step_price(record, 100)
    assert off.scale("draft") == 1.0 and off.step_price(record, 100) == pytest.approx(t_d + t_t)
