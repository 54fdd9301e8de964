"""Our `throughput` policy and the two dynamic-length peers added beside it (`adaedl`,
`specdec`): their rules do what they say at the extremes, speculation switches itself off
when acceptance is hopeless (with periodic probes), the declared step work holds, the rate
and the online logit correction are what their definitions give for the steps taken.
(Greedy text equal to plain greedy, on the embedded models with the committed artifacts
among others, losslessness under sampling and knob validation: the registry-wide tests.)"""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline.acceptance.features import FEATURE_NAMES
from pipeline.acceptance.model import AcceptanceModel, ModeModel
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.adaedl import AdaEDLPolicy
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.policies.specdec import SpecDecPolicy
from pipeline.decode.policies.throughput import ThroughputPolicy
from pipeline.decode.step_limits import StepLimits
from pipeline.decode.types import SamplingConfig

W = len(FEATURE_NAMES)


def _constant_acceptance(embedded_artifacts, bias: float) -> AcceptanceModel:
    """Every token accepted with probability sigmoid(bias), whatever the draft says."""
    weights = [bias] + [0.0] * (W - 1)
    p = 1 / (1 + pow(2.718281828, -bias))
    mode = ModeModel(weights, weights, p, [], [bias])
    return replace(embedded_artifacts.acceptance, modes={"greedy": mode, "sampled": mode})


def _run(embedded_pair, fib_ids, policy, steps: int, temperature: float = 0.0):
    limits = StepLimits(
        *[getattr(policy.step_work(), f) for f in ("draft_forwards", "draft_tokens", "verified")]
    )
    session = SpeculativeEngine(embedded_pair, limits).start(
        fib_ids, policy, SamplingConfig(temperature), seed=0
    )
    for _ in range(steps):
        session.step()
    return session


def test_hopeless_acceptance_switches_speculation_off_with_probes(
    embedded_pair, fib_ids, embedded_artifacts
):
    policy = ThroughputPolicy(
        embedded_artifacts.cost,
        _constant_acceptance(embedded_artifacts, -8.0),
        max_k=4,
        probe_every=3,
    )
    session = _run(embedded_pair, fib_ids, policy, 12)
    drafted = [s.drafted for s in session.steps]
    assert drafted == [0, 0, 0, 1] * 3  # plain steps; every 4th a probe of one token
    assert [s.draft_forwards for s in session.steps] == [0, 0, 0, 1] * 3
    # A probe catches up on the plain steps' tokens: within the declared bound (the run's
    # limits are the declared work, so exceeding it would have raised).
    assert max(s.draft_tokens for s in session.steps) <= policy.step_work().draft_tokens


def test_certain_acceptance_drafts_the_longest_chain(embedded_pair, fib_ids, embedded_artifacts):
    policy = ThroughputPolicy(
        embedded_artifacts.cost, _constant_acceptance(embedded_artifacts, 12.0), max_k=5
    )
    session = _run(embedded_pair, fib_ids, policy, 4)
    assert [s.drafted for s in session.steps] == [5] * 4
    assert [s.draft_forwards for s in session.steps] == [5] * 4  # no look past the chain


def _stationary_rate(cost, union, max_k: int, a: float, ctx: int) -> float:
    """The module's definition, from the cost model alone: the least modelled ms per token of a
    chain of n = 0 .. max_k tokens, each accepted with probability a, at context ``ctx``."""
    best, tokens = cost.t_target(1, union(1), ctx), 1.0
    for n in range(1, max_k + 1):
        tokens += a**n
        best = min(best, (cost.t_draft(n) + cost.t_target(n + 1, union(n + 1), ctx)) / tokens)
    return best


def test_the_rate_starts_at_the_stationary_optimum_and_follows_the_steps(
    embedded_pair, fib_ids, embedded_artifacts
):
    """The rate after each step is the ratio of the decayed sums of the steps' modelled prices
    (the cost model at each step's context, with the experts it verified) and of their new
    tokens, both starting from PRIOR_TOKENS tokens at the stationary optimum of the training
    mean: recomputed here from the step records, it must match every decision."""
    from pipeline.decode.policies.throughput import PRIOR_TOKENS, RATE_DECAY

    policy = make_policy("throughput", embedded_artifacts)
    session = _run(embedded_pair, fib_ids, policy, 6)
    cost, union = policy.cost, embedded_artifacts.acceptance.union
    prior = _stationary_rate(
        cost, union, policy.max_k, policy.acceptance.mode(True).prior, len(fib_ids)
    )
    plain = cost.t_target(1, union(1), len(fib_ids))
    assert prior < plain  # the committed embedded_pair's speculation pays at its training mean
    assert len(policy.decisions) == len(session.steps) == 6
    prices, tokens, ctx = PRIOR_TOKENS * prior, PRIOR_TOKENS, len(fib_ids)
    for step, (kind, drafted, rate) in zip(session.steps, policy.decisions, strict=True):
        price = cost.t_draft(step.draft_forwards) + cost.t_target(step.verified, step.u_bar, ctx)
        prices, tokens = RATE_DECAY * prices + price, RATE_DECAY * tokens + step.new_tokens
        assert (kind, drafted) == ("draft" if step.drafted else "plain", step.drafted)
        assert rate == pytest.approx(prices / tokens, rel=1e-9), (step, rate, prices / tokens)
        ctx += step.new_tokens
    assert policy.achieved_rate() == pytest.approx(prices / tokens, rel=1e-9)
    assert policy.achieved_rate() != pytest.approx(prior)  # it moved with what happened
    # A fixed rate (the knob) is the rate of every decision, whatever the steps made.
    fixed = make_policy("throughput", embedded_artifacts, rate=2.5)
    _run(embedded_pair, fib_ids, fixed, 3)
    assert [rate for _, _, rate in fixed.decisions] == [2.5] * 3


def test_adaedl_thresholds_at_the_extremes(embedded_pair, fib_ids):
    never = _run(embedded_pair, fib_ids, AdaEDLPolicy(gamma=0.0, lam=0.5, max_k=4), 3)  # bound 1
    assert [s.drafted for s in never.steps] == [4, 4, 4]
    always = _run(embedded_pair, fib_ids, AdaEDLPolicy(lam=1.0, max_k=4), 3)
    assert [s.drafted for s in always.steps] == [1, 1, 1]  # the bound is < 1 unless H = 0
    assert [s.draft_forwards for s in always.steps] == [2, 2, 2]  # the look at position 2
    assert AdaEDLPolicy(gamma=0.25).lower_bound(4.0) == pytest.approx(0.0)


def test_specdec_thresholds_at_the_extremes(embedded_pair, fib_ids, embedded_artifacts):
    eager = _run(
        embedded_pair,
        fib_ids,
        SpecDecPolicy(embedded_artifacts.acceptance, threshold=1.0, max_k=4),
        3,
    )
    assert [s.drafted for s in eager.steps] == [4, 4, 4]
    shy = _run(
        embedded_pair,
        fib_ids,
        SpecDecPolicy(embedded_artifacts.acceptance, threshold=1e-9, max_k=4),
        3,
    )
    assert [s.drafted for s in shy.steps] == [1, 1, 1]
    assert [s.draft_forwards for s in shy.steps] == [1, 1, 1]  # the stop costs no forward


def test_policies_without_an_acceptance_model_say_how_to_get_one(embedded_artifacts):
    bare = replace(embedded_artifacts, acceptance=None)
    for name in ("throughput", "specdec"):
        with pytest.raises(ValueError, match="jobs.train_acceptance"):
            make_policy(name, bare)


class _ShiftedDraft:
    """A model whose every next-token distribution is another's moved up by one token id: its
    argmax is never the other's, so at T = 0 each drafted token is rejected."""

    def __init__(self, model) -> None:
        self.model = model

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        out.logits = out.logits.roll(1, dims=-1)
        return out


def _replayed_offset(steps, bias: float, adapt: float) -> float:
    """The online correction recomputed from the steps (throughput.py, ``update``): each
    judged token (the accepted ones and the first rejected) moves the logit offset by
    adapt * (outcome - P(accept)), P(accept) = sigmoid(bias + offset) for every token of a
    step (the constant model), the offset clipped to +-MAX_OFFSET after each step."""
    from pipeline.acceptance.features import logistic
    from pipeline.decode.policies.outcomes import MAX_OFFSET

    offset = 0.0
    for s in steps:
        predicted = logistic(bias + offset)
        for j in range(min(s.drafted, s.accepted + 1)):
            offset += adapt * ((j < s.accepted) - predicted)
        offset = max(-MAX_OFFSET, min(MAX_OFFSET, offset))
    return offset


def test_online_correction_moves_the_logit_towards_the_outcomes(
    embedded_pair, fib_ids, embedded_artifacts
):
    # The model says 4 in 5 whatever happens: the offset follows what did (exactly, step by
    # step), stays within its bound, and is off at adapt = 0.
    def policy(adapt: float) -> ThroughputPolicy:
        acceptance = _constant_acceptance(embedded_artifacts, 1.4)
        return ThroughputPolicy(embedded_artifacts.cost, acceptance, max_k=3, adapt=adapt)

    off = policy(0.0)
    _run(embedded_pair, fib_ids, off, 6)
    assert off.outcomes.offset == 0.0
    mixed = policy(0.5)
    session = _run(embedded_pair, fib_ids, mixed, 6)
    assert sum(s.drafted for s in session.steps) > 0
    assert mixed.outcomes.offset == pytest.approx(
        _replayed_offset(session.steps, 1.4, 0.5), abs=1e-12
    )
    assert abs(mixed.outcomes.offset) <= 3.0
    # Outcomes known in advance fix the sign: outcome - predicted is > 0 for every accepted
    # token and < 0 for every rejected one, predicted being in (0, 1). The target drafting for
    # itself has every judged token accepted: the offset rises. A draft whose argmax is never
    # the target's has every judged token rejected: it falls.
    for draft, sign in ((embedded_pair.target, 1), (_ShiftedDraft(embedded_pair.target), -1)):
        rigged = replace(embedded_pair, draft=draft)
        correction = policy(0.5)
        steps = _run(rigged, fib_ids, correction, 4).steps
        judged = [(min(s.drafted, s.accepted + 1), s.accepted) for s in steps]
        hits, misses = sum(a for _, a in judged), sum(j - a for j, a in judged)
        if sign > 0:
            assert hits > 0 and misses == 0, judged
        else:
            assert misses > 0 and hits == 0, judged
        assert correction.outcomes.offset * sign > 0, (sign, correction.outcomes.offset, judged)
        assert correction.outcomes.offset == pytest.approx(
            _replayed_offset(steps, 1.4, 0.5), abs=1e-12
        )


def test_retiming_scales_each_side_by_measured_over_modelled(embedded_artifacts):
    from pipeline.decode.policies.prices import RETIME_LIMITS, PriceTables
    from pipeline.decode.types import StepRecord

    cost, union = embedded_artifacts.cost, embedded_artifacts.acceptance.union
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
