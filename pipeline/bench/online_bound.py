"""The oracle's bound for text an online policy actually generated, and the oracle-replay
check.

``sequence_bounds`` extracts the oracle's inputs (draft confidences, routing, junk tails) for
generated sequences in this process and solves the Bellman problem with a given cost model, so
an online policy's measured speedup can be set against the best any draft-length policy could
do on the same text ("fraction of the bound captured").

``replay`` feeds the oracle's k*(i) along a greedy reference: with exact-greedy
acceptance every transition is deterministic, so the engine must visit exactly the states the
oracle's visitation marks, accept exactly the oracle's a at each, and spend, within the cost
model's error, the oracle's dp[0].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from pipeline.cost.model import CostModel
from pipeline.data.references import ReferenceSequence
from pipeline.decode.engine import DecodeSession, SpeculativeEngine
from pipeline.decode.policies.replay import ReplayPolicy
from pipeline.extract.rows import extract_sequence
from pipeline.models.loading import ModelPair
from pipeline.oracle.bellman import OracleSolution, acceptance_table, ar_cost, cost_table, solve
from pipeline.oracle.fanout import SequenceInput, inputs_from_tables


@dataclass
class SequenceBound:
    seq: SequenceInput
    solution: OracleSolution
    cost: np.ndarray  # [N, lmax, lmax + 1] Cost(i, k, a) in ms
    ar_ms: float

    @property
    def dp0_ms(self) -> float:
        return float(self.solution.dp[0])


@dataclass
class BoundResult:
    sequences: list[SequenceBound]
    acceptance: str
    lmax: int

    @property
    def ar_ms(self) -> float:
        return sum(s.ar_ms for s in self.sequences)

    @property
    def dp_ms(self) -> float:
        return sum(s.dp0_ms for s in self.sequences)

    @property
    def speedup(self) -> float:
        """Pooled S = total AR cost / total optimal cost."""
        return self.ar_ms / self.dp_ms


def sequence_bounds(
    pair: ModelPair,
    prompts: list[list[int]],
    outputs: list[list[int]],
    cost: CostModel,
    lmax: int,
    acceptance: str,
    seed: int = 0,
) -> BoundResult:
    """The oracle on ``prompts[j] + outputs[j]`` (``acceptance``: "greedy" or "surrogate")."""
    if acceptance not in ("greedy", "surrogate"):
        raise ValueError(f"acceptance must be 'greedy' or 'surrogate', got {acceptance!r}")
    cost.require_m(range(1, lmax + 2), f"the bound at Lmax {lmax}")
    tables = []
    for j, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        if not out:
            continue
        ref = ReferenceSequence(f"gen-{j}", "generated", "generated", tuple(prompt), tuple(out))
        tables.append(extract_sequence(pair, ref, lmax, "shared", seed))
    cat = lambda name: pa.concat_tables([getattr(t, name) for t in tables])  # noqa: E731
    inputs = inputs_from_tables(cat("sequences"), cat("tokens"), cat("tails"), pair.spec, lmax)
    bounds = []
    for seq in inputs:
        p = seq.draft_match if acceptance == "greedy" else seq.draft_prob
        n_lmax = seq.union.shape[1]
        probs = acceptance_table(p, n_lmax)
        costs = cost_table(cost, seq.union, seq.prompt_len)
        sol = solve(probs, costs, seq.union)
        bounds.append(SequenceBound(seq, sol, costs, ar_cost(cost, seq.token_experts,
                                                              seq.prompt_len)))  # fmt: skip
    return BoundResult(bounds, acceptance, lmax)


@dataclass
class ReplayReport:
    states: list[int] = field(default_factory=list)  # visited states
    k: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    oracle_accepted: list[int] = field(default_factory=list)  # a the oracle's P(a|k) puts 1 on
    modelled_ms: list[float] = field(default_factory=list)  # Cost(i, k, a) of the oracle
    # The same cost model with the experts the pass really used (the oracle's U comes from
    # sampled junk tails; online, the rejected tokens are the draft's argmax ones).
    modelled_online_u_ms: list[float] = field(default_factory=list)
    measured_ms: list[float] = field(default_factory=list)  # t_draft + t_verify of the step
    output: list[int] = field(default_factory=list)

    @property
    def relative_error(self) -> float:
        return sum(self.measured_ms) / sum(self.modelled_ms) - 1.0

    @property
    def relative_error_online_u(self) -> float:
        return sum(self.measured_ms) / sum(self.modelled_online_u_ms) - 1.0


def replay(pair: ModelPair, bound: SequenceBound, prompt: list[int], cost: CostModel,
           repeats: int = 1) -> ReplayReport:  # fmt: skip
    """Decode greedily with the oracle's k* along ``bound``'s (greedy) sequence; ``cost`` is
    the model the bound was priced with."""
    sol, n = bound.solution, len(bound.solution.k_star)
    policy = ReplayPolicy(sol.k_star, len(prompt))
    session: DecodeSession = SpeculativeEngine(pair).start(prompt, policy, repeats=repeats)
    report = ReplayReport()
    probs = acceptance_table(bound.seq.draft_match, bound.cost.shape[1])
    while len(session.generated) < n:
        i = len(session.generated)
        k = int(sol.k_star[i])
        session.step()
        step = session.steps[-1]
        a = step.accepted
        report.states.append(i)
        report.k.append(k)
        report.accepted.append(a)
        report.oracle_accepted.append(int(np.argmax(probs[i, k - 1])))
        report.modelled_ms.append(float(bound.cost[i, k - 1, a]))
        report.modelled_online_u_ms.append(
            cost.t_draft(k) + cost.t_target(k + 1, step.u_bar, bound.seq.prompt_len + i)
        )
        report.measured_ms.append(step.t_draft_ms + step.t_verify_ms)
    report.output = session.generated[:n]
    return report
