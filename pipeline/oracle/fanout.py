"""Running the oracle over an extraction: per sequence, U(i, k, a) once per (acceptance, draw),
then the DP for every Lmax of the sweep, every acceptance rule the extraction has tails for,
with and without the plain step (k = 0), in-sample and cross-fitted; the rows of `summary`,
the `decisions` of one selected configuration and its alpha = 0 ablation. Sequences are solved
in parallel as Ray tasks, each building its own U tables (they never all sit in the driver).

In-sample vs cross-fitted (docs/contract.md, "Bellman"). Minimising over one draw of junk tails
is optimistic: in expectation, no policy priced on the same tails beats the in-sample optimum,
so it is the BOUND (the headline). Choosing k* on one draw and pricing it on an independent
other draw (both directions, averaged) gives an unbiased price of a policy one could actually
fix in advance: the ACHIEVABLE estimate. The true optimum lies between them in expectation.
Greedy tails are deterministic, so there both coincide (dp0_crossfit_ms = dp0_ms); with a
single stochastic draw the cross-fitted columns are null.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
import ray

from pipeline.cost.model import CostModel
from pipeline.data.schemas import DECISIONS_SCHEMA
from pipeline.models.adapters import MoESpec
from pipeline.oracle.bellman import (
    OracleSolution,
    acceptance_table,
    ar_cost,
    cost_table,
    evaluate_policy,
    solve,
    solve_many,
)
from pipeline.oracle.inputs import ACCEPTANCE_MODES, SequenceInput, SequenceRows, build_input


@dataclass(frozen=True)
class OracleConfig:
    """The configuration whose decisions, delta space, lambda and ablation a run reports."""

    acceptance: str = "surrogate"
    plain_step: bool = True

    def __post_init__(self) -> None:
        if self.acceptance not in ACCEPTANCE_MODES:
            raise ValueError(
                f"acceptance {self.acceptance!r} is not one of {', '.join(ACCEPTANCE_MODES)}"
            )


DEFAULT_CONFIG = OracleConfig()  # surrogate acceptance (the marginal rule's units), k = 0 on


def crossfit_value(
    probs: np.ndarray, costs: list[np.ndarray], solutions: list[OracleSolution]
) -> float | None:
    """Mean over ordered pairs of distinct draws (d, e) of k* chosen on d priced on e; None
    with one draw. With two draws it is never below the in-sample mean: each draw's optimum is
    the best schedule on its own draw."""
    if len(costs) < 2:
        return None
    values = [
        evaluate_policy(probs, costs[e], solutions[d].k_star)[0]
        for d in range(len(costs))
        for e in range(len(costs))
        if d != e
    ]
    return float(np.mean(values))


def solve_sequence(
    seq: SequenceInput,
    model: CostModel,
    lmaxes: list[int],
    decisions_lmax: int,
    config: OracleConfig = DEFAULT_CONFIG,
) -> dict[str, Any]:
    """Summary rows for every (Lmax, acceptance with tails, plain step on/off), decision rows
    and the alpha = 0 ablation for ``config`` at ``decisions_lmax`` (its draw 0)."""
    if config.acceptance not in seq.acceptances():
        raise ValueError(
            f"{seq.seq_id}: no {config.acceptance} tails to price the selected "
            f"configuration (have {', '.join(seq.acceptances())})"
        )
    ar = ar_cost(model, seq.token_experts, seq.prompt_len)
    top = max(lmaxes)
    cut = lambda x: x[:, : top + 1, : top + 1]  # noqa: E731
    summary: list[dict[str, Any]] = []
    decisions: pa.Table | None = None
    ablation: dict[str, Any] = {}
    for acc in seq.acceptances():
        unions = [cut(seq.union(acc, d)) for d in seq.draws(acc)]
        costs = [cost_table(model, u, seq.prompt_len) for u in unions]
        for plain in (True, False):
            probs = acceptance_table(seq.acceptance(acc), top, plain)
            # sols[d][j]: draw d's optimum with budgets capped at lmaxes[j], one pass per draw.
            sols = [solve_many(probs, c, lmaxes) for c in costs]
            cross = _crossfit_per_lmax(probs, costs, sols) if acc != "greedy" else None
            for j, lmax in enumerate(lmaxes):
                per_draw = [s[j] for s in sols]
                dp0 = float(np.mean([s.dp[0] for s in per_draw]))
                # Greedy tails are deterministic: the in-sample value is exact.
                cross_j = dp0 if acc == "greedy" else (None if cross is None else cross[j])
                summary.append(_summary_row(seq, lmax, acc, plain, ar, dp0, cross_j, per_draw))
            if (acc, plain) != (config.acceptance, config.plain_step):
                continue
            sol = sols[0][lmaxes.index(decisions_lmax)]
            at = lambda x: x[:, : decisions_lmax + 1, : decisions_lmax + 1]  # noqa: E731
            probs_l, cost_l, union_l = at(probs), at(costs[0]), at(unions[0])
            sol = replace(sol, e_experts=(probs_l * np.nan_to_num(union_l)).sum(axis=2))
            sol = replace(
                sol,
                **{
                    f: getattr(sol, f)[:, : decisions_lmax + 1]
                    for f in ("q", "e_accept", "e_cost", "e_experts")
                },
            )
            decisions = _decision_rows(seq, decisions_lmax, sol, acc, plain)
            blind = cost_table(model, union_l, seq.prompt_len, alpha_scale=0.0)
            ablated = solve(probs_l, blind)
            # The expert-blind policy priced with the true costs: what ignoring experts loses.
            blind_value = evaluate_policy(probs_l, cost_l, ablated.k_star)
            ablation = {
                "seq_id": seq.seq_id,
                "k_star": sol.k_star,
                "k_star_alpha0": ablated.k_star,
                "visit": sol.visit[:-1],
                "speedup": ar / float(sol.dp[0]),
                "speedup_alpha0_policy": ar / float(blind_value[0]),
                "speedup_alpha0_model": ar / float(ablated.dp[0]),
            }
    return {
        "summary": summary,
        "decisions": decisions,
        "ablation": ablation,
        "input": seq.without_unions(),
    }


def _crossfit_per_lmax(
    probs: np.ndarray, costs: list[np.ndarray], sols: list[list[OracleSolution]]
) -> list[float] | None:
    """Per Lmax, the mean over ordered pairs of distinct draws (d, e) of draw d's k* priced on
    draw e (every Lmax's schedule priced in one pass); None with one draw."""
    pairs = [(d, e) for d in range(len(costs)) for e in range(len(costs)) if d != e]
    if not pairs:
        return None
    values = [
        evaluate_policy(probs, costs[e], np.stack([s.k_star for s in sols[d]]))[:, 0]
        for d, e in pairs
    ]
    return [float(v) for v in np.mean(values, axis=0)]


def _summary_row(
    seq: SequenceInput,
    lmax: int,
    acc: str,
    plain: bool,
    ar: float,
    dp0: float,
    cross: float | None,
    sols: list[OracleSolution],
) -> dict[str, Any]:
    """In-sample columns average each draw's own optimum; statistics of the visitation too."""
    mean = lambda f: float(np.mean([f(s) for s in sols]))  # noqa: E731
    n = seq.n
    return {
        "seq_id": seq.seq_id,
        "category": seq.category,
        "lmax": lmax,
        "acceptance": acc,
        "plain_step": plain,
        "draws": len(sols),
        "n_tokens": n,
        "dp0_ms": dp0,
        "dp0_crossfit_ms": cross,
        "ar_ms": ar,
        "speedup": ar / dp0,
        "speedup_crossfit": None if cross is None else ar / cross,
        "mean_k": mean(lambda s: s.mean_draft_length()),
        "mean_accept": mean(lambda s: s.mean_accepted()),
        # Visit-weighted sums, so totals over sequences can be pooled in SQL.
        "visit_sum": mean(lambda s: s.visit[:-1].sum()),
        "visit_k_sum": mean(lambda s: (s.visit[:-1] * s.k_star).sum()),
        "visit_accept_sum": mean(
            lambda s: (s.visit[:-1] * s.e_accept[np.arange(n), s.k_star]).sum()
        ),
    }


def _decision_rows(
    seq: SequenceInput, lmax: int, sol: OracleSolution, acceptance: str, plain_step: bool
) -> pa.Table:
    n, kk = sol.q.shape
    i = np.repeat(np.arange(n), kk)
    k = np.tile(np.arange(kk), n)
    valid = np.isfinite(sol.q.reshape(-1))
    rows = int(valid.sum())
    return pa.table(
        {
            "seq_id": pa.array([seq.seq_id] * rows, pa.string()),
            "lmax": pa.array(np.full(rows, lmax), pa.int32()),
            "acceptance": pa.array([acceptance] * rows, pa.string()),
            "plain_step": pa.array(np.full(rows, plain_step), pa.bool_()),
            "i": pa.array(i[valid], pa.int32()),
            "k": pa.array(k[valid], pa.int32()),
            "e_accept": pa.array(sol.e_accept.reshape(-1)[valid]),
            "e_cost_ms": pa.array(sol.e_cost.reshape(-1)[valid]),
            "e_experts": pa.array(sol.e_experts.reshape(-1)[valid]),
            "q_value": pa.array(sol.q.reshape(-1)[valid]),
            "chosen": pa.array((sol.k_star[i] == k)[valid]),
            "visit": pa.array(sol.visit[i][valid]),
        },
        schema=DECISIONS_SCHEMA,
    )


def _solve_one(
    part: SequenceRows | SequenceInput,
    spec: MoESpec | None,
    model: CostModel,
    lmaxes: list[int],
    decisions_lmax: int,
    config: OracleConfig,
) -> dict[str, Any]:
    seq = part if isinstance(part, SequenceInput) else build_input(part, spec, max(lmaxes))
    return solve_sequence(seq, model, lmaxes, decisions_lmax, config)


@ray.remote(num_cpus=1)
def _solve_batch(batch, spec, model_json, lmaxes, decisions_lmax, config):
    model = CostModel.from_json(model_json)
    return [_solve_one(p, spec, model, lmaxes, decisions_lmax, config) for p in batch]


def solve_all(
    parts: list[SequenceRows] | list[SequenceInput],
    model: CostModel,
    lmaxes: list[int],
    decisions_lmax: int,
    config: OracleConfig = DEFAULT_CONFIG,
    spec: MoESpec | None = None,
    batches: int = 4,
) -> list[dict[str, Any]]:
    """Solve every sequence (rows of the extraction, built into inputs where they are solved,
    which needs ``spec``; or ready inputs); in parallel Ray tasks when Ray is up, else here.
    Each result has ``summary`` rows, ``decisions``, ``ablation`` and the ``input`` (without
    its U tables)."""
    if decisions_lmax not in lmaxes:
        raise ValueError(f"the decisions Lmax {decisions_lmax} is not in the sweep {lmaxes}")
    if spec is None and any(isinstance(p, SequenceRows) for p in parts):
        raise ValueError("building inputs from extraction rows needs the target's MoE spec")
    model.require_m(range(1, max(lmaxes) + 2), f"the oracle at Lmax {max(lmaxes)}")
    if not ray.is_initialized():
        return [_solve_one(p, spec, model, lmaxes, decisions_lmax, config) for p in parts]
    chunks = [parts[j::batches] for j in range(batches) if parts[j::batches]]
    refs = [
        _solve_batch.remote(c, spec, model.to_json(), lmaxes, decisions_lmax, config)
        for c in chunks
    ]
    results: list[Any] = [None] * len(parts)
    for j, res in enumerate(ray.get(refs)):  # chunk j holds parts j, j + batches, ...
        results[j::batches] = res
    return results
