"""The oracle's bound for text an online policy actually generated, the oracle-replay check,
and the cost model's price of an online generation (for modelled/modelled fractions).

``sequence_bounds`` extracts the oracle's inputs (draft confidences, target probabilities,
routing, junk tails of one acceptance rule) for generated sequences in this process and solves
the Bellman problem with a given cost model, so an online policy's speedup can be set against
the best any draft-length policy could do on the same text ("fraction of the bound").

``replay`` feeds the oracle's k*(i) along a greedy reference: with exact-greedy acceptance and
greedy tails every transition is deterministic, so the engine must visit exactly the states the
oracle's visitation marks, accept exactly the oracle's a at each, verify exactly the experts of
the oracle's U(i, k, a), and spend, within the cost model's error, the oracle's dp[0].

``modelled_generation`` prices an online generation's own steps with the cost model
(T_D(draft forwards) + T_T(m, U, L) per step) beside the AR cost of the same text, so that an
online policy's modelled speedup and the bound are priced alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from pipeline.cost.model import CostModel
from pipeline.data.references import ReferenceSequence
from pipeline.decode.engine import DecodeSession, SpeculativeEngine
from pipeline.decode.policies.replay import ReplayPolicy
from pipeline.decode.types import StepRecord
from pipeline.extract.rows import extract_sequence
from pipeline.models.loading import ModelPair
from pipeline.oracle.bellman import OracleSolution, acceptance_table, ar_cost, cost_table, solve
from pipeline.oracle.fanout import crossfit_value
from pipeline.oracle.inputs import ACCEPTANCE_MODES, SequenceInput, inputs_from_tables


@dataclass
class SequenceBound:
    seq: SequenceInput
    acceptance: str
    solution: OracleSolution  # on tail draw 0
    probs: np.ndarray  # [N, lmax + 1, lmax + 1] P(a | k)
    cost: np.ndarray  # [N, lmax + 1, lmax + 1] Cost(i, k, a) in ms, draw 0's tails
    ar_ms: float
    dp0_ms: float  # in-sample optimum, averaged over the draws (greedy: the one exact value)
    dp0_crossfit_ms: float | None = None  # greedy: = dp0_ms; one stochastic draw: None

    @property
    def union(self) -> np.ndarray:
        return self.seq.union(self.acceptance, 0)


@dataclass
class BoundResult:
    sequences: list[SequenceBound]
    acceptance: str
    lmax: int
    plain_step: bool = True

    @property
    def ar_ms(self) -> float:
        return sum(s.ar_ms for s in self.sequences)

    @property
    def dp_ms(self) -> float:
        return sum(s.dp0_ms for s in self.sequences)

    @property
    def speedup(self) -> float:
        """Pooled in-sample S = total AR cost / total optimal cost: the bound."""
        return self.ar_ms / self.dp_ms

    @property
    def speedup_crossfit(self) -> float | None:
        """Pooled cross-fitted S (the achievable estimate); None without a second draw."""
        cross = [s.dp0_crossfit_ms for s in self.sequences]
        return None if any(c is None for c in cross) else self.ar_ms / sum(cross)


def sequence_bounds(
    pair: ModelPair,
    prompts: list[list[int]],
    outputs: list[list[int]],
    cost: CostModel,
    lmax: int,
    acceptance: str,
    seed: int = 0,
    plain_step: bool = True,
    draws: int | None = None,
    temperature: float = 1.0,
) -> BoundResult:
    """The oracle on ``prompts[j] + outputs[j]`` with ``acceptance`` (surrogate, greedy or
    sampling) priced with its own junk tails; ``draws`` independent tail draws (default: 1 for
    greedy, whose tails are deterministic, else 2 for the cross-fitted value)."""
    if acceptance not in ACCEPTANCE_MODES:
        raise ValueError(
            f"acceptance must be one of {', '.join(ACCEPTANCE_MODES)}, got {acceptance!r}"
        )
    draws = draws or (1 if acceptance == "greedy" else 2)
    cost.require_m(range(1, lmax + 2), f"the bound at Lmax {lmax}")
    tables = []
    for j, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        if not out:
            continue
        ref = ReferenceSequence(f"gen-{j}", "generated", "generated", tuple(prompt), tuple(out))
        tables.append(
            extract_sequence(
                pair,
                ref,
                lmax,
                "shared",
                seed,
                acceptances=(acceptance,),
                draws=draws,
                temperature=temperature,
            )
        )
    cat = lambda name: pa.concat_tables([getattr(t, name) for t in tables])  # noqa: E731
    inputs = inputs_from_tables(
        cat("sequences"), cat("tokens"), cat("tails"), pair.spec, lmax, [acceptance]
    )
    bounds = []
    for seq in inputs:
        probs = acceptance_table(seq.acceptance(acceptance), lmax, plain_step)
        unions = [seq.union(acceptance, d) for d in seq.draws(acceptance)]
        costs = [cost_table(cost, u, seq.prompt_len) for u in unions]
        sols = [solve(probs, c, u) for c, u in zip(costs, unions, strict=True)]
        dp0 = float(np.mean([s.dp[0] for s in sols]))
        cross = dp0 if acceptance == "greedy" else crossfit_value(probs, costs, sols)
        ar = ar_cost(cost, seq.token_experts, seq.prompt_len)
        bounds.append(SequenceBound(seq, acceptance, sols[0], probs, costs[0], ar, dp0, cross))
    return BoundResult(bounds, acceptance, lmax, plain_step)


@dataclass
class ReplayReport:
    states: list[int] = field(default_factory=list)  # visited states
    k: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    oracle_accepted: list[int] = field(default_factory=list)  # a the oracle's P(a|k) puts 1 on
    oracle_u: list[float] = field(default_factory=list)  # U(i, k, a) of the oracle's table
    online_u: list[float] = field(default_factory=list)  # experts the pass really verified
    modelled_ms: list[float] = field(default_factory=list)  # Cost(i, k, a) of the oracle
    # The same cost model with the draft forwards and experts the step really ran.
    modelled_online_u_ms: list[float] = field(default_factory=list)
    measured_ms: list[float] = field(default_factory=list)  # t_draft + t_verify of the step
    output: list[int] = field(default_factory=list)

    @property
    def relative_error(self) -> float:
        return sum(self.measured_ms) / sum(self.modelled_ms) - 1.0


def step_cost(cost: CostModel, rec: StepRecord, ctx_len: int) -> float:
    """What the cost model says a decoding step cost: T_D(draft forwards) + T_T(m, U, L)."""
    return cost.t_draft(rec.draft_forwards) + cost.t_target(rec.verified, rec.u_bar, ctx_len)


def replay(
    pair: ModelPair, bound: SequenceBound, prompt: list[int], cost: CostModel, repeats: int = 1
) -> ReplayReport:
    """Decode greedily with the oracle's k* (0: a plain step) along ``bound``'s greedy
    sequence; ``cost`` is the model the bound was priced with."""
    if bound.acceptance != "greedy":
        raise ValueError("replay follows the oracle's path only under greedy acceptance")
    sol, n = bound.solution, len(bound.solution.k_star)
    session: DecodeSession = SpeculativeEngine(pair).start(
        prompt, ReplayPolicy(sol.k_star, len(prompt)), repeats=repeats
    )
    report = ReplayReport()
    while len(session.generated) < n:
        i = len(session.generated)
        k = int(sol.k_star[i])
        session.step()
        step = session.steps[-1]
        a = step.accepted
        report.states.append(i)
        report.k.append(k)
        report.accepted.append(a)
        report.oracle_accepted.append(int(np.argmax(bound.probs[i, k])))
        report.oracle_u.append(float(bound.union[i, k, a]))
        report.online_u.append(step.u_bar)
        report.modelled_ms.append(float(bound.cost[i, k, a]))
        report.modelled_online_u_ms.append(step_cost(cost, step, bound.seq.prompt_len + i))
        report.measured_ms.append(step.t_draft_ms + step.t_verify_ms)
    report.output = session.generated[:n]
    return report


@dataclass(frozen=True)
class ModelledRun:
    """An online generation priced with the cost model, and the AR cost of its text."""

    step_ms: list[float]  # per step: T_D(draft forwards) + T_T(verified, U, L_prompt + i)
    states: list[int]  # i (generated tokens committed) before each step
    ar_ms: float  # sum_i T_T(1, |E(i)|, L_prompt + i) over the same text

    @property
    def policy_ms(self) -> float:
        return float(sum(self.step_ms))

    @property
    def speedup(self) -> float:
        """Modelled speedup, priced as the bound is: compare with BoundResult.speedup."""
        return self.ar_ms / self.policy_ms


def price_steps(
    steps: list[StepRecord], cost: CostModel, prompt_len: int
) -> tuple[list[float], list[int]]:
    """Each step's modelled cost and the state i it started from."""
    out, states, i = [], [], 0
    for rec in steps:
        out.append(step_cost(cost, rec, prompt_len + i))
        states.append(i)
        i += rec.new_tokens
    return out, states


def text_ar_cost(pair: ModelPair, prompt: list[int], tokens: list[int], cost: CostModel) -> float:
    """AR cost of ``prompt + tokens`` (x_1..x_N = tokens): N plain steps, each verifying one
    position, whose router selects exactly top_k distinct experts per layer (so no model pass
    is needed: |E(i)| = top_k)."""
    experts = np.full(len(tokens) + 1, float(pair.spec.top_k))
    return ar_cost(cost, experts, len(prompt))


def modelled_generation(
    pair: ModelPair, prompt: list[int], tokens: list[int], steps: list[StepRecord], cost: CostModel
) -> ModelledRun:
    """Price an online generation (its tokens and step records) with ``cost``, and the AR cost
    of the same text; the modelled/modelled fraction of the bound is
    ``run.speedup / bound.speedup`` with the bound on the same text and cost model."""
    step_ms, states = price_steps(steps, cost, len(prompt))
    return ModelledRun(step_ms, states, text_ar_cost(pair, prompt, tokens, cost))
