"""The oracle-driven early-exit rule (docs/contract.md, "Online marginal rule").

While drafting a chain, with cumulative acceptance probability P_j and the draft's confidence
q (its largest probability) at the next position, adding a token gains dE[a] = P_j q expected
tokens and costs one draft step plus the growth of the verification time from m to m + 1
positions with the experts the most likely token is predicted to add to the pass's union (the
expert buffer). The chain stops as soon as dE[Cost] / dE[a] exceeds lambda, the boundary slope
the oracle found in delta space (policy.json). k = 0 (a plain step) is allowed. The test is
made before sampling (see propose), which keeps sampling lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.cost.model import CostModel
from pipeline.decode.policies.artifacts import PolicyArtifacts
from pipeline.decode.policies.base import Policy
from pipeline.decode.policies.knobs import Knob, step_knob
from pipeline.decode.policies.labels import peer
from pipeline.decode.step_limits import StepWork, chain_work
from pipeline.decode.types import Candidates, StepOutcome
from pipeline.predictor.model import ExpertPredictor

DEFAULT_MAX_K = 12


@dataclass
class MarginalStep:
    token: int
    d_accept: float
    d_cost_ms: float
    new_experts: float  # mean over layers of experts the token adds to the buffer

    @property
    def ratio(self) -> float:
        return self.d_cost_ms / self.d_accept if self.d_accept > 0 else float("inf")


class AcceptanceCalibrator:
    """P(accepted | draft confidence q), learned online from the policy's own verified drafts.

    The rule's dE[a] = P_j q treats the draft's confidence as the acceptance probability. Under
    greedy verification a token is accepted when it is the target's argmax, which happens far
    more often than a small draft's spread-out confidence says (and under sampling the rate is
    sum(min(p, q)), not q). Each bin of q keeps a Beta posterior shrunk (``prior`` pseudo-draws)
    towards the pooled acceptance rate of all bins, itself shrunk towards q: with no evidence
    this is docs/contract.md's rule exactly, and a bin the rule stopped drafting into (so never sees
    verified) borrows the pooled rate instead of staying stuck at its raw confidence.
    """

    def __init__(self, bins: int = 10, prior: float = 4.0) -> None:
        self.bins, self.prior = bins, prior
        self.hits = np.zeros(bins)
        self.trials = np.zeros(bins)

    def _bin(self, q: float) -> int:
        return min(int(q * self.bins), self.bins - 1)

    def __call__(self, q: float) -> float:
        b = self._bin(q)
        pooled = (self.hits.sum() + self.prior * q) / (self.trials.sum() + self.prior)
        return float((self.hits[b] + self.prior * pooled) / (self.trials[b] + self.prior))

    def observe(self, q: float, accepted: bool) -> None:
        b = self._bin(q)
        self.trials[b] += 1
        self.hits[b] += accepted


@dataclass
class MarginalPolicy(Policy):
    cost: CostModel
    lam: float
    predictor: ExpertPredictor
    # None: the cost model's largest m - 1, at most DEFAULT_MAX_K. A larger explicit value is
    # an error naming the m the cost model lacks.
    max_k: int | None = None
    calibrate: bool = False  # True: learn P(accept | q) online instead of using q itself
    name = "marginal"
    label = peer("the bound paper's marginal rule: stop past its delta-space slope lambda")
    summary = (
        "the bound paper's marginal rule (a peer): grow the chain while dE[Cost] / dE[a] "
        "<= lambda (the oracle's slope)"
    )
    needs_artifacts = True
    knobs = (
        Knob(
            "lam",
            float,
            None,
            0.0,
            low_open=True,
            title="lambda",
            help="ms of expected cost per expected token (default: the oracle's policy.json)",
        ),
        step_knob(
            "max_k",
            None,
            f"longest chain (default: the cost model's largest m - 1, at most {DEFAULT_MAX_K})",
        ),
        Knob("calibrate", bool, False, help="learn P(accept | q) online from verified drafts"),
    )
    trace: list[MarginalStep] = field(default_factory=list)

    @classmethod
    def from_knobs(cls, artifacts: PolicyArtifacts | None, **knobs: Any) -> Policy:
        assert artifacts is not None
        lam = knobs.pop("lam", None)
        return cls(
            artifacts.cost, artifacts.lam if lam is None else lam, artifacts.predictor, **knobs
        )

    def __post_init__(self) -> None:
        super().__post_init__()  # lambda > 0, max_k in range when given
        if self.max_k is None:
            self.max_k = min(DEFAULT_MAX_K, self.cost.max_m - 1)
        if self.max_k < 1:
            raise ValueError(f"marginal: max_k must be >= 1, got {self.max_k}")
        need = range(1, self.max_k + 2)
        if self.cost.missing_m(need):
            raise ValueError(
                f"marginal: max_k must lie in [1, {self.cost.max_m - 1}] (the cost model's "
                f"largest m - 1), got {self.max_k}: " + self.cost.missing_m_message(need)
            )
        # Kept across generations: what it learns about the draft carries over.
        self.acceptance = AcceptanceCalibrator()

    def accept_probability(self, q: float) -> float:
        return self.acceptance(q) if self.calibrate else q

    def step_work(self) -> StepWork:
        # A chain of at most max_k (a stop at k < max_k ran k + 1 <= max_k forwards).
        assert self.max_k is not None  # resolved in __post_init__
        return chain_work(self.max_k, f"max_k {self.max_k}")

    def propose(self, drafter, committed: list[int]) -> Candidates:
        """Before drafting position j the rule prices the draft's most likely token there (its
        confidence max q and its predicted experts) and stops if the ratio exceeds lambda;
        only then it samples x ~ q and appends it, so that drafted tokens follow q exactly
        (verification assumes it). P_j and the buffer then grow with the drafted x. At T = 0
        x is the most likely token: the rule prices exactly what it drafts. Draft forwards:
        k + 1 for a chain that stopped at k (1 for a plain step), max_k for a full one."""
        cands = Candidates()
        self.trace = []
        ctx = len(committed)
        probs = drafter.begin(committed)
        # The pass verifies the last committed token too: its experts seed the buffer.
        root = self.predictor.predict(committed[-1], drafter.root_context)
        buffer = [set(row.tolist()) for row in root]
        u = float(np.mean([len(b) for b in buffer]))
        p_all, m = 1.0, 1
        for j in range(self.max_k):
            context = drafter.hidden[-1]  # the state that produced `probs`
            top = int(probs.argmax())
            grown, u_next = self._grow(buffer, top, context)
            # Forwards run: j + 1 if the chain stops here (this look included), j + 2 if the
            # token is drafted and the next position looked at (no look past max_k): the
            # look's own forward and the draft's fixed cost b are sunk either way.
            more = j + 2 if j + 1 < self.max_k else j + 1
            d_draft = self.cost.t_draft(more) - self.cost.t_draft(j + 1)
            d_cost = d_draft + (
                self.cost.t_target(m + 1, u_next, ctx) - self.cost.t_target(m, u, ctx)
            )
            step = MarginalStep(
                top, p_all * self.accept_probability(float(probs[top])), d_cost, u_next - u
            )
            self.trace.append(step)
            if step.ratio > self.lam:
                break
            token = drafter.sample(probs)
            if token != top:  # what is drafted, not what was priced, carries over
                grown, u_next = self._grow(buffer, token, context)
            q = float(probs[token])
            cands.extend_chain(token, probs, drafter.sampling.greedy)
            p_all, m, buffer, u = p_all * self.accept_probability(q), m + 1, grown, u_next
            if j + 1 < self.max_k:
                probs = drafter.extend(token)
        return cands

    def _grow(self, buffer: list[set[int]], token: int, context) -> tuple[list[set[int]], float]:
        """The buffer with ``token``'s predicted experts added, and its mean size per layer."""
        predicted = self.predictor.predict(token, context)
        grown = [b | set(row.tolist()) for b, row in zip(buffer, predicted, strict=True)]
        return grown, float(np.mean([len(b) for b in grown]))

    def update(self, outcome: StepOutcome) -> None:
        # A chain's first `accepted` tokens were accepted and the next one (if any) rejected;
        # later ones were never judged.
        confidences = outcome.candidates.confidences
        for j, q in enumerate(confidences[: outcome.accepted + 1]):
            self.acceptance.observe(q, j < outcome.accepted)
