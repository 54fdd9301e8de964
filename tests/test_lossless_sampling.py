"""Every registered policy samples losslessly at T = 1 (and with top-p), proved by exact
enumeration rather than by sampling: the engine's output distribution of the first three
tokens, computed over every path of its random draws (tests/exact_enumeration.py), equals the
target's joint distribution from direct target forwards to 1e-5 per sequence.

Being exact, these tests have no power to state: any bias above float32 rounding (about 1e-7
here) fails them, where the chi-square test they replace caught a total-variation bias of
about 0.05 with 80% probability. The same harness shows the bias of the old `confidence` rule
(sample x ~ q, then drop it when q(x) < threshold).

A policy registered later is covered with its declared defaults unless SMALL_KNOBS gives it
cheaper ones (the harness refuses a policy that needs too many runs). `batch`, the one policy
whose lengths depend on the batch it is in, is also enumerated planning with a neighbour in a
batch of two (the last test).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from pipeline.acceptance.model import AcceptanceModel, ModeModel
from pipeline.cost.batch import BatchCost
from pipeline.cost.model import CostModel
from pipeline.decode.batch_economy import BatchEconomy
from pipeline.decode.batching import BatchRecord
from pipeline.decode.drafter import Drafter
from pipeline.decode.policies.artifacts import PolicyArtifacts
from pipeline.decode.policies.base import Policy
from pipeline.decode.policies.chain_or_tree import ChainOrTreePolicy
from pipeline.decode.policies.registry import POLICIES, make_policy
from pipeline.decode.types import Candidates, SamplingConfig
from pipeline.models.loading import ModelPair
from pipeline.predictor.model import ExpertMLP, LearnedExpertPredictor
from tests.exact_enumeration import compare, enumerate_outputs, target_joint
from tests.test_engine import perturbed_pair

VOCAB = 4
PROMPT = [3, 1, 2]
N_TOKENS = 3  # the joint distribution of the first three generated tokens
TOLERANCE = 1e-5  # per sequence (the engine computes in float32)
SHARPEN = 4.0  # logit scale of the tiny pair: the draft's max q then spans 0.35-0.56
SAMPLING = SamplingConfig(temperature=1.0)

# Small knobs keep the paths few. The early-exit policies' thresholds sit inside the range of
# the draft's confidences on this pair, so their stop fires on some paths and not on others
# (asserted below); marginal's lambda also makes it take plain steps (k = 0) on some.
SMALL_KNOBS: dict[str, dict[str, Any]] = {
    "ar": {},
    "fixed": {"k": 3},
    "heuristic": {"start_k": 1, "max_k": 2},
    "confidence": {"threshold": 0.45, "max_k": 2},
    "tree": {"depth": 2, "branch": 2, "gamma": 4},
    "ecospec": {"depth": 2, "branch": 2, "gamma": 4},
    "ecospec-global": {"depth": 2, "branch": 2, "gamma": 4},
    "marginal": {"lam": 2.5, "max_k": 2},
    "cascade": {"max_k": 2, "test_steps": 1, "set_steps": 1},  # tests 1 and 2, then sets one
    "adaedl": {"gamma": 0.5, "lam": 0.22, "max_k": 2},  # entropies here: 1.1-1.3 nats
    "specdec": {"threshold": 0.15, "max_k": 2},  # the head's P(accept): 0.64-0.97 here
    "throughput": {"max_k": 2, "probe_every": 1, "rate": 1.5},  # a token worth 1.5 ms
    "batch": {"max_k": 2, "probe_every": 1},
}
# Proposal sizes each policy must show over all paths (its rule really branches).
MUST_PROPOSE = {
    "heuristic": {1, 2},
    "confidence": {1, 2},
    "marginal": {0, 1, 2},
    "cascade": {0, 1, 2},
    "adaedl": {1, 2},
    "specdec": {1, 2},
    "throughput": {0, 1, 2},
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # many tiny forwards


@pytest.fixture(scope="module")
def pair() -> ModelPair:
    return perturbed_pair("qwen3_moe", noise=0.8, vocab=VOCAB, seed=4, sharpen=SHARPEN)


@pytest.fixture(scope="module")
def artifacts(pair) -> PolicyArtifacts:
    torch.manual_seed(0)
    spec = pair.spec
    predictor = LearnedExpertPredictor(
        ExpertMLP(VOCAB, pair.draft.config.hidden_size, spec.num_moe_layers, spec.num_experts),
        spec.top_k,
    )
    cost = CostModel(
        {m: 4 + 0.2 * m for m in range(1, 14)}, {m: 0.3 for m in range(1, 14)}, 0.001, 0.4, 0.1
    )
    hidden = pair.draft.config.hidden_size
    head = [0.0] + torch.linspace(-1.0, 1.0, hidden).tolist()  # varies with the draft's state
    # Acceptance rises with the draft's confidence, which spans 0.35-0.56 on this pair.
    mode = ModeModel(
        current=[-4.0, 0.0, 9.0, 0.0, 0.0, 0.5, 0.0, 0.0, 1.0],
        next=[-4.0, 0.0, 9.0, 0.0, 0.0, 0.5, 0.0, 0.0, 1.0],
        prior=0.5,
        head=head,
        spread=[-3.0, -2.0, -1.0],
    )
    acceptance = AcceptanceModel(
        {"greedy": mode, "sampled": mode}, [2.0 + 0.5 * m for m in range(13)]
    )
    return PolicyArtifacts(predictor, cost, 500.0, acceptance)


@pytest.fixture(scope="module")
def joint(pair) -> dict:
    return target_joint(pair, PROMPT, SAMPLING, N_TOKENS)


def _policy(name: str, artifacts: PolicyArtifacts, **extra: Any) -> Policy:
    return make_policy(name, artifacts, **{**SMALL_KNOBS.get(name, {}), **extra})


def _check(pair, policy, sampling, want) -> tuple[float, float, Any]:
    got = enumerate_outputs(pair, PROMPT, policy, sampling, N_TOKENS)
    assert sum(got.distribution.values()) == pytest.approx(1.0, abs=1e-9)
    err, tv = compare(got.distribution, want)
    return err, tv, got


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_samples_the_target_distribution_exactly(name, pair, artifacts, joint):
    err, tv, got = _check(pair, _policy(name, artifacts), SAMPLING, joint)
    assert err < TOLERANCE, (name, err, tv, got.paths)
    assert MUST_PROPOSE.get(name, set()) <= set(got.proposal_sizes), (name, got.proposal_sizes)


TREES_SEEN: list[bool] = []


class _ChainOrTreeSeen(ChainOrTreePolicy):
    """chain-or-tree, noting whether each proposal was a tree (copies share the list)."""

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        cands = super().propose(drafter, committed)
        TREES_SEEN.append(not cands.is_chain)
        return cands


def test_chain_or_tree_with_drawn_leaves_samples_the_target_distribution_exactly(
    pair, artifacts, joint
):
    """At T > 0 its leaves are further draws beside the chain's tokens, verified with them by
    recursive rejection sampling; worth their positions here (second_draw 1), so most steps
    verify a tree."""
    knobs = {"max_k": 3, "probe_every": 1, "rate": 1.5, "second_draw": 1.0}
    base = make_policy("chain-or-tree", artifacts, **knobs)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    TREES_SEEN.clear()
    err, tv, got = _check(pair, _ChainOrTreeSeen(**fields), SAMPLING, joint)
    assert err < TOLERANCE, (err, tv, got.paths)
    assert any(TREES_SEEN) and not all(TREES_SEEN), TREES_SEEN


@pytest.mark.parametrize(("name", "top_p"), [("fixed", 0.8), ("tree", 0.8), ("marginal", 0.8)])
def test_top_p_sampling_is_lossless(name, top_p, pair, artifacts):
    sampling = SamplingConfig(temperature=1.0, top_p=top_p)
    want = target_joint(pair, PROMPT, sampling, N_TOKENS)
    assert sum(v == 0 for v in want.values()) > 0  # top-p really cuts tokens here
    err, tv, _ = _check(pair, _policy(name, artifacts), sampling, want)
    assert err < TOLERANCE, (name, top_p, err, tv)


def test_marginal_with_online_calibration_is_lossless(pair, artifacts, joint):
    """calibrate=True learns P(accept | q) from each step, so the rule changes along a path."""
    err, tv, got = _check(pair, _policy("marginal", artifacts, calibrate=True), SAMPLING, joint)
    assert err < TOLERANCE, (err, tv)
    assert {0, 1, 2} <= set(got.proposal_sizes)
    # What it learned changed some decisions: not the proposals of the rule without it.
    _, _, plain = _check(pair, _policy("marginal", artifacts), SAMPLING, joint)
    assert got.proposal_sizes != plain.proposal_sizes


@dataclass
class OldConfidencePolicy(Policy):
    """The rule this issue removed: sample x ~ q, then drop it when q(x) < threshold."""

    threshold: float = 0.45
    max_k: int = 2
    name = "old-confidence"

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        cands = Candidates()
        probs = drafter.begin(committed)
        for j in range(self.max_k):
            token = drafter.sample(probs)
            if j > 0 and float(probs[token]) < self.threshold:
                break
            cands.tokens.append(token)
            cands.parents.append(j - 1)
            cands.q.append(probs)
            cands.confidences.append(float(probs[token]))
            if j + 1 < self.max_k:
                probs = drafter.extend(token)
        return cands


def test_the_harness_catches_the_old_confidence_rule(pair, joint):
    err, tv, got = _check(pair, OldConfidencePolicy(), SAMPLING, joint)
    print(f"old confidence rule: max abs error {err:.4f}, TV {tv:.4f} over {got.paths} paths")
    assert tv > 0.01 and err > 100 * TOLERANCE, (err, tv)


# --- `batch` at batch > 1 ----------------------------------------------------------------


class _OneNeighbourEconomy(BatchEconomy):
    """The batch economy of a batch of two, as the enumerated generation sees it: each of its
    plans opens a step (the verification pass before it observed), planned with the
    neighbour's acceptance by depth of the step before (``schedule``, cycled), after which
    the neighbour asks for its own length. The enumerated generation asks under one fixed key
    (the harness copies its policy, so ``id(policy)`` changes from copy to copy)."""

    NEIGHBOUR, SELF = "neighbour", "enumerated"

    def __init__(self, cost, schedule: list[list[float]], max_k: int) -> None:
        super().__init__(cost)
        self.schedule, self.max_k = schedule, max_k
        super().plan(self.NEIGHBOUR, schedule[0], max_k, len(PROMPT))

    def plan(self, key, accept: list[float], max_k: int, context: int) -> int:
        self.observe(BatchRecord("target", 2, 2, [], 0, 0, 1.0))
        k = super().plan(self.SELF, accept, max_k, context)
        step = self._steps
        neighbour = self.schedule[step % len(self.schedule)]
        super().plan(self.NEIGHBOUR, neighbour, self.max_k, len(PROMPT) + step)
        return k

    def __deepcopy__(self, memo):  # the lock is not state (and cannot be copied)
        new = copy.copy(self)
        memo[id(self)] = new
        for name, value in vars(self).items():
            if name != "_lock":
                setattr(new, name, copy.deepcopy(value, memo))
        new._lock = threading.Lock()
        return new


@dataclass
class _Neighbourhood:
    """What BatchPolicy reads of its drafter's batcher: the participants and the economy."""

    economy: _OneNeighbourEconomy
    participants: int = 2
    economy_lock: Any = field(default_factory=nullcontext)


# The neighbour's acceptance by depth over its steps: copying, then hopeless, then middling.
NEIGHBOUR_SCHEDULE = [[0.95, 0.95], [0.1, 0.1], [0.6, 0.8]]


def test_the_batch_policy_at_batch_two_samples_the_target_distribution_exactly(
    pair, artifacts, joint
):
    """`batch` with a batch cost model and a neighbour in the batch takes its chain lengths
    from the batch's plan (pipeline.decode.batch_economy), not from its batch-1 rule: each
    step's plan weighs its own acceptance by depth against the neighbour's, the real
    BatchEconomy and plan_lengths, enumerated exactly like every policy above. The neighbour's
    acceptance follows a fixed schedule: whatever a neighbour does comes from its own draws
    (independent of this generation's) and this generation's past, both known before this
    generation's step draws, so exactness for every schedule is exactness in a real batch.
    (What the harness cannot copy is the batched engine itself, threads and packed forwards:
    that a generation in one decodes as it would alone is tests/test_batched_decoding.py.)"""
    spec = pair.spec
    batch = BatchCost(
        b0=3.0,
        b_pos=0.3,
        b_union=0.4,
        b_ctx=0.0,
        d0=0.8,
        d_tok=0.25,
        s0=0.5,
        s_row=0.7,
        experts=spec.num_experts,
        top_k=spec.top_k,
        union_decay=0.9,
    )
    cost = dataclasses.replace(artifacts.cost, meta={"batch": batch.to_json()})
    batched = dataclasses.replace(artifacts, cost=cost)
    policy = _policy("batch", batched)
    economy = _OneNeighbourEconomy(batch, NEIGHBOUR_SCHEDULE, policy.max_k)

    def join(session) -> None:
        session.drafter.batcher = _Neighbourhood(economy)

    got = enumerate_outputs(pair, PROMPT, policy, SAMPLING, N_TOKENS, prepare=join)
    assert sum(got.distribution.values()) == pytest.approx(1.0, abs=1e-9)
    err, tv = compare(got.distribution, joint)
    assert err < TOLERANCE, (err, tv, got.paths)
    assert {0, 1, 2} <= set(got.proposal_sizes), got.proposal_sizes
    # The plan decided: not the proposals of the same policy alone (its batch-1 rule).
    _, _, alone = _check(pair, _policy("batch", batched), SAMPLING, joint)
    assert got.proposal_sizes != alone.proposal_sizes, (got.proposal_sizes, alone.proposal_sizes)
