"""Fitting the acceptance model on traces: ridge logistic regressions (pipeline.acceptance.
logistic; labels may be probabilities: the sampled mode's sum min(p, q)), split by prompt, with
held-out log loss, Brier score and calibration against the draft's raw confidence and a
constant, and each kept fit's iterations and convergence in the report."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.acceptance.features import FEATURE_NAMES
from pipeline.acceptance.logistic import fit_logistic, kept_weights
from pipeline.acceptance.model import RECENT, AcceptanceModel, ModeModel
from pipeline.acceptance.repeats import fit_repeat_weights, trace_indicators
from pipeline.acceptance.traces import (
    AcceptanceTrace,
    collect_traces,
    load_traces,
    save_traces,
)
from pipeline.cost.provenance import pair_provenance
from pipeline.data.prompts import Prompt
from pipeline.models.loading import ModelPair

CONF = FEATURE_NAMES.index("conf") - 1  # its column in a trace's stats


def design(
    traces: list[AcceptanceTrace], decay: float, prior: float, shift: int, hidden: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows [bias, stats_i, recent_i] (then the draft's hidden state at i with ``hidden``),
    labels of position i + shift (0: current, 1: next) and row weights. recent_i is the moving
    average of labels before i, from ``prior``: the outcomes the policy has seen when it
    decides at position i. For `next` a row is weighted by label_i: position i + 1 matters to a
    chain only when token i is accepted, so `next` is P(accept i + 1 | i accepted).

    A head's trace holds chains (``depth``): a `next` pair stays inside one, and recent
    acceptance is what the chains' first rows (the head's teacher-forced rows, one per
    position) made it before the chain began, then moved as the policy moves it while
    drafting (each earlier token of the chain counted as accepted)."""
    xs, ys, ws = [], [], []
    for t in traces:
        n = len(t.labels)
        recent = np.empty(n)
        r = prior
        if t.depth is None:
            for i in range(n):
                recent[i] = r
                r = decay * r + (1 - decay) * t.labels[i]
            follows = np.ones(max(n - 1, 0), dtype=bool)
        else:
            first, inside = None, r
            for i in range(n):
                if t.depth[i] == 1:
                    if first is not None:
                        r = decay * r + (1 - decay) * first
                    first, inside = t.labels[i], r
                else:  # as the policy does: each earlier chain token counted as accepted
                    inside = decay * inside + (1 - decay)
                recent[i] = inside
            follows = t.depth[1:] == t.depth[:-1] + 1
        rows = np.column_stack([np.ones(n), t.stats, recent, *([t.hidden] if hidden else [])])
        xs.append(rows[: n - shift])
        ys.append(t.labels[shift:])
        ws.append(t.labels[: n - shift] * follows if shift else np.ones(n))
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(ws)


def head_design(traces: list[AcceptanceTrace]) -> tuple[np.ndarray, np.ndarray]:
    """Rows [1, hidden state that produced q_i] and labels of position i (the head's data)."""
    xs = [np.column_stack([np.ones(len(t.labels)), t.hidden]) for t in traces]
    return np.concatenate(xs), np.concatenate([t.labels for t in traces])


def log_loss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


@dataclass
class Scores:
    n: int
    mean_label: float
    log_loss: float
    brier: float
    log_loss_constant: float  # the training mean for everyone
    log_loss_confidence: float  # the draft's raw confidence as the probability
    calibration: list[tuple[float, float, int]]  # (mean predicted, mean label, n) per decile

    def row(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def score(
    w: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    train_mean: float,
    weights: np.ndarray | None = None,
) -> Scores:
    """Held-out scores; rows with weight 0 (a `next` row after a rejection) are left out and
    soft weights are treated as inclusion (the greedy mode's are 0 or 1)."""
    if weights is not None:
        keep = weights > 0
        x, y = x[keep], y[keep]
    p = 1 / (1 + np.exp(-(x @ w)))
    order = np.argsort(p)
    calibration = [
        (float(p[idx].mean()), float(y[idx].mean()), len(idx))
        for idx in np.array_split(order, 10)
        if len(idx)
    ]
    return Scores(
        len(y),
        float(y.mean()),
        log_loss(p, y),
        float(np.mean((p - y) ** 2)),
        log_loss(np.full_like(y, train_mean), y),
        log_loss(x[:, 1 + CONF], y),
        calibration,
    )


def fit_acceptance(
    traces: list[AcceptanceTrace],
    union_by_m: list[float],
    decay: float = 0.8,
    heldout_every: int = 5,
    meta: dict | None = None,
    hidden: bool = True,
) -> tuple[AcceptanceModel, dict]:
    """The model on all traces, and a report of the same fit's scores on every
    ``heldout_every``-th prompt held out (fitted on the others). With ``hidden`` the models
    also read the draft's hidden state (ridge-regularised, like the head)."""
    l2 = 1e-2 if hidden else 1e-3
    modes: dict[str, ModeModel] = {}
    report: dict = {}
    for mode, pick in (
        ("greedy", lambda t: t.temperature <= 0),
        ("sampled", lambda t: t.temperature > 0),
    ):
        chosen = [t for t in traces if pick(t)]
        if not chosen:
            continue
        ids = sorted({t.prompt_id for t in chosen})
        held = set(ids[::heldout_every])
        train = [t for t in chosen if t.prompt_id not in held]
        test = [t for t in chosen if t.prompt_id in held]
        prior = float(np.mean(np.concatenate([t.labels for t in chosen])))
        weights, mode_report = {}, {"prompts": len(ids), "heldout_prompts": len(held)}
        kept: dict = {}  # the kept fits' convergence reports (held-out fits only warn)
        held_next = None
        for kind, shift in (("current", 0), ("next", 1)):
            if test:
                x_tr, y_tr, w_tr = design(train, decay, prior, shift, hidden)
                w_held = kept_weights(
                    f"{mode}/{kind} held out", fit_logistic(x_tr, y_tr, l2, weights=w_tr)
                )
                x_te, y_te, w_te = design(test, decay, prior, shift, hidden)
                mean = float(np.average(y_tr, weights=w_tr))
                mode_report[kind] = score(w_held, x_te, y_te, mean, w_te).row()
                held_next = w_held if kind == "next" else held_next
            x_all, y_all, w_all = design(chosen, decay, prior, shift, hidden)
            fit = fit_logistic(x_all, y_all, l2, weights=w_all)
            weights[kind] = [float(v) for v in kept_weights(f"{mode}/{kind}", fit, kept, kind)]
        x_head, y_head = head_design(chosen)
        head = kept_weights(f"{mode}/head", fit_logistic(x_head, y_head, l2=1e-2), kept, "head")
        if test:
            train_x, train_y = head_design(train)
            x_te, y_te = head_design(test)
            w_held = kept_weights(f"{mode}/head held out", fit_logistic(train_x, train_y, l2=1e-2))
            held_scores = score(w_held, x_te, y_te, float(train_y.mean()))
            mode_report["head"] = {
                k: v for k, v in held_scores.row().items() if k != "log_loss_confidence"
            }
        mode_report["convergence"] = kept
        x_all, _, _ = design(chosen, decay, prior, 0, hidden)
        # Without the recent term, which is added back at decision time.
        w_cur = np.array(weights["current"])
        w_cur[RECENT] = 0.0
        logits = x_all @ w_cur
        spread = [float(v) for v in np.quantile(logits, np.arange(0.05, 1.0, 0.1))]
        repeat: list[float] = []
        if mode == "greedy":  # an outcome "the last time here" is the draft's argmax's
            repeat, mode_report["repeat"] = fit_repeat(
                chosen, train, test, (decay, prior, hidden), weights["next"], held_next
            )
        modes[mode] = ModeModel(
            weights["current"], weights["next"], prior, [float(v) for v in head], spread, repeat
        )
        report[mode] = mode_report
    if not modes:
        raise ValueError("no traces to fit the acceptance model on")
    if not union_by_m or any(not np.isfinite(u) for u in union_by_m):
        raise ValueError(
            f"expert unions by m incomplete ({union_by_m}): trace more tokens "
            "per prompt than the largest m"
        )
    return AcceptanceModel(modes, union_by_m, decay, dict(meta or {}, fit=report)), report


def fit_repeat(
    chosen: list[AcceptanceTrace],
    train: list[AcceptanceTrace],
    test: list[AcceptanceTrace],
    settings: tuple[float, float, bool],
    w_next: list[float],
    w_next_held: np.ndarray | None,
) -> tuple[list[float], dict]:
    """The `next` model's repeat weights (pipeline.acceptance.repeats) on top of its fitted
    logit, and the held-out log loss without and with them (``settings``: design's decay,
    prior and hidden). No weights for traces saved without their text."""
    if any(t.tokens is None for t in chosen):
        return [], {"fitted": False, "why": "traces saved without their text"}

    def rows(ts: list[AcceptanceTrace], w: np.ndarray) -> tuple[np.ndarray, ...]:
        x, y, wt = design(ts, *settings[:2], 1, settings[2])
        marks = [trace_indicators(t.tokens, t.labels, t.depth)[: len(t.labels) - 1] for t in ts]
        return x @ w, np.concatenate(marks), y, wt

    report: dict = {"fitted": True}
    if test and w_next_held is not None:
        beta = np.array(fit_repeat_weights(*rows(train, w_next_held)))
        z, marks, y, wt = rows(test, w_next_held)
        keep = wt > 0
        for key, logit in (("without", z), ("with", z + marks @ beta)):
            report[f"heldout_log_loss_{key}"] = log_loss(1 / (1 + np.exp(-logit[keep])), y[keep])
    z, marks, y, wt = rows(chosen, np.asarray(w_next))
    weights = fit_repeat_weights(z, marks, y, wt)
    report.update(
        weights=weights,
        rows_agreed=int(marks[wt > 0, 0].sum()),
        rows_missed=int(marks[wt > 0, 1].sum()),
    )
    return weights, report


def train_acceptance(
    pair: ModelPair,
    prompts: list[Prompt],
    temperatures: list[float],
    max_new_tokens: int,
    max_m: int,
    out: Path,
    decay: float = 0.8,
    seed: int = 0,
    log: Callable[[str], None] = print,
    traces_path: Path | None = None,
) -> tuple[AcceptanceModel, dict]:
    """Trace ``prompts`` at every temperature, fit, save to ``out`` (acceptance.json); the
    model and its held-out report. ``traces_path``: the traces are saved there, or read from
    there when it exists (a refit without decoding again)."""
    t0 = time.perf_counter()
    pair_meta = {
        k: v
        for k, v in pair_provenance(pair).items()
        if k in ("target_model", "target_fingerprint", "draft_model", "draft_fingerprint")
    }
    meta = {
        "pair": pair_meta,
        "prompts": [p.prompt_id for p in prompts],
        "temperatures": temperatures,
        "max_new_tokens": max_new_tokens,
    }
    if traces_path is not None and Path(traces_path).exists():
        traces, unions, meta = load_traces(Path(traces_path))
        for key in ("target_fingerprint", "draft_fingerprint"):
            if meta.get("pair", {}).get(key) != pair_meta.get(key):
                raise ValueError(
                    f"{traces_path} holds traces of another pair ({key} "
                    f"{meta.get('pair', {}).get(key)}, here {pair_meta.get(key)}):"
                    " remove it or pass another --traces path"
                )
        log(
            f"  {len(traces)} traces read from {traces_path} (its settings: temperatures "
            f"{meta.get('temperatures')}, {meta.get('max_new_tokens')} tokens)"
        )
    else:
        traces, unions = collect_traces(
            pair, prompts, temperatures, max_new_tokens, max_m, seed, log
        )
        if traces_path is not None:
            save_traces(Path(traces_path), traces, unions, meta)
    meta = {
        **meta,
        "positions": int(sum(len(t.labels) for t in traces)),
        "trace_seconds": round(time.perf_counter() - t0, 1),
    }
    model, report = fit_acceptance(traces, unions.means(), decay, meta=meta)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    model.save(Path(out))
    return model, report
