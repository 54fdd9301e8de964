"""`batch` (ours, batch > 1): draft lengths chosen for the whole continuous batch at once.

In a batch (pipeline.decode.batching) generations share every forward: a draft round is one
packed forward for all the generations drafting in it, and a verification pass loads the
union of experts over every generation's positions, so one more position costs only the
experts no other position brings. What matters is the batch's tokens per ms, not one
generation's. Each step this policy asks the batch's economy (pipeline.decode.batch_economy)
for its chain length: the plan that maximises the batch's rate over the number of draft
rounds and every generation's chain, from each one's recent acceptance, the measured round
costs and the batch cost model (the "batch" section of costmodel.json, jobs.calibrate_batch).
Drafting is then a plain chain: no per-token decision, whose work each generation would do
one after another while the others wait.

Alone (batch 1, or no batch model) it picks the k that minimises the batch-1 cost model's
cost per token at its recent acceptance. Every ``probe_every`` plain steps in a row it drafts
one token anyway, so recent acceptance keeps being measured (and the draft's catch-up stays
bounded). Lengths are decided from past outcomes only: lossless at any temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.acceptance.model import AcceptanceModel
from pipeline.cost.model import CostModel
from pipeline.decode.batch_economy import BatchEconomy, expected
from pipeline.decode.drafter import Drafter
from pipeline.decode.policies.base import AcceptanceChainPolicy, draft_chain
from pipeline.decode.policies.knobs import Knob, step_knob
from pipeline.decode.policies.labels import EXPERIMENTAL
from pipeline.decode.step_limits import StepWork
from pipeline.decode.types import Candidates, StepOutcome

DEFAULT_MAX_K = AcceptanceChainPolicy.DEFAULT_MAX_K
DECAY = 0.9  # per judged token at a depth
DEEP_PRIOR = 0.9
PRIOR_WEIGHT = 2.0  # judged tokens' worth of the acceptance model's training mean


@dataclass
class BatchPolicy(AcceptanceChainPolicy):
    cost: CostModel
    acceptance: AcceptanceModel
    max_k: int | None = None
    probe_every: int = 8
    name = "batch"
    label = EXPERIMENTAL
    summary = (
        "ours at batch > 1: every generation's chain length planned for the batch's "
        "tokens per ms (shared draft rounds, the shared expert union)"
    )
    knobs = (
        step_knob(
            "max_k",
            None,
            f"longest chain (default: the cost model's largest m - 1, at most {DEFAULT_MAX_K})",
        ),
        Knob(
            "probe_every",
            int,
            8,
            1,
            64,
            help="plain steps in a row before one that drafts a token anyway",
        ),
    )

    def reset(self) -> None:
        # Decayed counts of drafted tokens judged and accepted at each chain depth: at T = 0
        # acceptance is bursty (a chain that survives its first tokens is copying), so the
        # chance of token j given the ones before it grows with j; a single rate would not say.
        assert self.max_k is not None
        self._judged = [0.0] * self.max_k
        self._hits = [0.0] * self.max_k
        self._plain_run = 0
        self.lengths: list[int] = []  # the chain length of every step (inspection)

    def step_work(self) -> StepWork:
        k = self.max_k
        assert k is not None
        return StepWork(
            k, 2 * k + self.probe_every, k + 1, f"max_k {k}, probe_every {self.probe_every}"
        )

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        prior = self.acceptance.mode(drafter.sampling.greedy).prior
        # Past the first token the prior is optimistic (a chain that survives is likely
        # copying): a depth the generation has not tried yet gets tried, then measured.
        priors = [prior] + [DEEP_PRIOR] * (len(self._hits) - 1)
        accept = [
            (h + PRIOR_WEIGHT * p) / (n + PRIOR_WEIGHT)
            for h, n, p in zip(self._hits, self._judged, priors, strict=True)
        ]
        k = self._length(drafter, accept, len(committed))
        if k == 0 and self._plain_run >= self.probe_every:
            k = 1
        self.lengths.append(k)
        return draft_chain(drafter, committed, k) if k else Candidates()

    def _length(self, drafter: Drafter, accept: list[float], context: int) -> int:
        assert self.max_k is not None
        batcher = getattr(drafter, "batcher", None)
        batch = self.cost.batch
        if batcher is not None and batch is not None and batcher.participants > 1:
            economy = BatchEconomy.attach(batcher, batch)
            return economy.plan(id(self), accept, self.max_k, context)
        best_k, best = 0, self.cost.t_target(1, self.acceptance.union(1), context)  # batch 1
        for k in range(1, self.max_k + 1):
            price = self.cost.t_draft(k) + self.cost.t_target(
                k + 1, self.acceptance.union(k + 1), context
            )
            if price / (1 + expected(accept, k)) < best:
                best_k, best = k, price / (1 + expected(accept, k))
        return best_k

    def update(self, outcome: StepOutcome) -> None:
        drafted = len(outcome.candidates)
        self._plain_run = 0 if drafted else self._plain_run + 1
        if not drafted:
            return
        judged = min(drafted, outcome.accepted + 1)  # later tokens were never judged
        for j in range(judged):
            self._judged[j] = DECAY * self._judged[j] + 1.0
            self._hits[j] = DECAY * self._hits[j] + float(j < outcome.accepted)
