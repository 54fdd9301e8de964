"""One continuous batch whose generations run the same policy with different knobs: for every
registered policy, generations at the low end of every knob's declared range decode beside
generations at the high end (as high as a default server admits). No generation fails, every
one decodes plain greedy text, and none does more work in a step than its OWN knobs allow
(the `batch` policy once planned every row with the max_k of whichever row asked first)."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.decode.batched import BatchedEngine
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.artifacts import PolicyArtifacts, load_artifacts
from pipeline.decode.policies.knobs import Knob
from pipeline.decode.policies.registry import POLICIES, make_policy
from pipeline.decode.step_limits import StepLimits, check_step_limits
from pipeline.models.loading import ModelPair, load_pair

TOKENS = 12
PROMPTS = ["def add(a, b):\n", "The cat", "for i in range(10):\n    print(", "x = [1, 2"]
OPEN_STEP = 0.01  # how far above an open lower bound (e.g. threshold > 0) the low end sits

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # many tiny forwards


@pytest.fixture(scope="module")
def embedded() -> tuple[ModelPair, PolicyArtifacts]:
    """The committed pair and its artifacts: every policy, the cost-aware ones included."""
    return load_pair("models/target", "models/draft", "cpu", "float32", "eager"), load_artifacts()


def _valid(name: str, artifacts: PolicyArtifacts, knobs: dict[str, Any]) -> bool:
    """What a default server accepts: the registry's checks, the artifacts pricing the policy
    (a cost-aware max_k), and the step work within the default StepLimits."""
    try:
        check_step_limits(make_policy(name, artifacts, **knobs), StepLimits())
    except ValueError:
        return False
    return True


def _low(knob: Knob) -> Any:
    if knob.type is bool:
        return False
    low = knob.low if knob.low is not None else knob.default
    if knob.low_open:
        low += OPEN_STEP
    return knob.type(low)


def _highest_int(name: str, artifacts: PolicyArtifacts, knobs: dict, knob: Knob) -> int:
    """The largest value of an integer knob, the others as in ``knobs``, still valid (work and
    pricing only grow with a step knob: a bisection)."""
    lo, hi = int(knob.low), int(knob.high)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _valid(name, artifacts, {**knobs, knob.name: mid}):
            lo = mid
        else:
            hi = mid - 1
    return lo


def knob_settings(name: str, artifacts: PolicyArtifacts) -> tuple[dict, dict]:
    """Two valid settings of a policy's knobs, far apart: every knob at the low end of its
    range, and every knob raised in turn (in declaration order) as high as its range and the
    knobs before it allow. A knob with no upper bound keeps its default on the high side."""
    knobs = POLICIES[name].knobs
    low = {k.name: _low(k) for k in knobs}
    assert _valid(name, artifacts, low), (name, low)
    high = dict(low)
    for knob in knobs:
        if knob.type is bool:
            candidate = True
        elif knob.type is int:
            candidate = _highest_int(name, artifacts, high, knob)
        elif knob.high is not None:
            candidate = knob.high
        else:
            candidate = knob.default
        if candidate is None:
            del high[knob.name]  # the artifacts' value (e.g. marginal's lambda)
        elif _valid(name, artifacts, {**high, knob.name: candidate}):
            high[knob.name] = knob.convert(candidate)
    assert _valid(name, artifacts, high), (name, high)
    return low, high


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_batch_mixing_a_policys_knobs_decodes_each_row_by_its_own(name, embedded):
    pair, artifacts = embedded
    ids = [pair.tokenizer.encode(p) for p in PROMPTS]
    plain = SpeculativeEngine(pair)
    want = [plain.generate(p, make_policy("ar"), TOKENS, stop_at_eos=False).tokens for p in ids]
    settings = knob_settings(name, artifacts)
    knobs = [settings[i % 2] for i in range(len(ids))]  # low, high, low, high in one batch
    policies = [make_policy(name, artifacts, **k) for k in knobs]
    # The engine also enforces the server's limits as each step runs.
    engine = BatchedEngine(pair, StepLimits())
    got = engine.generate_many(
        ids, None, TOKENS, max_batch=len(ids), stop_at_eos=False, policies=policies
    )
    assert [g.tokens for g in got] == want, settings
    for gen, policy, k in zip(got, policies, knobs, strict=True):
        work = policy.step_work()  # this row's own knobs, resolved
        for step in gen.steps:
            assert step.drafted <= work.verified - 1, (k, step)
            assert step.verified <= work.verified, (k, step)
            assert step.draft_forwards <= work.draft_forwards, (k, step)
            assert step.draft_tokens <= work.draft_tokens, (k, step)
        if name == "batch":  # the plan held this row to its own max_k
            assert max(policy.lengths) <= policy.max_k, (k, policy.lengths)
    assert max(r.rows for r in engine.batcher.records) == len(ids)  # one batch, both settings
    if name == "batch":  # the batch's plan priced the rows (not each row alone)
        assert engine.batcher.economy is not None
