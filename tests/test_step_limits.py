"""A step's work is bounded jointly over a policy's knobs: every registered policy
declares an upper bound on one step's draft forwards, draft tokens and verified positions
(``step_work``) that real steps never exceed; a server's StepLimits refuse knobs whose product
is too much (tree depth 64 x branch 64) before decoding; the drafter and the engine stop a
policy that under-declares before the forward that would exceed the limits; and
``step_deltas`` hands control back once per step, ending at a deadline."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from pipeline.decode import stream as stream_module
from pipeline.decode.drafter import Drafter
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.artifacts import PolicyArtifacts
from pipeline.decode.policies.base import Policy
from pipeline.decode.policies.knobs import Knob, KnobError
from pipeline.decode.policies.registry import POLICIES, make_policy
from pipeline.decode.policies.simple import FixedPolicy
from pipeline.decode.policies.tree import TreePolicy
from pipeline.decode.step_limits import (
    StepLimitError,
    StepLimitExceeded,
    StepLimits,
    StepWork,
    check_step_limits,
)
from pipeline.decode.types import Candidates, SamplingConfig
from tests.test_engine import perturbed_pair
from tests.test_policy_registry import synthetic_artifacts

PROMPT = [4, 8, 15, 16, 23]
STEPS = 5
# Knob settings beyond the defaults (always run): the extremes of each rule within what tiny
# models run fast. A policy registered later is still covered by its defaults and random draws.
SETTINGS: dict[str, list[dict[str, Any]]] = {
    "fixed": [{"k": 1}, {"k": 12}],
    "heuristic": [{"start_k": 12, "max_k": 3}, {"start_k": 1, "max_k": 9}],
    "confidence": [{"threshold": 0.0, "max_k": 12}, {"threshold": 0.9, "max_k": 5}],
    "tree": [
        {"depth": 1, "branch": 3, "gamma": 2},
        {"depth": 5, "branch": 3, "gamma": 30},
        {"depth": 2, "branch": 8, "gamma": 64},
        {"depth": 7, "branch": 1, "gamma": 64},
    ],
    "ecospec": [{"depth": 4, "branch": 3, "gamma": 12}],
    "ecospec-global": [{"depth": 2, "branch": 4, "gamma": 64}],
    "marginal": [
        {"lam": 1e6, "max_k": 10},
        {"lam": 0.01, "max_k": 5},
        {"max_k": 12, "calibrate": True},
    ],
}
DRAWS = 2  # random knob settings per policy, integer knobs capped for speed
INT_CAP = 6


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # many tiny forwards


@pytest.fixture(scope="module")
def pairs() -> dict[str, Any]:
    """An exact draft (every draft token accepted: the catch-up is as large as it gets) and a
    noisy one (rejections, early stops)."""
    return {
        "exact": perturbed_pair("qwen3_moe", noise=0.0, sharpen=4.0),
        "noisy": perturbed_pair("qwen3_moe", noise=0.3, sharpen=4.0),
    }


@pytest.fixture(scope="module")
def artifacts(pairs) -> PolicyArtifacts:
    return synthetic_artifacts(pairs["exact"])


def _draw(knob: Knob, rng: np.random.Generator) -> Any:
    if knob.type is bool:
        return bool(rng.integers(2))
    if knob.type is int:
        return int(rng.integers(int(knob.low), min(int(knob.high), INT_CAP) + 1))
    if knob.high is None:  # e.g. lambda: a log-uniform draw above its floor
        return float(knob.low + 10 ** rng.uniform(-2, 3))
    low = knob.low + (1e-6 if knob.low_open else 0.0)
    return float(rng.uniform(low, knob.high))


def _settings(name: str) -> list[dict[str, Any]]:
    rng = np.random.default_rng(sum(map(ord, name)))
    drawn = [{k.name: _draw(k, rng) for k in POLICIES[name].knobs} for _ in range(DRAWS)]
    out: list[dict[str, Any]] = []
    for knobs in [{}, *SETTINGS.get(name, []), *drawn]:
        if knobs not in out:  # (a policy without knobs draws {} every time)
            out.append(knobs)
    return out


def _observe(pair, policy: Policy, sampling: SamplingConfig, limits: StepLimits | None):
    session = SpeculativeEngine(pair, limits).start(PROMPT, policy, sampling, seed=1)
    for _ in range(STEPS):
        session.step()
    return session.steps


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_steps_never_exceed_the_declared_step_work(name, pairs, artifacts):
    """Every knob setting, both drafts, greedy and sampled: observed <= declared, and a run
    whose limits are exactly the declared work is never stopped (the runtime accounting
    agrees with the declaration)."""
    for knobs in _settings(name):
        for pair_name, sampling in (
            ("exact", SamplingConfig()),
            ("noisy", SamplingConfig(temperature=1.0)),
        ):
            policy = make_policy(name, artifacts, **knobs)
            work = policy.step_work()
            exact = StepLimits(work.draft_forwards, work.draft_tokens, work.verified)
            steps = _observe(pairs[pair_name], policy, sampling, exact)
            seen = (
                max(s.draft_forwards for s in steps),
                max(s.draft_tokens for s in steps),
                max(s.verified for s in steps),
            )
            declared = (work.draft_forwards, work.draft_tokens, work.verified)
            assert all(o <= d for o, d in zip(seen, declared, strict=True)), (
                name,
                knobs,
                pair_name,
                seen,
                declared,
            )


@pytest.mark.parametrize("k", [1, 4, 12])
def test_the_chain_bound_is_reached_with_an_exact_draft(k, pairs):
    """Every token accepted: k forwards, the k + 1 committed tokens caught up plus k - 1
    extends, k + 1 positions. The bound is the work, not a loose guess."""
    policy = make_policy("fixed", k=k)
    steps = _observe(pairs["exact"], policy, SamplingConfig(), None)
    work = policy.step_work()
    last = steps[-1]
    assert (
        (last.draft_forwards, last.draft_tokens, last.verified)
        == (work.draft_forwards, work.draft_tokens, work.verified)
        == (k, 2 * k, k + 1)
    )


def test_a_deep_wide_tree_is_refused_naming_its_knobs_and_the_limit():
    with pytest.raises(StepLimitError) as err:
        check_step_limits(make_policy("tree", depth=64, branch=64, gamma=64), StepLimits())
    message = str(err.value)
    assert isinstance(err.value, KnobError) and err.value.knob is None
    for part in ("tree", "depth 64", "branch 64", "256", "lower depth or branch"):
        assert part in message, message
    assert "254,080 tokens" in message  # 64 + 62 * 64^2 fed + a 64-token catch-up


def test_a_shallow_wide_tree_is_refused_for_the_nodes_it_scores(artifacts):
    """Depth 2, branch 64 feeds the draft few tokens but builds (and scores, for selection)
    64 + 64^2 nodes: bounded by max_tree_nodes."""
    for name in ("tree", "ecospec"):
        policy = make_policy(name, artifacts, depth=2, branch=64, gamma=64)
        with pytest.raises(
            StepLimitError,
            match=r"builds a draft tree of 4,160 nodes.*at most "
            r"256 \(lower depth or branch\)",
        ):
            check_step_limits(policy, StepLimits())


def test_the_verified_limit_names_gamma():
    with pytest.raises(
        StepLimitError,
        match=r"gamma 10 verifies 10 positions.*at most 9 "
        r"\(lower gamma\)",
    ):
        StepLimits(max_verified=9).check("tree", TreePolicy(4, 2, 10).step_work())
    with pytest.raises(StepLimitError, match=r"fixed: k 9 runs 9 draft forwards.*at most 8"):
        check_step_limits(FixedPolicy(9), StepLimits(max_draft_forwards=8))


def test_every_policy_s_defaults_and_every_chain_pass_the_default_limits(artifacts):
    for name in POLICIES:
        check_step_limits(make_policy(name, artifacts), StepLimits())
    for name, knobs in (
        ("fixed", {"k": 64}),
        ("heuristic", {"start_k": 64, "max_k": 64}),
        ("confidence", {"max_k": 64}),
    ):
        check_step_limits(make_policy(name, **knobs), StepLimits())
    # The deepest branch-2 tree the default 256 draft tokens admit, and one level more.
    check_step_limits(make_policy("tree", depth=52, branch=2, gamma=64), StepLimits())
    with pytest.raises(StepLimitError, match="depth 53, branch 2"):
        check_step_limits(make_policy("tree", depth=53, branch=2, gamma=64), StepLimits())


def test_replay_declares_its_catch_up_after_plain_steps():
    from pipeline.decode.policies.replay import ReplayPolicy

    assert ReplayPolicy(np.zeros(5, int), 3).step_work() == StepWork(0, 0, 1, "k* 0")
    # Plain steps at states 0-3, a chain of 2 at state 4: catch up on 5 tokens, extend once.
    work = ReplayPolicy(np.array([0, 0, 0, 0, 2]), 3).step_work()
    assert (work.draft_forwards, work.draft_tokens, work.verified) == (2, 6, 3)


@dataclasses.dataclass
class UnderDeclaredChain(FixedPolicy):
    """Drafts its k but declares a chain of 2."""

    name = "under-declared"

    def step_work(self) -> StepWork:
        return StepWork(2, 4, 3, "k 2")


class WideTree(TreePolicy):
    name = "wide-tree"

    def step_work(self) -> StepWork:
        return StepWork(1, 2, 2, "nothing")


class BlindChain(Policy):
    """One draft forward, then ``k`` copies of its argmax: many positions for little drafting."""

    name = "blind"

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        token = int(drafter.begin(committed).argmax())
        return Candidates(
            [token] * self.k, list(range(-1, self.k - 1)), [None] * self.k, [1.0] * self.k
        )

    def step_work(self) -> StepWork:
        return StepWork(1, 2, 2, "k 1")


def test_an_under_declaring_policy_is_stopped_before_the_forward_that_would_exceed(pairs):
    pair = pairs["noisy"]
    limits = StepLimits(max_draft_forwards=3)
    policy = UnderDeclaredChain(8)
    check_step_limits(policy, limits)  # what it declares passes
    session = SpeculativeEngine(pair, limits).start(PROMPT, policy)
    with pytest.raises(StepLimitExceeded, match="under-declared: the draft would run 4 forwards"):
        session.step()
    assert session.drafter.forwards == 3  # the fourth never ran
    assert session.drafter.cache.get_seq_length() == session.drafter.committed_len  # rolled back
    assert session.steps == []


def test_draft_tokens_are_budgeted_per_forward(pairs):
    limits = StepLimits(max_draft_tokens=10)
    session = SpeculativeEngine(pairs["noisy"], limits).start(PROMPT, WideTree(3, 4, 20))
    # begin feeds 1 token, level 0 feeds 4 (5 in all); level 1 would feed 16 more.
    with pytest.raises(StepLimitExceeded, match="wide-tree: the draft would process 21 tokens"):
        session.step()
    assert (session.drafter.forwards, session.drafter.tokens) == (2, 5)


def test_verified_positions_are_checked_before_the_target_pass(pairs):
    pair = pairs["noisy"]
    session = SpeculativeEngine(pair, StepLimits(max_verified=5)).start(PROMPT, BlindChain(6))
    before = session.target_cache.get_seq_length()
    with pytest.raises(StepLimitExceeded, match="blind: the verification pass would verify 7"):
        session.step()
    assert session.target_cache.get_seq_length() == before  # no target forward ran
    # Within its limits the same policy decodes, and without limits nothing is checked.
    SpeculativeEngine(pair, StepLimits(max_verified=7)).start(PROMPT, BlindChain(6)).step()
    SpeculativeEngine(pair).start(PROMPT, BlindChain(6)).step()


@pytest.fixture(scope="module")
def text_pair(pairs, tokenizer):
    """The noisy pair with a tokenizer, so that steps produce text."""
    return dataclasses.replace(pairs["noisy"], tokenizer=tokenizer)


def _stream(pair, **kw):
    return SpeculativeEngine(pair).stream(
        PROMPT, make_policy("fixed", k=2), 24, stop_at_eos=False, **kw
    )


def test_step_deltas_yield_once_per_step_and_join_to_the_text(text_pair):
    gen = _stream(text_pair)
    ys = list(gen.step_deltas())
    result = gen.result
    assert result.finish_reason == "length" and len(result.tokens) == 24
    assert ys[0] == "" and len(ys) == len(result.steps) + 2  # prefill, each step, the rest
    assert "".join(ys) == result.text and result.text
    # deltas() is the non-empty step deltas: the same chunks, the same result.
    again = _stream(text_pair)
    assert list(again.deltas()) == [y for y in ys if y]
    assert again.result.tokens == result.tokens and again.result.text == result.text
    # A stop string ends it mid-step: that step yields "", the remainder holds its text.
    stop = result.text[len(result.text) // 2 :][:3]
    stopped = _stream(text_pair, stop=[stop])
    ys = list(stopped.step_deltas())
    assert stopped.result.finish_reason == "stop"
    assert len(ys) == len(stopped.result.steps) + 2 and "".join(ys) == stopped.result.text


def test_a_deadline_ends_the_generation_before_the_next_step(text_pair, monkeypatch):
    """The clock reads past the deadline after the first step: one step runs, then the
    generation ends "deadline" with that step's text."""
    reads = []

    def clock() -> float:
        reads.append(1)
        return 0.0 if len(reads) == 1 else 100.0

    monkeypatch.setattr(stream_module, "monotonic", clock)
    gen = _stream(text_pair)
    ys = list(gen.step_deltas(deadline=50.0))
    result = gen.result
    assert result.finish_reason == "deadline" and len(result.steps) == 1 and len(reads) == 2
    assert len(ys) == 3 and "".join(ys) == result.text
    assert result.tokens == result.tokens[: result.steps[0].new_tokens]


def test_a_deadline_already_past_runs_no_step(text_pair):
    import time

    gen = _stream(text_pair)
    assert list(gen.step_deltas(deadline=time.monotonic() - 1)) == ["", ""]
    assert gen.result.finish_reason == "deadline" and gen.result.steps == []
    assert gen.result.tokens == [] and gen.result.text == ""


def test_step_deltas_poll_cancelled_before_every_step(text_pair):
    polls = []

    def cancelled() -> bool:
        polls.append(1)
        return len(polls) > 2

    gen = _stream(text_pair)
    ys = list(gen.step_deltas(cancelled, deadline=float("inf")))
    assert gen.result.finish_reason == "cancelled" and len(gen.result.steps) == 2
    assert len(polls) == 3 and len(ys) == 4 and "".join(ys) == gen.result.text


def test_deltas_still_stop_before_the_next_step_once_cancelled(text_pair):
    """deltas() is lazy as before: after its first delta only the steps that produced it
    have run, and cancelling then ends the generation before another step."""
    polls, cancel = [0], [False]

    def cancelled() -> bool:
        polls[0] += 1
        return cancel[0]

    gen = _stream(text_pair)
    deltas = gen.deltas(cancelled)
    first = next(deltas)
    steps_run = polls[0]
    cancel[0] = True
    rest = list(deltas)
    assert gen.result.finish_reason == "cancelled"
    assert len(gen.result.steps) == steps_run and polls[0] == steps_run + 1
    assert "".join([first, *rest]) == gen.result.text


def test_cascade_declares_its_catch_up_after_plain_steps(pairs):
    """An exact draft but a draft forward priced at 100 ms: the test phase (K = 1, then 2, all
    accepted) finds no K that pays, the set phase takes 2 plain steps, and the next test step
    catches up on the K = 2 step's 3 tokens and the 2 plain ones: the declared bound, reached."""
    from pipeline.cost.model import CostModel
    from pipeline.decode.policies.cascade import CascadePolicy

    cost = CostModel(
        beta0={m: 10.0 for m in (1, 2, 3)},
        alpha={m: 0.0 for m in (1, 2, 3)},
        c=0.0,
        draft_a=100.0,
        draft_b=0.0,
    )
    policy = CascadePolicy(cost, max_k=2, test_steps=1, set_steps=2)
    declared = policy.step_work()
    session = SpeculativeEngine(pairs["exact"]).start(PROMPT, policy, SamplingConfig(), seed=1)
    for _ in range(5):
        session.step()
    assert [s.drafted for s in session.steps] == [1, 2, 0, 0, 1]
    assert session.steps[-1].draft_tokens == declared.draft_tokens == 5
    assert max(s.draft_forwards for s in session.steps) == declared.draft_forwards == 2
