"""The report of a random-weight target's designed calibration: the printed table (per m
beta0 and alpha with 95% intervals, fit quality, the paper's A100 alpha and the ratio) and
the MLflow metrics."""

from __future__ import annotations

import math

from pipeline.cost.random_target import RandomCalibration


def _pm(value: float, se: float, spec: str) -> str:
    if value is None or math.isnan(value):
        return "-"
    if se is None or math.isnan(se):
        return f"{value:{spec}}"
    return f"{value:{spec}} +- {1.96 * se:{spec}}"


def format_report(result: RandomCalibration) -> str:
    meta = result.meta
    lines = [
        f"{meta['layout']}: {meta['parameters']:,} parameters (random weights), "
        f"{meta['moe_layers']} MoE layers x {meta['num_experts']} experts, top-{meta['top_k']}; "
        f"{meta['device']} ({meta['device_name']}), {meta['dtype']}, "
        f"experts={meta['experts_implementation']}, torch threads {meta['torch_threads']}; "
        f"{meta['passes']:,} timed passes",
        "",
        f"T_T = beta0(m) + alpha(m) U + c L,  c = {result.coef['c'] * 1000:.4f} "
        f"+- {1.96 * result.coef['c_se'] * 1000:.4f} ms per 1000 tokens (95% CI, clustered)",
        "   m     n   beta0 ms (95% CI)     alpha ms/expert (95% CI)     R2  OOS R2  OOS MAPE"
        "   paper alpha  ratio",
    ]
    paper = result.paper.set_index("m")
    for r in result.per_m.itertuples():
        ref = paper.loc[r.m]
        alpha = _pm(r.alpha, r.alpha_se, ".4f") if not math.isnan(r.alpha_se) else "(fixed 0)"
        ratio = "-" if math.isnan(ref.ratio) else f"{ref.ratio:.2f}x"
        lines.append(
            f"{r.m:>4} {r.n:>5}  {_pm(r.beta0, r.beta0_se, '.3f'):>20}  {alpha:>26}  "
            f"{r.r2:>6.3f} {r.oos_r2:>7.3f} {r.oos_mape:>8.2f}%  {ref.paper_alpha:>11.2f}  "
            f"{ratio:>6}"
        )
    lines.append("")
    if result.differences:
        lines.append(
            "paper (Qwen3-30B-A3B, bf16, A100): NOT like with like -- "
            + "; ".join(result.differences)
        )
    else:
        lines.append("paper (Qwen3-30B-A3B, bf16, A100): same layout and dtype on a GPU")
    cells = result.cells
    lines.append(
        f"noise left per (m, U) cell: median relative MAD "
        f"{cells['rel_mad_pct'].median():.2f}% (max {cells['rel_mad_pct'].max():.2f}%)"
    )
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)


def fit_metrics(result: RandomCalibration) -> dict[str, float]:
    metrics: dict[str, float] = {
        "c": result.coef["c"],
        "c_se": result.coef["c_se"],
        "parameters": result.meta["parameters"],
        "passes": result.meta["passes"],
    }
    for r in result.per_m.itertuples():
        for name in ("beta0", "beta0_se", "alpha", "alpha_se", "r2", "oos_r2", "oos_mape"):
            metrics[f"{name}_m{r.m}"] = getattr(r, name)
    for r in result.paper.itertuples():
        metrics[f"alpha_ratio_to_paper_m{r.m}"] = r.ratio
    return {k: float(v) for k, v in metrics.items() if v is not None and not math.isnan(v)}
