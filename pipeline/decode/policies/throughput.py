"""`throughput` (ours): draft a token only while it is expected to pay for itself at the rate
this generation is making tokens, with acceptance learned offline from the pair's own traces.

Maximising tokens per unit of time is a renewal-reward problem: with rho the cost per token
the policy achieves, a step's plan of n more draft tokens is worth rho * E[tokens it adds]
minus its modelled cost, and the best rho is the one the policy itself then achieves
(Dinkelbach's fixed point). So rho is the generation's own modelled cost per token (the ratio
of slow moving sums of step prices and new tokens, starting from the optimum of a chain whose
tokens are accepted at the training mean rate), and
each decision asks whether some plan of n = 1, 2, ... more tokens has positive worth:

    max_n  rho * P * sum_{i<=n} prod_{l<=i} a_l  -  [dT_D(forwards) + dT_T(m -> m + n, U(m + n))]

P is the probability that the chain drafted so far is accepted; a_1 is the acceptance of the
next token, a_2.. that of the ones after it; U(m) the mean experts per layer of a pass of m
positions; T_D and T_T are the calibrated cost model (costmodel.json). Acceptance comes from
pipeline.acceptance (acceptance.json): logistic models over the draft's confidence, entropy
and top-2 margin, how far its top token continues an n-gram already in the text (the
prompt-lookup signal: copied names and phrases are accepted far more often), its hidden state
and the generation's recent acceptance. The draft's raw confidence understates greedy
acceptance; this model is calibrated on what the target actually did, and ``adapt`` corrects
its logit online from the generation's own outcomes (a domain it under- or overrates). At
T = 0 the `next` model also reads what happened the last time the text was where it is now
(pipeline.acceptance.repeats: a loop of lines is accepted again where it was before).

Decisions cost no draft forward of their own: drafting the next token is decided once its
distribution is known (the `current` model); running the forward for the token after it,
before that forward (the `next` model). Before any forward the step decides whether to look
at all, from recent acceptance and its spread (a look that drafts nothing wastes a forward);
if not, the step is plain (speculation off), and every ``probe_every`` plain steps one drafts
anyway so that recent acceptance keeps being measured. Decisions are made before sampling,
or after a token is drawn about tokens after it, never about the drawn token itself, which
keeps sampling lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.acceptance.features import MAX_MATCH, match_length, read_position
from pipeline.acceptance.model import AcceptanceModel, ModeModel
from pipeline.acceptance.native_reads import native_reads
from pipeline.acceptance.repeats import RepeatMemory
from pipeline.cost.model import CostModel
from pipeline.decode.drafter import Drafter
from pipeline.decode.policies.base import AcceptanceChainPolicy
from pipeline.decode.policies.knobs import Knob, step_knob
from pipeline.decode.policies.labels import default
from pipeline.decode.policies.outcomes import OutcomeTracker
from pipeline.decode.policies.plan_worth import plan_pays, plan_worth
from pipeline.decode.policies.prices import PriceTables
from pipeline.decode.step_limits import StepWork
from pipeline.decode.types import Candidates, StepOutcome

DEFAULT_MAX_K = AcceptanceChainPolicy.DEFAULT_MAX_K
# The rate is a slow average (the realized cost per token over 3-4 steps is far noisier than
# the optimum it estimates): it starts from the optimum of a chain accepted at the model's
# training mean, worth PRIOR_TOKENS tokens, and forgets by RATE_DECAY per step.
RATE_DECAY = 0.95
PRIOR_TOKENS = 16.0


@dataclass
class ThroughputPolicy(AcceptanceChainPolicy):
    cost: CostModel
    acceptance: AcceptanceModel
    max_k: int | None = None  # None: the cost model's largest m - 1, at most DEFAULT_MAX_K
    probe_every: int = 8
    rate: float | None = None  # fixed ms per token instead of the generation's own
    step_overhead_ms: float = 0.0
    adapt: float = 0.2
    retime: bool = False
    name = "throughput"
    label = default("T = 0")
    summary = (
        "ours: draft while a token's expected value at the generation's own cost per "
        "token exceeds its modelled cost (acceptance learned offline)"
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
            help="plain steps, while drafting does not pay, between two that draft anyway",
        ),
        Knob(
            "step_overhead_ms",
            float,
            0.0,
            0.0,
            100.0,
            help="ms a step costs beyond its modelled forwards (the engine's own work): "
            "counted in the rate, so fewer, longer steps are worth a little more",
        ),
        Knob(
            "adapt",
            float,
            0.2,
            0.0,
            1.0,
            help="learning rate of the online correction of the acceptance model's logit "
            "from this generation's outcomes (0: off)",
        ),
        Knob(
            "retime",
            bool,
            False,
            help="scale the cost model's draft and target prices by this generation's "
            "measured over modelled step times (off: measured no better, docs/online.md)",
        ),
        Knob(
            "rate",
            float,
            None,
            0.0,
            low_open=True,
            title="rate",
            help="ms per token a drafted token is worth (default: the generation's own "
            "modelled cost per token, as it goes)",
        ),
    )
    # (step kind, drafted, rate) of the generation's steps, for inspection.
    decisions: list[tuple[str, int, float]] = field(default_factory=list, init=False)

    def reset(self) -> None:
        self.outcomes = OutcomeTracker(self.acceptance.decay, self.adapt)
        self._price_sum: float | None = None  # decayed sums of step prices and new tokens
        self._token_sum, self._plain_run, self._ctx = 0.0, 0, 0
        self._prior = 0.0  # the mode's training mean, set by propose
        self._prompt_len: int | None = None
        assert self.max_k is not None
        self.prices = PriceTables(self.cost, self.acceptance.union, self.max_k, self.retime)
        self._td, self._tt = self.prices.td, self.prices.tt  # this step's tables
        # The committed text's n-grams (the context match) and, at T = 0, each position's
        # outcome (what the `next` model reads where the text repeats itself).
        self._index = RepeatMemory()
        self.decisions = []

    def step_work(self) -> StepWork:
        k = self.max_k
        assert k is not None
        # Catch-up: the last drafting step's tokens (<= k + 1) and up to probe_every plain
        # steps' after it; then k - 1 extends.
        return StepWork(
            k, 2 * k + self.probe_every, k + 1, f"max_k {k}, probe_every {self.probe_every}"
        )

    def _room(self) -> int:  # chain tokens this step may draft (a subclass keeps room)
        return self.max_k  # type: ignore[return-value]

    # -- pricing -------------------------------------------------------------------------
    def _t_target(self, m: int) -> float:
        return self.cost.t_target(m, self.acceptance.union(m), self._ctx)

    def _rate(self) -> float:
        """ms per token a drafted token is worth: the knob, else the generation's own."""
        return self.rate if self.rate is not None else self.achieved_rate()

    def achieved_rate(self) -> float:
        """The generation's modelled cost per token so far (decayed sums, with the prior)."""
        if self._price_sum is None:
            self._price_sum = PRIOR_TOKENS * self.stationary_rate(self._prior)
            self._token_sum = PRIOR_TOKENS
        return self._price_sum / self._token_sum

    def stationary_rate(self, a: float) -> float:
        """The least modelled cost per token of a chain of n = 0 .. max_k tokens each accepted
        with probability a (n = 0: a plain step)."""
        assert self.max_k is not None
        extra = self.step_overhead_ms
        best = self._t_target(1) + extra
        tokens = 1.0
        for n in range(1, self.max_k + 1):
            tokens += a**n
            best = min(best, (self.cost.t_draft(n) + self._t_target(n + 1) + extra) / tokens)
        return best

    def _look_pays(self, rho: float, mode: ModeModel, recent: float) -> bool:
        """Before any draft forward: is looking at the next distribution worth its forward?
        After the look the step drafts only if that pays, so the look is worth
        E[max(worth of drafting, -its forward)] over how the next token's acceptance spreads
        around recent acceptance; a plain step is worth 0."""
        assert self.max_k is not None
        look = self._td[1]
        total = 0.0
        # A plan's worth rises with acceptance: when the least likely percentile's drafting
        # pays, every one does (the common case while drafting pays; one check, not ten).
        low = [mode.spread_floor(recent)] * self.max_k
        if plan_pays(self._td, self._tt, rho, 1.0, low, 1, 0, first_free=False):
            return True
        spread = mode.spread_around(recent)
        for a in spread:
            total += max(
                plan_worth(self._td, self._tt, rho, 1.0, [a] * self.max_k, 1, 0, first_free=False),
                -look,
            )
        return total / len(spread) > 0

    # -- the step ------------------------------------------------------------------------
    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        mode: ModeModel = self.acceptance.mode(drafter.sampling.greedy)
        if drafter.sampling.greedy and mode.repeat:  # T = 0: outcomes kept for the lookup
            self.outcomes.memory = self._index
        self._prior = mode.prior
        if self._prompt_len is None:  # the generation's first step: committed is the prompt
            self._prompt_len = len(committed)
            self.outcomes.start(self._prompt_len)
        recent = self.outcomes.recent_or(mode.prior)
        self._ctx = len(committed)
        rho = self._rate()
        self.prices.refresh()
        self._td, self._tt = self.prices.td, self.prices.tt
        cands = Candidates()
        self.outcomes.predicted = []
        probe = self._plain_run >= self.probe_every
        if not probe and not self._look_pays(rho, mode, recent):
            return cands  # speculation off for this step: no draft forward at all
        cached = drafter.cached()
        probs = drafter.begin(committed)
        if drafter.sampling.greedy:
            assert drafter.logits is not None
            recent = self.outcomes.observe_catchup(
                drafter.logits, committed, cached, recent, drafter.ROW_AHEAD
            )
        p_chain, decay = 1.0, self.acceptance.decay
        self._index.extend(committed[len(self._index.tokens) :])
        tail = committed[-(MAX_MATCH - 1) :]
        greedy = drafter.sampling.greedy
        repeats = self.outcomes.memory is not None
        # softmax(logits / T) is `probs` unless top-p cut it: the statistics then read the
        # logits too (a cheaper entropy), unless a reduced vocabulary put -inf in them.
        exact = (greedy or drafter.sampling.top_p >= 1.0) and not drafter.masked_logits
        temperature = 1.0 if greedy else drafter.sampling.temperature
        # One compiled call reads the position where it can (native_reads: the same numbers;
        # host memory only, so a GPU's step decides here, not on every read).
        weights = mode.hidden_weights("both")
        native = native_reads() if exact and weights is not None and probs.is_cpu else None
        for j in range(self._room()):
            state = drafter.hidden[-1]  # the draft's state that produced `probs`
            logits = drafter.logits[-1] if exact else None  # type: ignore[index]
            # This token, and the ones after it, each given the ones before it accepted.
            stats, top, products = read_position(
                probs, self._index, tail, logits, temperature, state, weights, native
            )
            room = self._room() - j - 1  # chain tokens after this one the pass has room for
            seen = self._index.outcome([*tail, top], match_length(stats)) if repeats else None
            a_now, later = mode.chain_view(
                stats, recent, state, room, decay, self.outcomes.offset, seen, products
            )
            self.outcomes.predicted.append(a_now)
            # A probe drafts one token whatever it is worth: recent acceptance needs outcomes.
            if not (probe and j == 0) and not plan_pays(
                self._td, self._tt, rho, p_chain, [a_now, *later], j + 1, j + 1, first_free=True
            ):
                break
            if greedy:  # the drafter's argmax, with its probability, read off the top-2
                token, conf = top, stats[1]
            else:
                token, conf = drafter.sample(probs), None
            cands.extend_chain(token, probs, greedy, conf)
            p_chain *= a_now
            # Later tokens count only if this one is accepted: their features see it so.
            recent = decay * recent + (1 - decay)
            later = later[: self._room() - j - 1]  # (a subclass may have taken room meanwhile)
            if not later or not plan_pays(
                self._td, self._tt, rho, p_chain, later, j + 2, j + 1, first_free=False
            ):
                break
            tail = [*tail[1:], token] if len(tail) == MAX_MATCH - 1 else [*tail, token]
            probs = drafter.extend(token)
        return cands

    def update(self, outcome: StepOutcome) -> None:
        record = outcome.record
        drafted = len(outcome.candidates)
        # A look that drafted nothing yields no outcome: it counts towards the next probe.
        self._plain_run = 0 if drafted else self._plain_run + 1
        self.outcomes.observe_step(drafted, outcome.accepted, self._ctx, self._prior)
        price = self.prices.step_price(record, self._ctx, self.step_overhead_ms)
        self.achieved_rate()  # the prior sums, if this is the first step
        assert self._price_sum is not None
        self._price_sum = RATE_DECAY * self._price_sum + price
        self._token_sum = RATE_DECAY * self._token_sum + record.new_tokens
        self.decisions.append(("draft" if drafted else "plain", drafted, self._rate()))
