"""The replica's step time as the cost-aware scheduler learns it online (numpy only: it runs
in vLLM's engine process).

``T = c0 + c_pos P + c_union U(P) + c_row B + k (d0 + d_row B) + [k > 0] (s0 + s_row B)``
ms: P the positions the target verifies (each row's token and its drafts), U(P) the expected
union of experts per MoE layer those positions load (the calibration's
``E - (E - k) r^(P - 1)``; 0 without one), B rows, k draft rounds. ``c_row`` is what every row
costs a step whatever it verifies (its sampling, its output, the runner's per-request
bookkeeping); ``s0 + s_row B`` what drafting at all adds to a step (the draft's first pass over
each row's new tokens, the drafted tokens' hand-over), which a step at k = 0 does not pay
with the project's plugin. Without the row term, per-row work went into the position term (a
served engine's fit: c_pos 0.31-0.58 ms where the calibration measured 0.085), which then
prices a draft token at 8 rows above what it costs; the drafting terms are told from the
intercept and the row term only by steps that draft nothing (docs/serving_vllm.md).

Fitted by least squares over the decode steps the scheduler times, forgetting old steps but
never the prior (the pair's calibration, pipeline.vllm_spec.priors): the fit weighs the
prior's information against the last ~1 / (1 - forget) steps', so what those steps do not
measure (the draft terms while nothing is drafted; the union, the positions and the
intercept, nearly collinear at one request) stays at, or returns to, the prior instead of
running off on the noise, as an inverse-covariance update with forgetting lets it.

One such fit per batch-size band (1 row, 2-3, 4-7, 8-15, 16-31, ...), each from the same
prior and forgetting over its own steps only: steps at one batch size price only their own
band. With one fit for every batch size, the thousands of 1-row steps of a quiet stretch
(where P and k move together, so c_pos and d0 trade off) drove c_pos to -0.23 ms, and 16-row
k = 4 steps (P = 80) were priced at 5.7 ms where they took 18.8: the scheduler drafted at 16
requests where drafting loses (docs/serving_vllm.md).

Over steps that all draft, the terms a step at k = 0 also pays (intercept, positions, rows)
and the drafting terms explain the same times: what the data cannot split, the prior's
weights do, and that decides the price of k = 0 where nothing at 0 is measured. Held per
coefficient, what 16-row drafted steps measured above the calibration went into the row and
position terms (they move a 16-row step 16 ms per unit), and steps at 0 were priced above
what they cost (10.9 ms at the end of a run where they measured 9.0): drafting kept winning
and nothing at 0 was measured to correct it. So each band keeps a second fit of the same
steps, the zero fit (pipeline.vllm_spec.band_fit is the least squares under both), whose
prior holds the four drafting terms per millisecond of the band's steps as loosely as the
intercept and 25x less than the position and row terms; with ``zero_fit`` k = 0 is priced at
the lower of the two: an excess of drafted steps then leaves 0 near its prior, a shortfall
makes 0 cheaper as before, and either way a wrong belief leads to steps at 0, free with the
plugin, which measure it and bring the fits together. Off by default: in vLLM it measured
steps at 0 as built, and where it chose them it lost (docs/serving_vllm.md).
"""

from __future__ import annotations

import numpy as np

from pipeline.vllm_spec.band_fit import BandFit
from pipeline.vllm_spec.priors import Priors

TERMS = ("c0", "c_pos", "c_union", "c_row", "d0", "d_row", "s0", "s_row")
# Timed steps applied to the fit together; the coefficients the scheduler prices with are at
# most this many steps behind (what it forgets in a step: 0.5%).
FIT_EVERY = 16
DEFAULT_COST = (7.0, 0.1, 0.0, 0.0, 1.0, 0.05, 0.5, 0.05)  # ms, in TERMS' order
BANDS = 9  # batch-size bands: the last holds 256 rows and more


def features(positions, k, rows, union=0.0) -> np.ndarray:
    """The terms' features in TERMS' order: one row for numbers, one row per step for arrays."""
    p, k, b, u = (np.asarray(v, dtype=float) for v in (positions, k, rows, union))
    drafting = (k > 0).astype(float)
    columns = (np.ones_like(p), p, u, b, k, k * b, drafting, drafting * b)
    return np.stack(np.broadcast_arrays(*columns), axis=-1)


def band(rows) -> np.ndarray | int:
    """The batch-size band of ``rows``: 0 for 1 row, 1 for 2-3, 2 for 4-7, ... (at most
    BANDS - 1); a number for a number (by its bits: it is asked at every step), an array
    for an array."""
    if np.ndim(rows) == 0:
        return min(max(int(rows), 1).bit_length() - 1, BANDS - 1)
    b = np.minimum(np.floor(np.log2(np.maximum(np.asarray(rows, dtype=float), 1.0))), BANDS - 1)
    return b.astype(int)


class OnlineStepCost:
    def __init__(
        self,
        priors: Priors,
        use_priors: bool = True,
        prior_cost: tuple[float, ...] = DEFAULT_COST,
        prior_precision: float = 1.0,
        forget: float = 0.995,
        row_terms: bool = True,
        zero_fit: bool = False,
    ):
        calibrated = use_priors and priors.cost is not None
        self._pending: list[tuple[int, int, int, float]] = []  # steps not yet applied
        self.version = 0  # counts changes of the coefficients (a pricing's validity)
        self._prices_key: tuple | None = None  # what position_prices last priced
        self._prices: list[float] = []
        self._band = 0  # the band of the last step fitted (``theta``'s)
        prior_theta = np.array(priors.cost if calibrated else prior_cost, dtype=float)
        self.forget = forget
        # The prior's information (a diagonal precision). The union and per-row draft terms
        # are collinear with the position and per-round terms over the steps one replica sees
        # (U(P) is nearly linear in P over a few positions; k and k B are one column at one
        # row; s_row B is c_row B while every step drafts), so the data would trade them off
        # against each other: they keep their prior 100x more firmly. The intercept keeps a
        # weak prior even from a calibration: the host's speed and the decoding mode move it
        # most, and held firmly its shift would go into the position term or the row term
        # (collinear with it at one row). The row term starts from the calibration's (0 from
        # one made before it had one) and is refined where the batch size varies.
        base = 25.0 if calibrated else prior_precision
        p, hard = prior_precision, 100.0 * base
        weight = np.array([p, base, hard, base, base, hard, base, hard])
        if calibrated and not priors.draft_cost_measured:  # another drafter's: a guess,
            # with the per-row terms still 100x firmer (at one row only sums are measured)
            weight[4:] = p * np.array([1.0, 100.0, 1.0, 100.0])
        if not row_terms:  # the form before the row and drafting terms: held at 0
            prior_theta[[3, 6, 7]] = 0.0
            weight[[3, 6, 7]] = 1e12
        self.prior_info = np.diag(weight)
        self._main = BandFit(np.repeat(self.prior_info[None], BANDS, axis=0), prior_theta)
        # The zero fit (the module's docstring): per ms of a step of the band's least rows.
        per_ms = weight.copy()
        per_ms[[1, 3]] = base
        per_ms[4:] = weight[4] / 25.0
        scale = np.array([[1.0, r, 1.0, r, 1.0, r, 1.0, r] for r in 2.0 ** np.arange(BANDS)])
        zero_weight = per_ms * scale**2
        held = (weight >= 1e12) | (np.arange(len(TERMS)) == 2)  # the union per coefficient
        zero_weight[:, held] = weight[held]
        self._zero = BandFit(np.stack([np.diag(w) for w in zero_weight]), prior_theta)
        # Off: k = 0 priced by the main fit alone; the zero fit still learns (one update per
        # FIT_EVERY steps), and the planner's line reports what it would price.
        self.zero_fit = zero_fit
        self.anchor(prior_theta)
        self.union_model = priors.union if use_priors else None
        # (rows, k) -> [steps, measured ms, modelled ms before each step's update]: where the
        # model errs (a report; nothing is priced from it)
        self.cells: dict[tuple[int, int], list[float]] = {}

    def anchor(self, theta) -> None:
        """Start every band from these coefficients and keep them as the prior it is never
        allowed to forget (the calibration's; a cost given by hand)."""
        self._pending = []
        self.prior_theta = np.asarray(theta, dtype=float).copy()
        self._main.anchor(self.prior_theta)
        self._zero.anchor(self.prior_theta)
        self.version += 1

    def union(self, positions):
        """U(P), the expected experts per MoE layer P positions load (0 without a calibration);
        a number for a number, an array for an array."""
        p = np.asarray(positions, dtype=float)
        if self.union_model is None:
            out = np.zeros_like(p)
        else:
            experts, top_k, r = self.union_model
            out = np.where(p > 0, experts - (experts - top_k) * r ** np.maximum(p - 1, 0), 0.0)
        return float(out) if out.ndim == 0 else out

    def step_ms(self, positions: float, k: float, rows: float) -> float:
        # The sum, not each term: terms collinear over the steps seen (P = 1 + k at one row)
        # trade off in the fit, and only their sum is measured.
        x = features(positions, k, rows, self.union(positions))
        ms = float(x @ self._solved(band(rows)))
        if k or not self.zero_fit:
            return ms
        return min(ms, float(x @ self._zero_solved(band(rows))))

    def steps_ms(self, positions: np.ndarray, ks: np.ndarray, rows: int) -> np.ndarray:
        """step_ms of each (positions, k) pair at ``rows`` rows, at once."""
        return self._priced(features(positions, ks, rows, self.union(positions)), band(rows))

    def _priced(self, x: np.ndarray, b: int) -> np.ndarray:
        """The steps ``x`` (steps x terms) of band ``b`` priced: k = 0 at the lower fit."""
        ms = x @ self._solved(b)
        zero = x[:, 4] == 0
        if self.zero_fit and zero.any():
            ms[zero] = np.minimum(ms[zero], x[zero] @ self._zero_solved(b))
        return ms

    def coefficient(self, term: str, rows: int) -> float:
        """One term's coefficient (TERMS) in the band of ``rows``."""
        return float(self._solved(band(rows))[TERMS.index(term)])

    def position_ms(self, positions: float, rows: int) -> float:
        """What one more verified position costs in a step of ``positions`` over ``rows``
        rows: its own work and the experts it adds to the step's union."""
        extra = self.union(positions + 1) - self.union(positions)
        theta = self._solved(band(rows))
        return float(theta[1] + theta[2] * extra)

    def position_prices(self, positions: int, count: int) -> list[float]:
        """What the j-th extra verified position costs in a step of ``positions`` (rows),
        j = 0..count-1: the same for every row of a step, so priced once per step and
        coefficients (per row it was 0.6 ms of a 16-row step)."""
        key = (positions, count, self.version)
        if key != self._prices_key:
            self._prices_key = key
            self._prices = [
                max(self.position_ms(positions + j, positions), 0.0) for j in range(count)
            ]
        return self._prices

    @property
    def theta(self) -> np.ndarray:
        """The coefficients of the band of the last step fitted, with every step fitted so
        far (a view: changing it changes that band's until its next fitted step)."""
        self._apply()
        return self._solved(self._band)

    @theta.setter
    def theta(self, value: np.ndarray) -> None:
        """Every band's coefficients, until that band's next fitted step."""
        self._apply()
        self._main.set(value)
        self._zero.set(value)
        self.version += 1

    def _solved(self, b: int) -> np.ndarray:
        """Band ``b``'s coefficients as of the last applied steps (at most FIT_EVERY - 1
        behind)."""
        theta, new = self._main.solved(b)
        if new:  # both fits take the same steps: solved together, one change of the prices
            self._zero.solved(b)
            self.version += 1
        return theta

    def _zero_solved(self, b: int) -> np.ndarray:
        """Band ``b``'s coefficients in the fit that prices k = 0 where it is cheaper."""
        self._solved(b)
        return self._zero.theta[b]

    def fit(self, positions: int, k: int, rows: int, ms: float) -> None:
        """One timed decode step: applied with the next ``FIT_EVERY`` - 1 (or when the
        coefficients are read); applied one by one, an update of a few 8 x 8 arrays and a
        solve took about 0.1 ms a step in the engine's loop, where a step held at 0 has nothing
        else to pay."""
        self._pending.append((positions, k, rows, ms))
        self._band = band(rows)
        if len(self._pending) >= FIT_EVERY:
            self._apply()

    def _apply(self) -> None:
        """The pending steps' update of their bands, as applying them one by one would make
        it, each step's robust target taken from its band's coefficients as they stood before
        the batch. A band forgets only over its own steps."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        positions, ks, rows, ms = (np.array(column) for column in zip(*pending, strict=True))
        bands = band(rows)
        for b in np.unique(bands).tolist():
            self._apply_band(b, *(a[bands == b] for a in (positions, ks, rows, ms)))

    def _apply_band(self, b: int, positions, ks, rows, ms) -> None:
        x = features(positions, ks, rows, self.union(positions))
        # Robust to the odd slow step (a first forward at a new shape, the host stalling):
        # one step moves the fit by at most half its prediction plus a millisecond.
        predicted = self._priced(x, b)
        bound = 0.5 * np.abs(predicted) + 1.0
        y = predicted + np.clip(ms - predicted, -bound, bound)
        columns = (ks.tolist(), rows.tolist(), ms.tolist(), predicted.tolist())
        for k, r, m, guess in zip(*columns, strict=True):
            cell = self.cells.setdefault((int(r), int(k)), [0, 0.0, 0.0])
            cell[0] += 1
            cell[1] += m
            cell[2] += guess
        self._main.update(b, x, y, self.forget)
        self._zero.update(b, x, y, self.forget)

    def coefficients(self) -> str:
        """Each fitted band's coefficients (the prior's before any step), and k = 0 at its
        least rows by the main fit / the zero fit."""
        self._apply()
        parts = []
        for b in sorted({band(rows) for rows, _ in self.cells}) or [self._band]:
            theta, x = self._solved(b), features(2**b, 0, 2**b, self.union(2**b))
            terms = ", ".join(f"{name} {v:.3f}" for name, v in zip(TERMS, theta, strict=True))
            zero = float(x @ self._zero.theta[b])
            parts.append(f"{_rows(b)}: {terms}, k = 0 {float(x @ theta):.2f}/{zero:.2f} ms")
        return "; ".join(parts)

    def report(self, least: int = 20) -> str:
        """Mean measured / modelled ms per (rows, k) of the decode steps fitted, for the cells
        of at least ``least`` steps."""
        cells = [
            f"{rows}x{k}: {m / n:.1f}/{p / n:.1f} ({n})"
            for (rows, k), (n, m, p) in sorted(self.cells.items())
            if n >= least
        ]
        return "measured/modelled ms by rows x k " + (", ".join(cells) or "-")


def _rows(b: int) -> str:
    """Band ``b``'s batch sizes, as words."""
    low, high = 2**b, 2 ** (b + 1) - 1
    if b == BANDS - 1:
        return f"{low}+ rows"
    return "1 row" if b == 0 else f"{low}-{high} rows"
