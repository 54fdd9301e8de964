"""SpecDec++-style stopping (Huang et al. 2024; a peer in the domain benchmark): an acceptance
head on the draft's hidden state predicts each drafted token's acceptance, and the chain stops
once the probability that some drafted token is rejected, 1 - prod_j P(accept_j), exceeds a
threshold h.

The head is a logistic regression over the draft's last-layer state that produced the token's
distribution (already computed: no extra forward), trained by jobs.train_acceptance on the
same traces as our policy's acceptance model (acceptance.json). The decision after drafting
x_j concerns only tokens after it, so the chain runs exactly k draft forwards and stays
lossless.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.acceptance.model import AcceptanceModel
from pipeline.decode.drafter import Drafter
from pipeline.decode.policies.base import Policy, require_acceptance
from pipeline.decode.policies.knobs import Knob, step_knob
from pipeline.decode.policies.labels import default
from pipeline.decode.step_limits import StepWork, chain_work
from pipeline.decode.types import Candidates

if TYPE_CHECKING:
    from pipeline.decode.policies.artifacts import PolicyArtifacts


@dataclass
class SpecDecPolicy(Policy):
    acceptance: AcceptanceModel
    threshold: float = 0.5
    max_k: int = 12
    name = "specdec"
    label = default("T > 0", follows="SpecDec++, Huang et al. 2024")
    summary = "SpecDec++-style: stop once P(some drafted token is rejected) > threshold"
    needs_artifacts = True
    knobs = (
        Knob(
            "threshold",
            float,
            0.5,
            0.0,
            1.0,
            low_open=True,
            help="stop once the chance that a drafted token is rejected exceeds it",
        ),
        step_knob("max_k", 12, "longest chain"),
    )

    @classmethod
    def from_knobs(cls, artifacts: PolicyArtifacts | None, **knobs: Any) -> Policy:
        return cls(require_acceptance(cls.name, artifacts), **knobs)

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        cands = Candidates()
        greedy = drafter.sampling.greedy
        probs = drafter.begin(committed)
        p_all = 1.0
        for j in range(self.max_k):
            state = drafter.hidden[-1]  # the state that produced `probs`
            token = drafter.sample(probs)
            cands.extend_chain(token, probs, greedy)
            p_all *= self.acceptance.head_probability(greedy, state)
            if j + 1 == self.max_k or 1.0 - p_all > self.threshold:
                break
            probs = drafter.extend(token)
        return cands

    def step_work(self) -> StepWork:
        return chain_work(self.max_k, f"max_k {self.max_k}")
