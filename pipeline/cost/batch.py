"""The cost of a step at batch > 1 (continuous batching, pipeline.decode.batching).

A verification pass for a batch feeds every generation's positions at once and loads the
union of experts over all of them, so

    T_T(P, U, A) = b0 + b_pos P + b_union U + b_ctx A

with P the positions of the pass (summed over the batch), U the mean per MoE layer of the
union of experts over all P positions, and A = sum_r n_r L_r the attention work: each
generation's n_r positions attend to its own L_r cached ones, and nobody else's (at batch 1
this is m L, where the batch-1 model's c L leaves m out). How
the union grows with positions is U(P) = E - (E - k) r^(P - 1) (k experts for one position,
saturating at all E): one more draft token for one request costs b_pos plus b_union times the
experts no other position already brings, which shrinks as the batch grows.

A draft round, one packed draft forward of the n generations still drafting, costs
T_D(n) = d0 + d_tok n as decoding pays it: the forward and the gap before it, in which those
generations sample and hand their tokens over one after another (the GIL). A step also pays
its bookkeeping (commits, streams, the next proposals) in the gaps before its first draft
round and its verification pass: S(B) = s0 + s_row B for a batch of B.

All in ms, fitted by robust regression (Tukey's biweight, statsmodels RLM) to the batcher's
records of decoding steps (prefills left out); bound, like the batch-1 model, to the machine,
device, dtype and experts implementation it was measured on (it lives in costmodel.json,
section "batch").
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class BatchCost:
    b0: float
    b_pos: float
    b_union: float
    b_ctx: float
    d0: float
    d_tok: float
    s0: float
    s_row: float
    experts: int  # E: routed experts per MoE layer
    top_k: int  # k: experts one position selects
    union_decay: float  # r of U(P)
    r2_target: float = float("nan")
    r2_draft: float = float("nan")
    r2_step: float = float("nan")
    records: int = 0
    # What each row adds to a target pass whatever it verifies (its sampling, its output, the
    # runner's bookkeeping): measured by vLLM's calibration (rows vary apart from positions
    # there), 0 where the fit has no row term.
    b_row: float = 0.0

    def union(self, positions: float) -> float:
        """Expected experts per layer loaded by a pass of ``positions`` positions."""
        if positions <= 0:
            return 0.0
        return self.experts - (self.experts - self.top_k) * self.union_decay ** (positions - 1)

    def t_target(
        self, positions: float, union: float | None = None, attended: float = 0.0, rows: float = 0
    ):
        u = self.union(positions) if union is None else union
        return (
            self.b0
            + self.b_pos * positions
            + self.b_union * u
            + self.b_ctx * attended
            + self.b_row * rows
        )

    def t_draft(self, rows: float) -> float:
        """A draft round of ``rows`` generations (0: no round)."""
        return self.d0 + self.d_tok * rows if rows > 0 else 0.0

    def t_step_overhead(self, rows: float) -> float:
        return self.s0 + self.s_row * rows

    def marginal_target(self, base: float, extra: float) -> float:
        """What ``extra`` more positions add to a pass of ``base`` positions (attention aside):
        their own work and the experts no other position brings."""
        return self.t_target(base + extra) - self.t_target(base)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BatchCost:
        return cls(**data)

    @classmethod
    def fit(cls, records: list, experts: int, top_k: int) -> BatchCost:
        """Robust linear fits over the records of decoding steps (pipeline.decode.batching
        BatchRecord, in the order they ran; steps with a prefill are left out)."""
        steps, current, clean = [], [], True
        for r in records:
            current.append(r)
            clean = clean and not r.prefills
            if r.side == "target":
                if clean:
                    steps.append(current)
                current, clean = [], True
        target = [s[-1] for s in steps]
        rounds = [r for s in steps for r in s[:-1] if not r.begins]
        if len(target) < 8 or len(rounds) < 8:
            raise ValueError(
                f"too few decoding steps to fit a batch cost model: {len(target)} "
                f"passes and {len(rounds)} chain rounds (need 8 of each)"
            )
        x = np.array([[1.0, r.positions, float(np.mean(r.union)), r.attended] for r in target])
        y = np.array([r.t_ms for r in target])
        bt, r2t = _robust(x, y)
        if bt[3] < 0:  # attention too small to tell apart from positions here: left out
            bt, r2t = _robust(x[:, :3], y)
            bt = np.append(bt, 0.0)
        xd = np.array([[1.0, r.rows] for r in rounds])
        bd, r2d = _robust(xd, np.array([r.t_ms + _gap(r) for r in rounds]))
        xs = np.array([[1.0, s[-1].rows] for s in steps])
        ys = np.array([sum(_gap(r) for r in s if r.side == "target" or r.begins) for s in steps])
        bs, r2s = _robust(xs, ys)
        decay = _fit_union_decay(
            [(r.positions, float(np.mean(r.union))) for r in target], experts, top_k
        )
        return cls(
            *(float(v) for v in bt),
            float(bd[0]),
            float(bd[1]),
            float(bs[0]),
            float(bs[1]),
            experts,
            top_k,
            decay,
            r2t,
            r2d,
            r2s,
            len(records),
        )


MAX_GAP_MS = 50.0  # a longer gap is the batch idling (no generation), not work
RLM_MAXITER = 200  # IRLS converges linearly: tiny calibrations take 60-70 steps


def _gap(record) -> float:
    return min(record.gap_ms, MAX_GAP_MS)


def _robust(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Tukey's biweight M-estimate (statsmodels RLM, MAD scale, from least squares): a pass
    the machine interrupted (a GC pause, another process) gets weight 0 beyond 4.685 robust
    SDs off the fit, a smooth form of dropping it; R^2 on the points it kept."""
    # Imported here: vLLM's environment loads this module (pipeline.vllm_spec) without them.
    import statsmodels.api as sm

    beta, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ beta
    keep = np.ones(len(y), dtype=bool)
    # An exact fit (synthetic records, rounding noise only) would leave RLM a scale of 0.
    if sm.robust.scale.mad(resid) > 1e-9 * float(np.mean(np.abs(y))):
        fit = sm.RLM(y, x, M=sm.robust.norms.TukeyBiweight()).fit(maxiter=RLM_MAXITER)
        if fit.fit_history["iteration"] >= RLM_MAXITER:
            warnings.warn(
                f"batch cost fit: the robust regression did not converge in {RLM_MAXITER} "
                "iterations; its coefficients are not the optimum",
                RuntimeWarning,
                stacklevel=3,
            )
        beta = np.asarray(fit.params)
        if fit.weights is not None:  # None: RLM stopped at a perfect fit before reweighting
            keep = np.asarray(fit.weights) > 0
        resid = y - x @ beta
    y, resid = y[keep], resid[keep]
    total = float(((y - y.mean()) ** 2).sum())
    return beta, 1.0 - float((resid**2).sum()) / total if total > 0 else float("nan")


def _fit_union_decay(points: list[tuple[int, float]], experts: int, top_k: int) -> float:
    """r in U(P) = E - (E - k) r^(P - 1) by least squares (bounded Brent, scipy; the squared
    error is unimodal in r on calibration data)."""
    from scipy.optimize import minimize_scalar  # not in vLLM's environment, like statsmodels

    p = np.array([pt[0] for pt in points], dtype=float)
    u = np.array([pt[1] for pt in points])

    def sse(r: float) -> float:
        return float(((experts - (experts - top_k) * r ** (p - 1) - u) ** 2).sum())

    fit = minimize_scalar(sse, bounds=(0.5, 0.9999), method="bounded", options={"xatol": 1e-8})
    if not fit.success:
        warnings.warn(f"batch cost fit: U(P)'s decay: {fit.message}", RuntimeWarning, 2)
    return float(fit.x)
