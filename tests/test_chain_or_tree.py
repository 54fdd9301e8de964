"""`chain-or-tree`: the runner-ups' worth is what its definition gives, the step adds the
best prefix of them by modelled worth (none when they do not pay), the walk through a
runner-up reaches the target's greedy text, and `throughput` underneath learns exactly what
it would have learned from its chain alone. (Greedy text equal to plain greedy, losslessness
under sampling and knob validation: the registry-wide tests.)"""

from __future__ import annotations

import pytest
import torch

from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.chain_or_tree import (
    SHARE_PRIOR,
    Alternative,
    alternatives,
    best_alternatives,
)
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.step_limits import StepLimits
from pipeline.decode.types import Candidates, SamplingConfig, StepOutcome, StepRecord


def _dist(*pairs: tuple[int, float], vocab: int = 8) -> torch.Tensor:
    probs = torch.zeros(vocab)
    for token, p in pairs:
        probs[token] = p
    return probs


def test_a_runner_up_is_worth_the_chain_before_it_its_token_rejected_and_the_share():
    chain = [3, 5, 1]
    dists = [_dist((3, 0.6), (4, 0.3)), _dist((5, 0.9), (2, 0.05)), _dist((6, 0.5), (1, 0.4))]
    accs = [0.8, 0.5, 0.7]
    out = alternatives(chain, dists, accs, share=0.6)
    by_position = {alt.position: alt for alt in out}
    assert by_position[0] == Alternative(0, 4, pytest.approx(0.2 * 0.6))
    assert by_position[1] == Alternative(1, 2, pytest.approx(0.8 * 0.5 * 0.6))
    # Where the chain's token is not the draft's top (sampled), the top is the alternative.
    assert by_position[2] == Alternative(2, 6, pytest.approx(0.8 * 0.5 * 0.3 * 0.6))
    assert [alt.worth for alt in out] == sorted((alt.worth for alt in out), reverse=True)
    # One more distribution than chain tokens: `throughput` looked at position 2 and declined
    # its top token; both its top two become leaves.
    declined = alternatives(chain[:2], dists, accs, share=0.6)
    at_2 = sorted((alt for alt in declined if alt.position == 2), key=lambda alt: alt.runner_up)
    assert at_2 == [
        Alternative(2, 6, pytest.approx(0.8 * 0.5 * 0.7), runner_up=False),
        Alternative(2, 1, pytest.approx(0.8 * 0.5 * 0.3 * 0.6)),
    ]


def test_the_step_adds_the_prefix_of_best_worth_within_the_priced_table():
    options = [Alternative(0, 1, 0.5), Alternative(1, 2, 0.3), Alternative(2, 3, 0.05)]
    tt = [0.0, 10.0, 11.0, 12.0, 13.0, 14.0]  # T_T(m) for m = 1 .. 5: 1 ms a position
    # rho 4: worth 2.0, 1.2, 0.2 against 1 ms each: the first two pay, the third does not.
    assert best_alternatives(options, tt, 2, 4.0, 4) == options[:2]
    assert best_alternatives(options, tt, 2, 4.0, 1) == options[:1]  # max_alternatives
    assert best_alternatives(options, tt, 2, 1.0, 4) == []  # none pays: the chain as it is
    # The table prices m up to 5: a chain of m = 4 positions has room for one more.
    assert best_alternatives(options, tt, 4, 4.0, 4) == options[:1]
    # A later runner-up that pays makes a prefix with one that does not alone worth it.
    steep = [Alternative(0, 1, 0.2), Alternative(1, 2, 0.2)]
    assert best_alternatives(steep, [0.0, 10.0, 11.0, 11.1], 1, 4.0, 4) == steep


def _greedy(embedded_pair, fib_ids, n: int) -> list[int]:
    return SpeculativeEngine(embedded_pair).generate(fib_ids, make_policy("ar"), n).tokens


def test_runner_ups_are_verified_and_the_text_stays_greedy(
    embedded_pair, fib_ids, embedded_artifacts
):
    """With a runner-up share of 1 every step that drafts adds runner-ups up to the knob; some
    walks end on one, and the text is still the target's greedy text."""
    policy = make_policy("chain-or-tree", embedded_artifacts, runner_up=1.0, max_alternatives=2)
    limits = StepLimits(
        *[getattr(policy.step_work(), f) for f in ("draft_forwards", "draft_tokens", "verified")]
    )
    session = SpeculativeEngine(embedded_pair, limits).start(fib_ids, policy)
    trees = 0
    while len(session.generated) < 48:
        cands, t_draft = session.draft()
        trees += not cands.is_chain
        logits, routing, t_verify = session.verify(cands)
        session.commit(cands, logits, routing, t_draft, t_verify)
    assert trees, "no step verified a runner-up"
    assert session.generated[:48] == _greedy(embedded_pair, fib_ids, 48)
    assert max(s.verified for s in session.steps) <= policy.step_work().verified
    assert any(hit for *_, hit in policy.judged), "no runner-up was ever accepted"
    # The share follows the judged ones from its prior.
    hits = sum(hit for *_, hit in policy.judged)
    assert policy.share() == pytest.approx(
        (SHARE_PRIOR + hits) / (SHARE_PRIOR + len(policy.judged))
    )


def test_with_no_alternatives_it_is_throughput(embedded_pair, fib_ids, embedded_artifacts):
    for temperature in (0.0, 1.0):
        ours = make_policy("chain-or-tree", embedded_artifacts, max_alternatives=0)
        plain = make_policy("throughput", embedded_artifacts)
        runs = [
            SpeculativeEngine(embedded_pair).generate(
                fib_ids, p, 32, SamplingConfig(temperature), seed=3
            )
            for p in (ours, plain)
        ]
        assert runs[0].tokens == runs[1].tokens
        assert [s.drafted for s in runs[0].steps] == [s.drafted for s in runs[1].steps]
        assert all(s.verified == s.drafted + 1 for s in runs[0].steps)  # chains only


def test_at_t1_its_leaves_are_further_draws_chosen_before_the_chain_token_is_drawn(
    embedded_pair, fib_ids, embedded_artifacts
):
    """Every leaf is a draw from the distribution its position's chain token was drawn from,
    stands beside it and is verified by recursive rejection; a
    second draw's share of 1 makes every one worth its position, up to the knob and the pass's
    limit. (Its output distribution: the registry-wide exact and chi-square tests.)"""
    policy = make_policy("chain-or-tree", embedded_artifacts, second_draw=1.0, max_alternatives=12)
    seen, steps = [], 0
    session = SpeculativeEngine(embedded_pair).start(fib_ids, policy, SamplingConfig(1.0), seed=5)
    while steps < 12:
        steps += 1
        cands, _ = session.draft()
        k = len(policy._chain)
        leaves = list(range(k, len(cands)))
        assert len(leaves) <= 12 and len(cands) + 1 <= policy.max_k + 1
        for node in leaves:
            alt = policy._added_nodes[node]
            # Beside chain token `position` (same parent), drawn from the same distribution.
            assert cands.parents[node] == alt.position - 1
            assert cands.q[node] is not None
            assert alt.position < k and cands.q[node] is cands.q[alt.position]
        # Each leaf is its own draw (a leaf listed twice would waste a verified position).
        assert len({id(policy._added_nodes[node]) for node in leaves}) == len(leaves)
        seen.append(len(leaves))
        logits, routing, t_verify = session.verify(cands)
        session.commit(cands, logits, routing, 0.0, t_verify)
    assert sum(seen) > 0
    assert any(hit for *_, hit in policy.judged) and any(not hit for *_, hit in policy.judged)


def test_an_accepted_runner_up_is_a_rejection_of_the_chain_s_token(embedded_artifacts):
    """`throughput` underneath updates from the chain alone: a walk that ends on the runner-up
    at position 1 leaves it where a chain accepted up to position 1 would."""
    ours = make_policy("chain-or-tree", embedded_artifacts)
    plain = make_policy("throughput", embedded_artifacts)
    chain = Candidates()
    for token in (3, 5, 7):
        chain.extend_chain(token, _dist((token, 0.9)), greedy=True)
    tree = Candidates(
        [*chain.tokens, 9], [*chain.parents, 0], [*chain.q, None], [*chain.confidences, 0.1]
    )
    record = StepRecord(4, 5, 2, 3, [4, 4], 1.0, 10.0, 3, 3)
    for policy in (ours, plain):
        policy.outcomes.predicted = [0.9, 0.8, 0.7]
        policy._ctx = 20
    alt = Alternative(1, 9, 0.1)
    ours._chain, ours._added, ours._added_nodes, ours._used = chain, [alt], {3: alt}, 0.6
    ours.update(StepOutcome(tree, 2, record, (0, 3)))
    plain.update(StepOutcome(chain, 1, record, (0,)))
    assert ours.judged == [(1, 0.6, True)]
    # A walk that stops at position 1 on neither token judges the runner-up as rejected; one
    # that accepts the chain's token there judges nothing.
    ours.update(StepOutcome(tree, 1, record, (0,)))
    ours.update(StepOutcome(tree, 2, record, (0, 1)))
    assert ours.judged == [(1, 0.6, True), (1, 0.6, False)]
    plain.update(StepOutcome(chain, 1, record, (0,)))
    plain.update(StepOutcome(chain, 2, record, (0, 1)))
    for attr in ("recent", "offset", "_observed_upto"):
        assert getattr(ours.outcomes, attr) == getattr(plain.outcomes, attr), attr
    for attr in ("_plain_run", "_price_sum"):
        assert getattr(ours, attr) == getattr(plain, attr), attr
