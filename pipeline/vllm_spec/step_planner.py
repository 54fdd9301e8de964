"""The draft length of each vLLM step, chosen by modelled tokens per millisecond, with both
halves of the model learned online on the replica that runs it (numpy only: it runs in vLLM's
engine process and is tested without vLLM).

- **Acceptance**, per request: a drafted chain of k tokens is accepted up to its first
  rejection, so each judged chain gives ``accepted`` successes and (when ``accepted < k``) one
  failure of a per-token acceptance rate ``a``; the estimate is the decayed ratio with a prior
  (new requests start from the replica's pooled rate). A row drafting k tokens then yields
  ``(1 - a^(k+1)) / (1 - a)`` tokens in expectation.
- **Step cost**, for the whole replica: ``T = c0 + c_pos P + k (d0 + d_row B)`` ms, P the
  positions the target verifies (each row's token and its drafts), B rows, k draft rounds,
  fitted by recursive least squares with forgetting over the steps the engine times, from a
  weak prior; a small share of steps draws k at random so the draft terms stay identifiable.

``choose(rows)`` returns the k of 0..K maximizing (expected tokens of the rows) / T at the
steady state where every step drafts k for every row. ``keep(row, n)`` is the marginal rule
for a chain already drafted: its j-th token is verified only if what it adds in expectation,
``a^j`` tokens, is worth its verification, ``c_pos`` ms at the replica's recent tokens per ms.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.vllm_spec.env_settings import fields_from_env

ENV = "SPECBOUND_SCHEDULER"


@dataclass(frozen=True)
class PlannerConfig:
    explore: float = 0.02  # share of steps whose k is drawn at random (cost identifiability)
    forget: float = 0.995  # per-step forgetting of the step-cost fit
    decay: float = 0.98  # per judged chain, of a request's acceptance counts
    prior_rate: float = 0.6  # acceptance before any evidence
    prior_weight: float = 4.0  # judged tokens that prior is worth
    # Prior step cost (ms): c0, c_pos, d0, d_row; weak (prior_precision per coefficient).
    prior_cost: tuple[float, float, float, float] = (7.0, 0.1, 1.0, 0.05)
    prior_precision: float = 1.0
    design: str = "policy"  # policy: choose; fixed: always K (a like-for-like peer)
    trim: bool = True  # verify a drafted chain only as far as the marginal rule keeps it
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.explore <= 1.0:
            raise ValueError(f"explore {self.explore}: between 0 and 1")
        if not 0.5 <= self.forget <= 1.0 or not 0.5 <= self.decay <= 1.0:
            raise ValueError("forget and decay: between 0.5 and 1")
        if not 0.0 < self.prior_rate < 1.0 or self.prior_weight <= 0:
            raise ValueError("prior_rate in (0, 1), prior_weight > 0")
        if len(self.prior_cost) != 4 or self.prior_precision <= 0:
            raise ValueError("prior_cost: four numbers (c0, c_pos, d0, d_row); precision > 0")
        if self.design not in ("policy", "fixed"):
            raise ValueError(f"design {self.design!r}: policy or fixed")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> PlannerConfig:
        data = fields_from_env(cls, ENV, environ)
        if "prior_cost" in data:
            data["prior_cost"] = tuple(float(x) for x in data["prior_cost"])
        return cls(**data)


def features(positions: float, k: float, rows: float) -> np.ndarray:
    return np.array([1.0, positions, k, k * rows])


class StepPlanner:
    def __init__(self, max_k: int, config: PlannerConfig | None = None):
        self.max_k = max_k
        self.config = config or PlannerConfig()
        c = self.config
        self.theta = np.array(c.prior_cost, dtype=float)
        self.cov = np.eye(4) / c.prior_precision  # RLS inverse information
        self.rng = np.random.default_rng(c.seed)
        self.requests: dict[str, list[float]] = {}  # id -> [accepted, trials]
        self.pooled = [c.prior_rate * c.prior_weight, c.prior_weight]
        self.steps = 0
        self.chosen = np.zeros(max_k + 1, dtype=np.int64)  # steps per k (a report)
        self.tokens_per_ms = 0.0  # recent output of the replica (EMA over steps)
        self.trimmed = 0  # drafted tokens left unverified (a report)

    # -- acceptance ---------------------------------------------------------------------

    def rate(self, request_id: str) -> float:
        acc, trials = self.requests.get(request_id, self.pooled)
        return float(np.clip(acc / trials, 0.0, 0.995)) if trials > 0 else self.config.prior_rate

    def observe_chain(self, request_id: str, drafted: int, accepted: int) -> None:
        """One judged chain: ``accepted`` of ``drafted`` tokens kept (a prefix)."""
        if drafted <= 0:
            return
        accepted = min(max(accepted, 0), drafted)
        trials = accepted + (1 if accepted < drafted else 0)
        c = self.config
        if request_id not in self.requests:
            rate = self.pooled[0] / self.pooled[1]
            self.requests[request_id] = [rate * c.prior_weight, c.prior_weight]
        for counts in (self.requests[request_id], self.pooled):
            counts[0] = c.decay * counts[0] + accepted
            counts[1] = c.decay * counts[1] + trials

    def forget_requests(self, alive: set[str]) -> None:
        for gone in set(self.requests) - alive:
            del self.requests[gone]

    # -- step cost ----------------------------------------------------------------------

    def step_ms(self, positions: float, k: float, rows: float) -> float:
        return float(features(positions, k, rows) @ self.theta)

    def observe_step(
        self, positions: int, k: int, rows: int, ms: float, tokens: int | None = None
    ) -> None:
        """Recursive least squares with forgetting (one timed engine step); ``tokens``: what
        the step produced, for the replica's recent tokens per ms."""
        if not np.isfinite(ms) or ms <= 0:
            return
        if tokens is not None:
            self.tokens_per_ms = 0.9 * self.tokens_per_ms + 0.1 * tokens / ms
        x = features(positions, k, rows)
        lam = self.config.forget
        px = self.cov @ x
        gain = px / (lam + x @ px)
        self.theta = self.theta + gain * (ms - x @ self.theta)
        self.cov = (self.cov - np.outer(gain, px)) / lam
        self.steps += 1

    def keep(self, request_id: str, drafted: int) -> int:
        """How many of a row's ``drafted`` tokens to verify (the marginal rule)."""
        if not self.config.trim or self.config.design == "fixed" or self.tokens_per_ms <= 0:
            return drafted
        price = max(self.theta[1], 0.0) * self.tokens_per_ms  # tokens one position costs
        a, kept = self.rate(request_id), 0
        while kept < drafted and a ** (kept + 1) >= price:
            kept += 1
        self.trimmed += drafted - kept
        return kept

    # -- the choice ---------------------------------------------------------------------

    def expected_tokens(self, rates: np.ndarray, k: int) -> float:
        return float(np.sum((1.0 - rates ** (k + 1)) / (1.0 - rates)))

    def choose(self, request_ids: list[str]) -> int:
        k = self._choose(request_ids)
        self.chosen[k] += 1
        return k

    def _choose(self, request_ids: list[str]) -> int:
        if self.max_k == 0 or not request_ids:
            return 0
        if self.config.design == "fixed":
            return self.max_k
        if self.rng.random() < self.config.explore:
            return int(self.rng.integers(0, self.max_k + 1))
        rates = np.array([self.rate(r) for r in request_ids])
        rows = len(request_ids)
        best_k, best = 0, -1.0
        for k in range(self.max_k + 1):
            ms = max(self.step_ms(rows * (1 + k), k, rows), 1e-3)
            worth = self.expected_tokens(rates, k) / ms
            if worth > best:
                best_k, best = k, worth
        return best_k
