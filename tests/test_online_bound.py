"""The oracle's bound on generated text against what online decoding does on the same text.

At T = 0 (greedy acceptance, greedy junk tails, the plain step on) every transition is
deterministic and the greedy tail is exactly what greedy speculation verifies after a
mismatch, so: replaying k* visits the oracle's states, accepts its a, verifies its U(i, k, a)
and costs its dp[0]; every chain policy's step verifies the oracle's U for its (i, k, a); and
the bound is >= 1 and >= every chain policy's modelled speedup (its own steps priced with the
same cost model). At T = 1 (sampling acceptance, sampling tails) the in-sample bound beats
every schedule priced on the same tail draw.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.bench.online_bound import modelled_generation, replay, sequence_bounds
from pipeline.cost.model import CostModel
from pipeline.data.references import greedy_continuation
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.marginal import MarginalPolicy
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.types import SamplingConfig
from pipeline.oracle.bellman import evaluate_policy
from pipeline.predictor.model import TokenExpertPredictor
from tests.test_engine import perturbed_pair

LMAX = 6
COST = CostModel(
    {m: 5.0 + 0.3 * m for m in range(1, 10)}, {m: 0.4 for m in range(1, 10)}, 0.001, 0.5, 0.1
)
PROMPTS = [[5, 9, 2], [100, 3, 7, 7, 1]]


def _chain_policies(pair):
    """Every chain policy, each with its longest chain within the bound's Lmax. The tiny
    draft's confidences are small (~0.01), so lambda 250 makes `marginal` mix plain steps
    (a look that ended in k = 0: one draft forward) with one-token chains (two forwards)."""
    rng = np.random.default_rng(0)
    samples = [
        (
            int(t),
            np.sort(
                rng.choice(pair.spec.num_experts, (pair.spec.num_moe_layers, pair.spec.top_k)),
                axis=1,
            ),
        )
        for t in range(256)
    ]
    predictor = TokenExpertPredictor.fit(samples, pair.spec.num_experts, pair.spec.top_k)
    return {
        "ar": lambda: make_policy("ar"),
        "fixed1": lambda: make_policy("fixed", k=1),
        "fixed3": lambda: make_policy("fixed", k=3),
        "fixed6": lambda: make_policy("fixed", k=LMAX),
        "heuristic": lambda: make_policy("heuristic", start_k=2, max_k=LMAX),
        "confidence": lambda: make_policy("confidence", threshold=0.01, max_k=LMAX),
        "marginal": lambda: MarginalPolicy(COST, lam=250.0, predictor=predictor, max_k=LMAX),
    }


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_replaying_k_star_reproduces_the_oracle_path_experts_and_cost(family):
    pair = perturbed_pair(family, noise=0.3)
    outputs = [greedy_continuation(pair.target, p, 24, eos_id=None) for p in PROMPTS]
    bound = sequence_bounds(pair, PROMPTS, outputs, COST, lmax=LMAX, acceptance="greedy")
    assert bound.lmax == LMAX and bound.speedup_crossfit == bound.speedup
    plain = drafted = 0
    for j, seq_bound in enumerate(bound.sequences):
        rep = replay(pair, seq_bound, PROMPTS[j], COST)
        assert rep.output == outputs[j]
        assert rep.accepted == rep.oracle_accepted
        # Deterministic: the visitation is 0/1, and the engine visits exactly its 1s.
        visit = seq_bound.solution.visit[:-1]
        assert set(np.round(visit, 12)) <= {0.0, 1.0}
        assert rep.states == np.flatnonzero(visit == 1).tolist()
        # The pass verifies exactly the experts the oracle priced (greedy tails), so the same
        # cost model gives the oracle's cost for every step, and dp[0] in total.
        np.testing.assert_allclose(rep.online_u, rep.oracle_u, rtol=1e-12)
        np.testing.assert_allclose(rep.modelled_online_u_ms, rep.modelled_ms, rtol=1e-12)
        assert sum(rep.modelled_ms) == pytest.approx(seq_bound.dp0_ms, rel=1e-12)
        plain += rep.k.count(0)
        drafted += sum(a > 0 for a in rep.accepted)
    assert plain > 0 and drafted > 0  # both kinds of step are replayed


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_greedy_bound_is_at_least_every_chain_policys_modelled_speedup(family):
    pair = perturbed_pair(family, noise=0.3)
    outputs = [greedy_continuation(pair.target, p, 24, eos_id=None) for p in PROMPTS]
    bound = sequence_bounds(pair, PROMPTS, outputs, COST, lmax=LMAX, acceptance="greedy")
    engine = SpeculativeEngine(pair)
    speedups, looks = {}, set()
    for name, policy in _chain_policies(pair).items():
        for j, seq_bound in enumerate(bound.sequences):
            gen = engine.generate(
                PROMPTS[j], policy(), max_new_tokens=len(outputs[j]), stop_at_eos=False
            )
            assert gen.tokens == outputs[j], name
            run = modelled_generation(pair, PROMPTS[j], gen.tokens, gen.steps, COST)
            # The AR cost of the text, from the generation's own teacher-forced pass.
            assert run.ar_ms == pytest.approx(seq_bound.ar_ms, rel=1e-12)
            s_bound = seq_bound.ar_ms / seq_bound.dp0_ms
            assert s_bound >= 1.0
            assert s_bound >= run.speedup - 1e-12, (name, j)
            speedups[name, j] = run.speedup
            n, union = len(outputs[j]), seq_bound.union
            for i, rec in zip(run.states, gen.steps, strict=True):
                looks.add((name, min(rec.drafted, 1), rec.draft_forwards - rec.drafted))
                if i + rec.drafted <= n:  # cells past the text's end are not in the table
                    assert rec.u_bar == pytest.approx(
                        union[i, rec.drafted, rec.accepted], rel=1e-12
                    ), (name, i)
    # A plain step priced online is the DP's k = 0 cell: `ar` costs exactly Cost_AR.
    assert all(speedups["ar", j] == pytest.approx(1.0, rel=1e-12) for j in range(2))
    assert len(set(np.round(list(speedups.values()), 9))) > 3  # the policies really differ
    # Priced as run: looks that ended in k = 0 (one forward) and chains that looked one further.
    assert {("marginal", 0, 1), ("marginal", 1, 1)} <= looks


def test_sampling_bound_beats_every_schedule_on_the_same_draw():
    pair = perturbed_pair("qwen3_moe", noise=0.3)
    engine = SpeculativeEngine(pair)
    sampling = SamplingConfig(temperature=1.0)
    gens = [
        engine.generate(p, make_policy("fixed", k=3), 24, sampling, seed=j, stop_at_eos=False)
        for j, p in enumerate(PROMPTS)
    ]
    outputs = [g.tokens for g in gens]
    bound = sequence_bounds(pair, PROMPTS, outputs, COST, lmax=LMAX, acceptance="sampling")
    assert bound.speedup >= 1.0 and bound.speedup_crossfit is not None
    # With two draws each draw's optimum is best on its own draw: cross-fitted <= in-sample.
    assert bound.speedup_crossfit <= bound.speedup + 1e-12
    for j, b in enumerate(bound.sequences):
        n = b.seq.n
        assert b.dp0_crossfit_ms >= b.dp0_ms - 1e-9
        dp0 = b.solution.dp[0]  # draw 0's optimum, priced on draw 0
        left = n - np.arange(n)
        schedules = [np.minimum(k, left) for k in range(LMAX + 1)]
        q = b.seq.draft_prob
        conf = [
            next((d for d in range(LMAX) if i + 1 + d > n or q[i + 1 + d] < 0.3), LMAX)
            for i in range(n)
        ]
        schedules.append(np.minimum(conf, left))
        for k_policy in schedules:
            assert dp0 <= evaluate_policy(b.probs, b.cost, k_policy)[0] + 1e-9
        # A fully accepted step verified reference tokens only: the oracle's U(i, k, k).
        i = 0
        for rec in gens[j].steps:
            if rec.accepted == rec.drafted and i + rec.drafted <= n:
                assert rec.u_bar == pytest.approx(b.union[i, rec.drafted, rec.drafted])
            i += rec.new_tokens


def test_bad_acceptance():
    pair = perturbed_pair("qwen3_moe", noise=0.3)
    with pytest.raises(ValueError, match="acceptance must be one of"):
        sequence_bounds(pair, PROMPTS[:1], [[1, 2]], COST, lmax=4, acceptance="exact")
