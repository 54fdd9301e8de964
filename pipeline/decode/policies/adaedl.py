"""AdaEDL (Agrawal et al. 2024; a training-free peer in the domain benchmark): stop drafting
once an entropy-based lower bound on the next token's acceptance probability,
1 - sqrt(gamma * H(q)), falls below a threshold lambda.

H(q) is the entropy (nats) of the draft's distribution at the next position, computed before
the token is sampled (so the stop never looks at the drawn token: lossless). As in the
paper the chain drafts at least one token; a chain that stops at k ran k + 1 draft forwards
(the look at position k + 1). The threshold is fixed here; the paper also adapts it from the
running acceptance rate, which this peer does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.acceptance.features import distribution_stats
from pipeline.decode.drafter import Drafter
from pipeline.decode.policies.base import Policy
from pipeline.decode.policies.knobs import Knob, step_knob
from pipeline.decode.policies.labels import peer
from pipeline.decode.step_limits import StepWork, chain_work
from pipeline.decode.types import Candidates

ENTROPY = 2  # its column in distribution_stats


@dataclass
class AdaEDLPolicy(Policy):
    gamma: float = 0.2
    lam: float = 0.3
    max_k: int = 12
    name = "adaedl"
    label = peer("AdaEDL, Agrawal et al. 2024 (fixed lambda)")
    summary = "AdaEDL: draft while 1 - sqrt(gamma * entropy) >= lambda"
    knobs = (
        Knob("gamma", float, 0.2, 0.0, 10.0, help="scale of the entropy in the bound"),
        Knob(
            "lam",
            float,
            0.3,
            0.0,
            1.0,
            title="lambda",
            help="least acceptance lower bound to go on drafting",
        ),
        step_knob("max_k", 12, "longest chain"),
    )

    def lower_bound(self, entropy: float) -> float:
        return 1.0 - math.sqrt(max(0.0, self.gamma * entropy))

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        cands = Candidates()
        probs = drafter.begin(committed)
        for j in range(self.max_k):
            if j > 0:
                entropy = float(distribution_stats(probs)[ENTROPY])
                if self.lower_bound(entropy) < self.lam:
                    break
            token = drafter.sample(probs)
            cands.extend_chain(token, probs, drafter.sampling.greedy)
            if j + 1 < self.max_k:
                probs = drafter.extend(token)
        return cands

    def step_work(self) -> StepWork:
        return chain_work(self.max_k, f"max_k {self.max_k}")
