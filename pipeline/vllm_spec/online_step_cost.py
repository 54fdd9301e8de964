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
"""

from __future__ import annotations

import numpy as np

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
    ):
        calibrated = use_priors and priors.cost is not None
        self._pending: list[tuple[int, int, int, float]] = []  # steps not yet applied
        self.version = 0  # counts changes of the coefficients (a pricing's validity)
        self._prices_key: tuple | None = None  # what position_prices last priced
        self._prices: list[float] = []
        self._unsolved: set[int] = set()  # bands whose fit changed since their last solve
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
        self.info = np.repeat(self.prior_info[None], BANDS, axis=0)
        self.info_theta = np.repeat((self.prior_info @ self.prior_theta)[None], BANDS, axis=0)
        self._theta = np.repeat(self.prior_theta[None], BANDS, axis=0)
        self._unsolved = set()
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
        return float(x @ self._solved(band(rows)))

    def steps_ms(self, positions: np.ndarray, ks: np.ndarray, rows: int) -> np.ndarray:
        """step_ms of each (positions, k) pair at ``rows`` rows, at once."""
        return features(positions, ks, rows, self.union(positions)) @ self._solved(band(rows))

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
        self._solved(self._band)
        return self._theta[self._band]

    @theta.setter
    def theta(self, value: np.ndarray) -> None:
        """Every band's coefficients, until that band's next fitted step."""
        self._apply()
        self._theta[:] = np.asarray(value, dtype=float)
        self._unsolved.clear()
        self.version += 1

    def _solved(self, b: int) -> np.ndarray:
        """Band ``b``'s coefficients as of the last applied steps (at most FIT_EVERY - 1
        behind)."""
        if b in self._unsolved:
            self._theta[b] = np.linalg.solve(self.info[b], self.info_theta[b])
            self._unsolved.discard(b)
            self.version += 1
        return self._theta[b]

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
        predicted = x @ self._solved(b)
        bound = 0.5 * np.abs(predicted) + 1.0
        y = predicted + np.clip(ms - predicted, -bound, bound)
        columns = (ks.tolist(), rows.tolist(), ms.tolist(), predicted.tolist())
        for k, r, m, guess in zip(*columns, strict=True):
            cell = self.cells.setdefault((int(r), int(k)), [0, 0.0, 0.0])
            cell[0] += 1
            cell[1] += m
            cell[2] += guess
        lam, n = self.forget, len(ms)
        weight = lam ** np.arange(n - 1, -1, -1.0)  # the later a step, the less forgotten
        held = (1.0 - lam) * float(weight.sum())  # the prior's share, re-added every step
        self.info[b] = lam**n * self.info[b] + (x * weight[:, None]).T @ x + held * self.prior_info
        self.info_theta[b] = (
            lam**n * self.info_theta[b]
            + x.T @ (weight * y)
            + held * (self.prior_info @ self.prior_theta)
        )
        self._unsolved.add(b)

    def coefficients(self) -> str:
        """Each fitted band's coefficients (the prior's before any step)."""
        self._apply()
        seen = sorted({band(rows) for rows, _ in self.cells}) or [self._band]
        return "; ".join(
            f"{_rows(b)}: "
            + ", ".join(f"{name} {v:.3f}" for name, v in zip(TERMS, self._solved(b), strict=True))
            for b in seen
        )

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
