"""The policy interface (one small interface, as transformers' candidate generators separate
proposing from adapting) and the chain drafting most policies share.

A policy class declares its knobs (``knobs``, pipeline.decode.policies.knobs) and how it is
built from validated knobs (``from_knobs``); the registry lists the classes once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pipeline.decode.drafter import Drafter
from pipeline.decode.policies.knobs import Knob, KnobError
from pipeline.decode.policies.labels import PolicyLabel
from pipeline.decode.step_limits import StepWork
from pipeline.decode.types import Candidates, StepOutcome

if TYPE_CHECKING:
    from pipeline.acceptance.model import AcceptanceModel
    from pipeline.cost.model import CostModel
    from pipeline.decode.policies.artifacts import PolicyArtifacts


class Policy:
    name: ClassVar[str] = "policy"
    summary: ClassVar[str] = ""
    # default, peer or experimental (pipeline.decode.policies.labels): declared by each
    # registered class itself, never inherited; the registry refuses a class without one.
    label: ClassVar[PolicyLabel | None] = None
    knobs: ClassVar[tuple[Knob, ...]] = ()
    # True: built from PolicyArtifacts (expert predictor, cost model, lambda).
    needs_artifacts: ClassVar[bool] = False

    @classmethod
    def from_knobs(cls, artifacts: PolicyArtifacts | None, **knobs: Any) -> Policy:
        """The policy from validated knobs (the registry checked names, types and ranges)."""
        return cls(**knobs)

    def __post_init__(self) -> None:
        """Dataclass policies built directly (not through make_policy) are checked against the
        same declared knobs; a knob left None is resolved by the policy itself."""
        for knob in self.knobs:
            value = getattr(self, knob.name, None)
            if value is None:
                continue
            problem = knob.type_error(value) or knob.range_error(value)
            if problem:
                raise KnobError(f"{self.name}: {problem}", knob.name)

    def reset(self) -> None:
        """Called at the start of every generation."""

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        raise NotImplementedError

    def step_work(self) -> StepWork:
        """The most work one step can do with these knobs (pipeline.decode.step_limits):
        an exact upper bound, which servers check against their limits before decoding."""
        raise NotImplementedError(f"{self.name} does not declare its step work")

    def update(self, outcome: StepOutcome) -> None:
        """Adapt from the last step (most policies do not)."""


class AcceptanceChainPolicy(Policy):
    """A chain policy priced by the cost model with the acceptance model learned offline
    (`throughput`, `batch`): built from the artifacts' cost and acceptance models, its max_k
    resolved against what the cost model prices. Subclasses are dataclasses whose first fields
    are ``cost``, ``acceptance`` and ``max_k``."""

    DEFAULT_MAX_K: ClassVar[int] = 12
    needs_artifacts: ClassVar[bool] = True

    @classmethod
    def from_knobs(cls, artifacts: PolicyArtifacts | None, **knobs: Any) -> Policy:
        acceptance = require_acceptance(cls.name, artifacts)
        assert artifacts is not None
        return cls(artifacts.cost, acceptance, **knobs)  # type: ignore[call-arg]

    def __post_init__(self) -> None:
        super().__post_init__()
        self.max_k = resolve_max_k(self.name, self.cost, self.max_k, self.DEFAULT_MAX_K)
        self.reset()


def require_acceptance(name: str, artifacts: PolicyArtifacts | None) -> AcceptanceModel:
    """The acceptance model a policy reads, or an error that says how to train one."""
    if artifacts is None or artifacts.acceptance is None:
        raise ValueError(
            f"{name} needs an acceptance model (acceptance.json): train one with "
            "python -m jobs.train_acceptance"
        )
    return artifacts.acceptance


def resolve_max_k(name: str, cost: CostModel, max_k: int | None, default: int) -> int:
    """A cost-aware chain policy's max_k: None takes the cost model's largest m - 1, at most
    ``default``; a value the cost model cannot price (it needs m up to max_k + 1) is an error
    naming the m it lacks."""
    if max_k is None:
        max_k = min(default, cost.max_m - 1)
    need = range(1, max_k + 2)
    if max_k < 1 or cost.missing_m(need):
        raise ValueError(
            f"{name}: max_k must lie in [1, {cost.max_m - 1}] (the cost model's largest m - 1), "
            f"got {max_k}: " + cost.missing_m_message(need)
        )
    return max_k


def draft_chain(
    drafter: Drafter, committed: list[int], k: int, min_conf: float = 0.0
) -> Candidates:
    """Up to k draft tokens, sampled (or argmax when greedy). With ``min_conf`` the chain stops
    before position j >= 1 once the draft's confidence max q at j falls below it (at least one
    token is drafted).

    The stop is decided from the distribution before sampling, never from the sampled token:
    verification assumes every drafted x ~ q, and dropping a drawn token for its low q(x)
    would leave the kept ones following a truncated q (a biased output). At T = 0 the sample
    is the argmax, so this is the same rule as testing the drafted token. Draft forwards: k
    for a full chain, k + 1 for one that looked at position k and stopped.
    """
    cands = Candidates()
    probs = drafter.begin(committed)
    for j in range(k):
        if j > 0 and float(probs.max()) < min_conf:
            break
        token = drafter.sample(probs)
        cands.extend_chain(token, probs, drafter.sampling.greedy)
        if j + 1 < k:
            probs = drafter.extend(token)
    return cands
