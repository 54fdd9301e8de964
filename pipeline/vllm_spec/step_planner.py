"""The draft length of each vLLM step, chosen by modelled tokens per millisecond; the model
starts from what the project measured offline for the pair (pipeline.vllm_spec.priors) and is
refined online on the replica that runs it (numpy only: it runs in vLLM's engine process).

- **Acceptance**, per request and decoding mode (a row is priced at its own temperature), a
  per-token rate ``a`` from the chains vLLM verifies, its j-th draft accepted with its prefix
  at ``reach_j``, the product of ``min(a f_i, 0.995)`` over i <= j, ``f_i`` the depth factors
  (pipeline.vllm_spec.row_acceptance); a row verifying k drafts yields 1 + reach_1..k tokens.
- **Step cost**, for the whole replica: ``T = c0 + c_pos P + c_union U(P) + c_row B +
  k (d0 + d_row B) + [k > 0] (s0 + s_row B)`` ms (pipeline.vllm_spec.online_step_cost), P
  verified positions, U(P) the expected union of experts they load, B rows, k draft rounds;
  fitted per batch-size band over the decode steps the engine times (schedule() to the next),
  from the calibration's costs as a prior it never forgets. With the plugin's drafter a step
  at k = 0 runs no draft forward, so no step needs drafting at random (``explore``, 0).

``choose(rows)`` returns the k of 0..K maximizing (expected tokens of the rows) / T at the
steady state where every step drafts k for every row, each row counted for the drafts
``keep`` will verify of its chain, T at k > 0 plus those tokens' share of the draft's prefill
of the prompts (pipeline.vllm_spec.draft_prefill); with ``price_switches`` it crosses 0 only
once a switch there and back has paid (pipeline.vllm_spec.switch_cost); with ``ab_epoch``
the A/B check holds whole epochs at 0 or K (pipeline.vllm_spec.ab_check). ``keep(row, n)`` is
the marginal rule for a chain already drafted: its j-th token is verified only if what it
adds in expectation, ``reach_j``, is worth its verification at the replica's tokens/ms.
"""

from __future__ import annotations

import math

import numpy as np

from pipeline.vllm_spec.ab_check import ABCheck
from pipeline.vllm_spec.draft_prefill import DraftPrefill
from pipeline.vllm_spec.online_step_cost import OnlineStepCost
from pipeline.vllm_spec.planner_config import PlannerConfig
from pipeline.vllm_spec.priors import MODES, Priors
from pipeline.vllm_spec.row_acceptance import RowAcceptance
from pipeline.vllm_spec.switch_cost import SwitchCost, unlock_after

REPLAN_EVERY = 8  # steps a choice's pricing of every k is reused (StepPlanner._worth)


class StepPlanner:
    def __init__(
        self, max_k: int, config: PlannerConfig | None = None, priors: Priors | None = None
    ):
        self.max_k = max_k
        self.config = c = config or PlannerConfig()
        priors = priors or Priors()
        use = c.offline_priors
        self.cost = OnlineStepCost(
            priors, use, c.prior_cost, c.prior_precision, c.forget, c.row_terms, c.zero_fit
        )
        rates = {m: (priors.rates.get(m, c.prior_rate) if use else c.prior_rate) for m in MODES}
        self.acceptance = RowAcceptance(rates, c.prior_weight, c.decay, c.revert, c.depth_factors)
        self.rng = np.random.default_rng(c.seed)
        self.caps: dict[str, int] = {}  # id -> most draft tokens its row may verify
        self.steps = 0
        self.chosen = np.zeros(max_k + 1, dtype=np.int64)  # steps per k (a report)
        self.tokens_per_ms = 0.0  # recent output of the replica (EMA over steps)
        self.trimmed = 0  # drafted tokens left unverified (a report)
        self.held_off = 0  # row-steps of rows whose request drafts nothing (a report)
        self.unfitted_steps = 0  # steps not fitted (prefill, catch-up, churn: a report)
        self.measured_off = 0  # steps held at 0 to measure the drafting terms (a report)
        self.switches = 0  # steps whose k differs from the step before (a report)
        self._last_k, self._since_off = -1, 0  # the last k; choices since the last off pair
        self.unlocked = 0  # steps drafted after unlock_every choices of 0 (a report)
        self._at_zero = self._unlock_left = 0  # choices of 0 in a row; unlock steps left
        self._worth_key, self._worth_age = None, 0  # what _worth's last pricing was made for
        self._worth_cached = self._worth_ms = np.zeros(0)
        self.switch_cost = SwitchCost()
        self.prefill = DraftPrefill(self.cost)
        self._policy_k = -1  # the last k chosen by the model (not an unlock's)
        if c.ab_fixed > max_k:
            raise ValueError(f"ab_fixed {c.ab_fixed}: at most the engine's K ({max_k})")
        self.ab = ABCheck(c.ab_epoch, (0, c.ab_fixed)) if c.ab_epoch and c.design != "off" else None
        self._held: int | None = None  # the k the A/B check holds this step at, if it does

    # -- acceptance (pipeline.vllm_spec.row_acceptance) and the requests' caps -----------

    @property
    def modes(self) -> dict[str, str]:
        return self.acceptance.modes

    def set_mode(self, request_id: str, mode: str) -> None:
        self.acceptance.set_mode(request_id, mode)

    def rate(self, request_id: str) -> float:
        return self.acceptance.rate(request_id)

    def observe_chain(self, request_id: str, drafted: int, accepted: int) -> None:
        """One judged chain: ``accepted`` of ``drafted`` tokens kept (a prefix)."""
        self.acceptance.observe_chain(request_id, drafted, accepted)

    def set_cap(self, request_id: str, cap: int) -> None:
        """The request's own bound on its row's draft tokens (pipeline.vllm_spec.request_args)."""
        self.caps[request_id] = max(0, min(int(cap), self.max_k))

    def cap(self, request_id: str) -> int:
        return self.caps.get(request_id, self.max_k)

    def forget_requests(self, alive: set[str]) -> None:
        self.acceptance.forget(alive)
        self.prefill.forget(alive)
        for gone in set(self.caps) - alive:
            del self.caps[gone]

    # -- step cost ----------------------------------------------------------------------

    @property
    def theta(self) -> np.ndarray:  # the step-cost coefficients, online_step_cost.TERMS
        return self.cost.theta

    @theta.setter
    def theta(self, value: np.ndarray) -> None:
        self.cost.theta = np.asarray(value, dtype=float)

    def union(self, positions: float) -> float:
        return self.cost.union(positions)

    def step_ms(self, positions: float, k: float, rows: float) -> float:
        return self.cost.step_ms(positions, k, rows)

    def observe_step(
        self,
        positions: int,
        k: int,
        rows: int,
        ms: float,
        tokens: int | None = None,
        decode: bool = True,
        switch: str | None = None,
        caught_up: int = 0,
    ) -> None:
        """One timed engine step (pipeline.vllm_spec.online_step_cost); ``tokens``: what it
        made (the replica's recent tokens per ms, the A/B check). A step that also prefills,
        catches the draft up or saw a request arrive or end (``decode`` False) is not fitted
        (its cost is not the draft length's; ``positions`` are verified ones). ``switch``
        ("on"/"off"): a decode step that switched drafting, measured above a steady step's
        price (pipeline.vllm_spec.switch_cost); on, it caught up ``caught_up`` tokens of the
        draft (pipeline.vllm_spec.draft_prefill)."""
        if not math.isfinite(ms) or ms <= 0:
            return
        if tokens is not None:
            self.tokens_per_ms = 0.9 * self.tokens_per_ms + 0.1 * tokens / ms
            if self.ab is not None:
                self.ab.observe(tokens, ms)
        self.acceptance.fade_to_prior()
        self.steps += 1
        if decode:
            self.cost.fit(positions, k, rows, ms)
        else:
            self.unfitted_steps += 1
        if switch is not None:
            steady = self.cost.step_ms(positions, k, rows)
            self.switch_cost.observe(switch == "on", rows, ms, steady)
            if switch == "on":
                self.prefill.observe_catch_up(ms - steady, caught_up)

    def keep(self, request_id: str, drafted: int, positions: int = 1) -> int:
        """How many of a row's ``drafted`` tokens to verify (the marginal rule), in a step of
        ``positions`` other verified positions (what one more adds, experts included), priced
        at that many rows (the scheduler passes the batch's rows)."""
        if self.config.design == "off":
            return 0
        capped = min(drafted, self.cap(request_id))
        self.trimmed += drafted - capped
        drafted = capped
        fixed = self.config.design == "fixed" or self._held is not None
        if not self.config.trim or fixed or self.tokens_per_ms <= 0:
            return drafted
        reach, kept = self.acceptance.reach(request_id, drafted), 0
        extras = self.cost.position_prices(positions, self.max_k)
        while kept < drafted and reach[kept] >= extras[kept] * self.tokens_per_ms:
            kept += 1
        self.trimmed += drafted - kept
        return kept

    def report(self) -> str:
        """One line of the planner's state: what it chose, believes and measured."""
        chosen = " ".join(f"{k}:{n}" for k, n in enumerate(self.chosen) if n)
        return (
            f"steps {self.steps} ({self.unfitted_steps} not fitted); "
            f"k chosen {chosen or '-'} (changed at {self.switches} steps); "
            f"{self.acceptance.report()}; step ms coefficients {self.cost.coefficients()}; "
            f"{self.tokens_per_ms:.3f} tokens/ms; {self.trimmed} drafted tokens "
            f"left unverified; {self.held_off} row-steps held off by their request; "
            f"{self.measured_off} steps held at 0 to measure drafting; {self.unlocked} "
            f"drafted after {self.config.unlock_every} or more at 0; "
            f"{self.switch_cost.report()}; {self.prefill.report()}; {self.cost.report()}"
            + (f"; {self.ab.report()}" if self.ab is not None else "")
        )

    # -- the choice ---------------------------------------------------------------------

    def expected_tokens(self, ids: list[str], k: int, caps: np.ndarray | None = None) -> float:
        """Tokens a step makes when each row verifies k drafts (at most its cap)."""
        ks = np.full(len(ids), k) if caps is None else np.minimum(k, caps)
        return float(len(ids) + self._gains(ids)[np.arange(len(ks)), ks].sum())

    def _gains(self, request_ids: list[str]) -> np.ndarray:
        """Per row, the drafts it adds in expectation verifying 0..K (row_acceptance.reach)."""
        reach = [self.acceptance.reach(r, self.max_k) for r in request_ids]
        return np.cumsum(np.pad(np.array(reach).reshape(len(reach), -1), ((0, 0), (1, 0))), 1)

    def choose(self, request_ids: list[str]) -> int:
        k = self._choose(request_ids)
        self.chosen[k] += 1
        self.switches += int(self._last_k >= 0 and k != self._last_k)
        self._last_k = k
        return k

    def _worth(self, request_ids: list[str], caps: np.ndarray, top: int) -> np.ndarray:
        """Modelled tokens per ms of the step at each k of 0..top. Kept for up to REPLAN_EVERY
        steps while the batch's size and bound and the step-cost model stay the same: the
        acceptance rates move by a chain's evidence at a time, and pricing every k at every
        step was a few percent of a step at 16 rows."""
        key = (len(request_ids), top, len(self.caps), self.cost.version)
        if key == self._worth_key and self._worth_age < REPLAN_EVERY:
            self._worth_age += 1
            return self._worth_cached
        gains, rows = self._gains(request_ids), len(request_ids)
        # Every k at once: each row verifies min(k, its cap, what the marginal rule will
        # keep of its chain) drafts; the step still pays k draft rounds.
        ks = np.arange(top + 1)
        bound = np.minimum(caps, self._kept(np.diff(gains, axis=1), rows))
        verified = np.minimum(ks[:, None], bound[None, :])
        tokens = rows + gains[np.arange(rows)[None, :], verified].sum(axis=1)
        ms = self.cost.steps_ms(rows + verified.sum(axis=1), ks, rows)
        if self.config.price_prefill:  # every k > 0 pays its tokens' share of the prompts
            ms[1:] += tokens[1:] * self.prefill.per_token(request_ids)
        ms = np.maximum(ms, 1e-3)
        self._worth_cached, self._worth_key, self._worth_age = tokens / ms, key, 1
        self._worth_ms = ms
        return self._worth_cached

    def _kept(self, reach: np.ndarray, rows: int) -> np.ndarray:
        """How many drafted tokens of each row's chain ``keep`` would verify (``reach``: rows
        x K): a k beyond it pays draft rounds for tokens dropped unverified."""
        if not self.config.trim or self.tokens_per_ms <= 0:
            return np.full(len(reach), self.max_k)
        prices = np.array(self.cost.position_prices(rows, self.max_k)) * self.tokens_per_ms
        return np.cumprod(reach >= prices[None, :], axis=1).sum(axis=1)

    def _side(self, worth: np.ndarray, best_k: int, request_ids: list[str]) -> int:
        if not self.config.price_switches or self._policy_k < 0:
            return best_k
        rows, floor = len(request_ids), self._catch_up_ms(request_ids)
        return self.switch_cost.side(self._policy_k, best_k, worth, self._worth_ms, rows, floor)

    def _catch_up_ms(self, request_ids: list[str]) -> float:
        """The most a switch on costs the draft's catch-up (pipeline.vllm_spec.draft_prefill)."""
        return self.prefill.catch_up_ms(request_ids) if self.config.price_prefill else 0.0

    def _choose(self, request_ids: list[str]) -> int:
        if self.max_k == 0 or not request_ids or self.config.design == "off":
            return 0
        if self.caps:  # some request bounds its row's drafts
            caps = np.array([self.cap(r) for r in request_ids])
            self.held_off += int(np.sum(caps == 0))
            top = int(caps.max())
        else:
            caps, top = np.full(len(request_ids), self.max_k), self.max_k
        if top == 0:
            return 0  # no row may draft: the step runs as without speculation
        if self.ab is not None:
            self._held = self.ab.held(len(request_ids))
            if self._held is not None:  # an epoch of the A/B check held at a fixed k
                return min(self._held, top)
        if self.config.design == "fixed":
            return top
        every = self.config.measure_off_every
        if every:
            self._since_off += 1
            if self._since_off >= every:  # two steps at 0; the second verifies nothing either
                if self._since_off > every:
                    self._since_off = 0
                self.measured_off += 1
                return 0
        if self.config.explore > 0 and self.rng.random() < self.config.explore:
            return int(self.rng.integers(0, top + 1))
        worth = self._worth(request_ids, caps, top)
        best_k = self._policy_k = self._side(worth, int(np.argmax(worth)), request_ids)
        if best_k > 0:
            self._at_zero = self._unlock_left = 0
            return best_k
        if not self._unlock_left:
            self._at_zero += 1
            every = self.config.unlock_every
            if not every or self._at_zero < every:
                return 0  # a pair of switches, at least the catch-up, priced only past here
            pair = max(self.switch_cost.pair_ms(len(request_ids)), self._catch_up_ms(request_ids))
            if self._at_zero < unlock_after(every, pair, self._worth_ms[0]):
                return 0
            # Two steps: the first's draft pass also catches up the steps at 0 (the scheduler
            # does not fit its time), the second is what a drafted step costs.
            self._at_zero, self._unlock_left = 0, 2
        self._unlock_left -= 1
        self.unlocked += 1
        return 1 + int(np.argmax(worth[1:]))
