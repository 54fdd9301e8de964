"""The policies that need nothing but the draft:

ar          no draft: plain autoregressive steps through the same engine
fixed       a chain of K tokens
heuristic   transformers' schedule: K += 2 after a fully accepted chain, else K -= 1
confidence  extend the chain while the draft's confidence (its largest probability at the
            next position, judged before sampling) stays >= a threshold
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.decode.drafter import Drafter
from pipeline.decode.policies.base import Policy, draft_chain
from pipeline.decode.policies.knobs import Knob, step_knob
from pipeline.decode.policies.labels import peer
from pipeline.decode.step_limits import StepWork, chain_work
from pipeline.decode.types import Candidates, StepOutcome


class AutoregressivePolicy(Policy):
    name = "ar"
    label = peer("none: plain autoregressive decoding, the baseline")
    summary = "no draft: plain autoregressive steps through the same engine"

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        return Candidates()

    def step_work(self) -> StepWork:
        return chain_work(0, "no draft")


@dataclass
class FixedPolicy(Policy):
    k: int = 4
    name = "fixed"
    label = peer("fixed K: speculative decoding, Leviathan et al. 2023; Chen et al. 2023")
    summary = "a chain of k draft tokens"
    knobs = (step_knob("k", 4, "draft tokens per step"),)

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        return draft_chain(drafter, committed, self.k)

    def step_work(self) -> StepWork:
        return chain_work(self.k, f"k {self.k}")


@dataclass
class HeuristicPolicy(Policy):
    """transformers' "heuristic" schedule for num_assistant_tokens."""

    start_k: int = 5
    max_k: int = 20
    name = "heuristic"
    label = peer("transformers' assisted generation, heuristic num_assistant_tokens schedule")
    summary = "transformers' schedule: k += 2 after a fully accepted chain, else k -= 1"
    knobs = (
        step_knob("start_k", 5, "k of a generation's first step"),
        step_knob("max_k", 20, "largest k the schedule reaches"),
    )

    def reset(self) -> None:
        self.k = self.start_k

    def step_work(self) -> StepWork:
        # k starts at start_k and update() never takes it above max(start_k, max_k).
        return chain_work(
            max(self.start_k, self.max_k), f"start_k {self.start_k}, max_k {self.max_k}"
        )

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        return draft_chain(drafter, committed, self.k)

    def update(self, outcome: StepOutcome) -> None:
        if outcome.accepted == len(outcome.candidates):
            self.k = min(self.max_k, self.k + 2)
        else:
            self.k = max(1, self.k - 1)


@dataclass
class ConfidencePolicy(Policy):
    threshold: float = 0.4
    max_k: int = 10
    name = "confidence"
    label = peer(
        "transformers' assistant_confidence_threshold, not adapted (after DISCO, Mamou et al. 2024)"
    )
    summary = "extend the chain while the draft's confidence stays >= threshold"
    knobs = (
        Knob(
            "threshold",
            float,
            0.4,
            0.0,
            1.0,
            help="least draft confidence (max q at the next position) to go on",
        ),
        step_knob("max_k", 10, "longest chain"),
    )

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        return draft_chain(drafter, committed, self.max_k, min_conf=self.threshold)

    def step_work(self) -> StepWork:
        return chain_work(self.max_k, f"max_k {self.max_k}")
