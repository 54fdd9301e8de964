"""Cascade (utility-driven draft length for MoE targets; a peer in bench_online's domain benchmark).

A cycle has a *test* phase, where each K of the ladder 1, 2, 4, ..., max_k (in that order)
drafts a chain of K for ``test_steps`` steps, and a *set* phase of ``set_steps`` steps at the K
of highest utility, or at K = 0 (plain steps, no draft) when no utility exceeds 1: speculation
switches itself off where it does not pay. The utility of K is the AR price of the tokens its
steps produced over the price of those steps (T_D of the draft forwards + T_T at their m,
unique experts and context), both from the calibrated cost model: > 1 when K beats plain
decoding. Prices rather than timings, so a timer burst cannot flip the choice. Cycles repeat
through a generation, as the text's difficulty drifts; each generation starts afresh.

Draft work per step: a chain of at most max_k; its first forward feeds the catch-up on the
tokens committed since the draft last ran: the last chain step's (at most max_k + 1, since
the test phase ends on max_k) and, after a set phase of plain steps, those steps' set_steps.

The schedule advances in update(), not propose(): a session timing a step several times
proposes it several times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.cost.model import CostModel
from pipeline.decode.drafter import Drafter
from pipeline.decode.policies.base import Policy, draft_chain, resolve_max_k
from pipeline.decode.policies.knobs import Knob, step_knob
from pipeline.decode.policies.labels import peer
from pipeline.decode.step_limits import StepWork
from pipeline.decode.types import Candidates, StepOutcome

if TYPE_CHECKING:
    from pipeline.decode.policies.artifacts import PolicyArtifacts

DEFAULT_MAX_K = 8


def ladder(max_k: int) -> list[int]:
    """The K tested each cycle: powers of two below max_k, and max_k."""
    out, k = [], 1
    while k < max_k:
        out.append(k)
        k *= 2
    return [*out, max_k]


@dataclass
class CascadePolicy(Policy):
    cost: CostModel
    max_k: int | None = None  # None: the cost model's largest m - 1, at most DEFAULT_MAX_K
    test_steps: int = 2
    set_steps: int = 24
    name = "cascade"
    label = peer("Cascade: utility-driven draft length for MoE targets")
    summary = (
        "Cascade: test each K briefly, then run the K of best utility (AR price over "
        "step price); no draft when none pays"
    )
    needs_artifacts = True
    knobs = (
        step_knob(
            "max_k",
            None,
            f"largest K tested (default: the cost model's largest m - 1, at most {DEFAULT_MAX_K})",
        ),
        Knob("test_steps", int, 2, 1, 64, help="steps each tested K runs per cycle"),
        Knob("set_steps", int, 24, 1, 128, help="steps at the chosen K before testing again"),
    )
    # (K, utility) of every set phase, for inspection.
    choices: list[tuple[int, float]] = field(default_factory=list, init=False)

    @classmethod
    def from_knobs(cls, artifacts: PolicyArtifacts | None, **knobs: Any) -> Policy:
        assert artifacts is not None
        return cls(artifacts.cost, **knobs)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.max_k = resolve_max_k(self.name, self.cost, self.max_k, DEFAULT_MAX_K)
        self.reset()

    def reset(self) -> None:
        assert self.max_k is not None
        self._tests: list[int] = [k for k in ladder(self.max_k) for _ in range(self.test_steps)]
        self._todo: list[int] = list(self._tests)  # the K of each remaining step of the phase
        self._prices: dict[int, list[float]] = {}  # K -> [AR price of its tokens, its price]
        self._testing: bool = True
        self._ctx: int = 0
        self._top_k: int = 0

    @property
    def next_k(self) -> int:
        """The K of the next step."""
        if not self._todo:
            self._next_phase()
        return self._todo[0]

    def step_work(self) -> StepWork:
        assert self.max_k is not None
        k = self.max_k
        # Draft tokens: a K = 1 step after a plain set phase feeds max_k + 1 + set_steps; a
        # chain of k after a chain step feeds at most k + 1 then extends k - 1 times.
        tokens = max(k + 1 + self.set_steps, 2 * k)
        return StepWork(k, tokens, k + 1, f"max_k {k}, set_steps {self.set_steps}")

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        self._ctx = len(committed)
        self._top_k = drafter.pair.spec.top_k  # a plain step's union: what AR is priced at
        k = self.next_k
        return draft_chain(drafter, committed, k) if k else Candidates()

    def update(self, outcome: StepOutcome) -> None:
        k = self._todo.pop(0)
        if not self._testing:
            return
        record, cost, ctx = outcome.record, self.cost, float(self._ctx)
        ar = record.new_tokens * cost.t_target(1, float(self._top_k), ctx)
        spent = cost.t_draft(record.draft_forwards) + cost.t_target(
            record.verified, record.u_bar, ctx
        )
        prices = self._prices.setdefault(k, [0.0, 0.0])
        prices[0] += ar
        prices[1] += spent

    def _next_phase(self) -> None:
        if self._testing:
            utility = {k: ar / spent for k, (ar, spent) in self._prices.items() if spent > 0}
            best = max(utility, key=utility.get, default=0)
            k = best if utility.get(best, 0.0) > 1.0 else 0
            self.choices.append((k, utility.get(best, 1.0)))
            self._todo, self._testing = [k] * self.set_steps, False
        else:
            self._todo, self._testing, self._prices = list(self._tests), True, {}
