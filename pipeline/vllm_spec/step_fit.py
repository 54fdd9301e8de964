"""Fitting vLLM's step costs (pipeline.vllm_spec.step_cost) to the calibration drafter's step
records (pipeline.vllm_spec.calibration_drafter).

Every record is one engine step as the drafter saw it: the time from the end of one
proposal to the start of the next (vLLM's scheduling, the target's pass, sampling and
verification), the positions that pass verified and the mean union of experts per MoE layer
it routed to (a hook on vLLM's gates), the attention work A = sum_r n_r L_r, the rows B
(the design draws each row's length apart, so B varies apart from P), and the
drafter's own draft forwards and decision time. Steps whose pass held tokens the drafter
did not schedule (a new request's prefill) are left out of the target's fit. Ordinary least
squares (statsmodels); the union's growth is fitted in log space through the origin.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import statsmodels.api as sm

from pipeline.cost.batch import BatchCost


def read_records(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _ols(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    result = sm.OLS(y, sm.add_constant(x, has_constant="add")).fit()
    return np.asarray(result.params), float(result.rsquared)


def fit_step_cost(
    records: list[dict[str, Any]], experts: int, top_k: int, trim: float = 0.02
) -> tuple[BatchCost, dict[str, Any]]:
    """The cost model and its fit report. ``trim``: the slowest share of steps (timer bursts
    on a shared machine) left out of the target's fit."""
    steps = [r for r in records if r.get("hook_positions") == r["positions"] and r["rows"] > 0]
    if len(steps) < 20:
        raise ValueError(
            f"only {len(steps)} decode steps recorded (need >= 20): decode more prompts or tokens"
        )
    y = np.array([r["step_ms"] for r in steps])
    keep = y <= np.quantile(y, 1 - trim)
    x = np.array([[r["positions"], r["union"], r["attended"], r["rows"]] for r in steps])[keep]
    (b0, b_pos, b_union, b_ctx, b_row), r2_target = _ols(x, y[keep])
    pred = b0 + x @ np.array([b_pos, b_union, b_ctx, b_row])
    forwards = [f for r in records for f in r.get("draft_forwards", [])]
    if len(forwards) < 5:
        raise ValueError("fewer than 5 draft forwards recorded: the design drew no drafts")
    tokens = np.array([[f[1]] for f in forwards], dtype=float)
    (d0, d_tok), r2_draft = _ols(tokens, np.array([f[2] for f in forwards]))
    decide = np.array([r["propose_ms"] - r["draft_ms"] for r in records])
    (s0, s_row), r2_step = _ols(np.array([[r["rows"]] for r in records], dtype=float), decide)
    p = np.array([r["positions"] for r in steps], dtype=float)
    u = np.array([r["union"] for r in steps])
    ok = (p > 1) & (u < experts)
    ratio = np.clip((experts - u[ok]) / (experts - top_k), 1e-6, 1.0)
    decay = float(np.exp(np.sum((p[ok] - 1) * np.log(ratio)) / np.sum((p[ok] - 1) ** 2)))
    cost = BatchCost(
        b0=float(b0),
        b_pos=float(b_pos),
        b_union=float(b_union),
        b_ctx=float(b_ctx),
        d0=float(d0),
        d_tok=float(d_tok),
        s0=float(s0),
        s_row=float(s_row),
        experts=experts,
        top_k=top_k,
        union_decay=decay,
        r2_target=r2_target,
        r2_draft=r2_draft,
        r2_step=r2_step,
        records=int(keep.sum()),
        b_row=float(b_row),
    )
    resid = y[keep] - pred
    fit = {
        "steps": len(records),
        "decode_steps": len(steps),
        "fitted_steps": int(keep.sum()),
        "draft_forwards": len(forwards),
        "bias_ms": float(resid.mean()),
        "mape": float(np.mean(np.abs(resid) / y[keep])),
        "trim": trim,
        "mean_step_ms": float(y[keep].mean()),
    }
    return cost, fit
