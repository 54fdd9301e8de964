"""The oracle study over an extraction: solve, write `decisions` and `summary`, the Lmax sweep
for every acceptance rule with and without the plain step, in-sample and cross-fitted, and, for
the selected configuration, delta space and lambda (policy.json) and the alpha = 0 ablation.

Which number is the bound: the in-sample optimum (no policy priced on the same tails beats it).
The cross-fitted value (k* chosen on one tail draw, priced on another) is the achievable
estimate; the true optimum lies between them in expectation (pipeline.oracle.fanout).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from pipeline.cost.model import CostModel
from pipeline.data.schemas import SUMMARY_SCHEMA
from pipeline.data.shards import write_table_atomic
from pipeline.data.sql import run_query
from pipeline.models.adapters import MoESpec
from pipeline.oracle.context_analysis import class_table, expert_novelty, sequence_states
from pipeline.oracle.fanout import DEFAULT_CONFIG, OracleConfig, solve_all
from pipeline.oracle.inputs import SequenceInput, extraction_manifest, load_rows
from pipeline.oracle.plots import plot_delta_space, plot_lmax_sweep
from pipeline.oracle.union_from_tables import tail_draws

# The order the study table reads: the exact rules first, the paper's surrogate last.
TABLE_ORDER = ("greedy", "sampling", "surrogate")


@dataclass
class StudyResult:
    sweep: pd.DataFrame  # every (lmax, acceptance, plain_step, category)
    config: OracleConfig
    delta: dict[str, Any]
    ablation: dict[str, Any]
    context: pd.DataFrame
    novelty: dict[str, float]
    paths: dict[str, Path]
    temperature: float | None = None  # the extraction's, for sampling and surrogate

    def selected(self, category: str | None = "all") -> pd.DataFrame:
        """The sweep of the selected configuration (one row per Lmax for one category)."""
        s = self.sweep
        keep = (s["acceptance"] == self.config.acceptance) & (
            s["plain_step"] == self.config.plain_step
        )
        if category is not None:
            keep &= s["category"] == category
        return s[keep].sort_values("lmax")


def _ablation(results: list[dict], inputs: list[SequenceInput], decode, top: int = 5) -> dict:
    changed = total = 0
    cases = []
    for res, seq in zip(results, inputs, strict=True):
        ab = res["ablation"]
        diff = ab["k_star"] != ab["k_star_alpha0"]
        changed += int(diff.sum())
        total += len(diff)
        for i in np.flatnonzero(diff):
            k_full, k_blind = int(ab["k_star"][i]), int(ab["k_star_alpha0"][i])
            weight = float(ab["visit"][i]) * abs(k_full - k_blind)
            cases.append((weight, seq, int(i), k_full, k_blind))
    mean = lambda key: float(np.mean([r["ablation"][key] for r in results]))  # noqa: E731
    cases.sort(key=lambda c: -c[0])
    strongest = []
    for weight, seq, i, k_full, k_blind in cases[:top]:
        before = seq.token_ids[max(0, i - 12) : i + 1].tolist()
        after = seq.token_ids[i + 1 : i + 1 + max(k_full, k_blind)].tolist()
        strongest.append(
            {
                "seq_id": seq.seq_id,
                "i": i,
                "k_star": k_full,
                "k_star_alpha0": k_blind,
                "weight": weight,
                "context": decode(before),
                "next_tokens": decode(after),
            }
        )
    return {
        "states": total,
        "states_changed": changed,
        "share_changed": changed / max(1, total),
        "mean_speedup_bound": mean("speedup"),
        "mean_speedup_alpha0_policy": mean("speedup_alpha0_policy"),
        "mean_speedup_alpha0_believed": mean("speedup_alpha0_model"),
        "strongest_cases": strongest,
    }


def run_study(
    extract_dir: Path,
    model: CostModel,
    spec: MoESpec,
    lmaxes: list[int],
    decisions_lmax: int,
    out: Path,
    config: OracleConfig = DEFAULT_CONFIG,
    decode=lambda ids: str(ids),
    log=print,
) -> StudyResult:
    parts = load_rows(extract_dir)
    if not parts:
        raise ValueError(f"no sequences with tokens under {extract_dir}")
    have = tail_draws(parts[0].tails)
    if config.acceptance not in have:
        raise ValueError(
            f"{extract_dir} has no {config.acceptance} junk tails (it has "
            f"{', '.join(have) or 'none'}): choose another --acceptance or "
            "re-extract"
        )
    log(
        f"[oracle] {len(parts)} sequences, {sum(p.tokens.num_rows - 1 for p in parts):,} "
        f"states, Lmax sweep {lmaxes[0]}..{lmaxes[-1]}; decisions for {config.acceptance} "
        f"acceptance, {'with' if config.plain_step else 'without'} the plain step"
    )
    results = solve_all(parts, model, lmaxes, decisions_lmax, config, spec)
    inputs = [r["input"] for r in results]
    out.mkdir(parents=True, exist_ok=True)
    summary = pa.Table.from_pylist(
        [row for r in results for row in r["summary"]], schema=SUMMARY_SCHEMA
    )
    decisions = pa.concat_tables([r["decisions"] for r in results])
    paths = {"summary": out / "summary.parquet", "decisions": out / "decisions.parquet"}
    write_table_atomic(summary, paths["summary"])
    write_table_atomic(decisions, paths["decisions"])

    sweep = run_query("lmax_sweep", summary=paths["summary"])
    deltas = run_query("delta_space", decisions=paths["decisions"])
    delta = run_query("delta_summary", deltas=deltas).iloc[0].to_dict()
    delta = {k: (None if pd.isna(v) else float(v)) for k, v in delta.items()}
    policy = {
        "lambda_ms_per_token": delta["lambda_ms"],
        "lambda_experts_per_token": delta["lambda_experts"],
        "lmax": decisions_lmax,
        "acceptance": config.acceptance,
        "plain_step": config.plain_step,
        "quantile": 0.01,
        "alternatives": delta["alternatives"],
        "cost_model": model.meta.get("device"),
    }
    paths["policy"] = out / "policy.json"
    paths["policy"].write_text(json.dumps(policy, indent=2) + "\n")
    ablation = _ablation(results, inputs, decode)
    paths["ablation"] = out / "ablation_alpha0.json"
    paths["ablation"].write_text(json.dumps(ablation, indent=2) + "\n")
    states = pd.concat(
        [
            sequence_states(
                seq.seq_id,
                seq.token_ids,
                res["ablation"]["k_star"],
                seq.draft_match,
                seq.routing,
                lambda t: decode([t]),
            )
            for seq, res in zip(inputs, results, strict=True)
        ]
    )
    context = class_table(states)
    novelty = expert_novelty(states)
    paths["context"] = out / "context_classes.csv"
    context.to_csv(paths["context"], index=False)
    paths["novelty"] = out / "context_novelty.json"
    paths["novelty"].write_text(json.dumps(novelty, indent=2) + "\n")
    paths["sweep_csv"] = out / "lmax_sweep.csv"
    sweep.to_csv(paths["sweep_csv"], index=False)
    temperature = extraction_manifest(extract_dir).get("temperature")
    result = StudyResult(sweep, config, delta, ablation, context, novelty, paths, temperature)
    paths["sweep_png"] = plot_lmax_sweep(result.selected(category=None), out / "lmax_sweep.png")
    lam = delta["lambda_ms"] if delta["lambda_ms"] is not None else float("nan")
    paths["delta_png"] = plot_delta_space(deltas, lam, out / "delta_space.png")
    return result


def _cell(row: pd.Series, acceptance: str) -> str:
    if acceptance == "greedy":  # deterministic tails: cross-fitted = in-sample
        return f"{row['speedup_bound']:.3f}"
    cross = row["speedup_crossfit"]
    return f"{row['speedup_bound']:.3f}/" + ("-" if pd.isna(cross) else f"{cross:.3f}")


def bound_table(sweep: pd.DataFrame) -> str:
    """Per Lmax, the pooled bound of every acceptance present, with (k>=0) and without (k>=1)
    the plain step; stochastic rules show in-sample/cross-fitted."""
    overall = sweep[sweep["category"] == "all"]
    present = [a for a in TABLE_ORDER if a in set(overall["acceptance"])]
    cols = [(a, p) for a in present for p in (True, False)]
    header = ["Lmax"] + [f"{a} k>={0 if p else 1}" for a, p in cols]
    rows = []
    for lmax in sorted(overall["lmax"].unique()):
        cells = [str(int(lmax))]
        for acc, plain in cols:
            hit = overall[
                (overall["lmax"] == lmax)
                & (overall["acceptance"] == acc)
                & (overall["plain_step"] == plain)
            ]
            cells.append(_cell(hit.iloc[0], acc) if len(hit) else "")
        rows.append(cells)
    widths = [max(len(r[j]) for r in [header, *rows]) for j in range(len(header))]
    fmt = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
    return "\n".join(fmt(r) for r in [header, *rows])


def format_study(result: StudyResult) -> str:
    temp = "" if result.temperature is None else f", probabilities at T = {result.temperature:g}"
    lines = [
        f"Lmax sweep (sql/lmax_sweep.sql): bound S = Cost_AR / dp[0], all sequences{temp}.",
        "Cells: in-sample/cross-fitted. In-sample is the bound (no policy priced on the same junk",
        "tails beats it); cross-fitted (k* chosen on one tail draw, priced on another) is the",
        "achievable estimate; the true optimum lies between them. Greedy tails are deterministic,",
        "so there both coincide. k>=0: the plain step is an action (S >= 1); k>=1: the paper's.",
        bound_table(result.sweep),
        "",
    ]
    c = result.config
    sel = result.selected()
    lines += [
        f"selected configuration: {c.acceptance} acceptance, "
        f"k>={0 if c.plain_step else 1} (decisions, delta space, lambda, ablation):",
        sel[
            [
                "lmax",
                "sequences",
                "speedup_bound",
                "speedup_crossfit",
                "mean_draft_len",
                "mean_accepted",
            ]
        ].to_string(index=False, float_format="{:.3f}".format, na_rep="-"),
    ]
    cats = result.selected(category=None)
    cats = cats[cats["category"] != "all"]
    if cats["category"].nunique() > 1:
        best = cats.loc[cats.groupby("category")["lmax"].idxmax()]
        cols = ["category", "sequences", "speedup_bound", "mean_draft_len", "mean_accepted"]
        table = best[cols].to_string(index=False, float_format="{:.3f}".format)
        lines += ["", "per category at the largest Lmax:", table]
    d = result.delta
    lines += [
        "",
        f"delta space: {d['alternatives']:.0f} rejected alternatives; quadrants I "
        f"{d['quadrant_i']:.0f}, II {d['quadrant_ii']:.0f}, III {d['quadrant_iii']:.0f}, "
        f"IV {d['quadrant_iv']:.0f} (and {d['flat']:.0f} with no change in progress)",
        f"boundary slope lambda = {d['lambda_ms'] or float('nan'):.4f} ms per token of expected "
        f"progress ({d['lambda_experts'] or float('nan'):.3f} experts per token); written to "
        "policy.json",
    ]
    if d["quadrant_ii"] or d["quadrant_iv"] or (d["lambda_ms"] or 0) <= 0:
        lines.append(
            "warning: quadrants II/IV should be empty and lambda positive; a noisy cost model "
            "(non-monotone beta0(m)) breaks that: recalibrate with more prompts or repeats"
        )
    ab = result.ablation
    lines += [
        "",
        f"alpha = 0 ablation: k* changes at {ab['states_changed']} of {ab['states']} states "
        f"({ab['share_changed']:.1%}); mean bound {ab['mean_speedup_bound']:.3f}x, the "
        f"expert-blind policy achieves {ab['mean_speedup_alpha0_policy']:.3f}x (it believes "
        f"{ab['mean_speedup_alpha0_believed']:.3f}x)",
    ]
    if not result.context.empty:
        cols = [
            "class",
            "states",
            "share_k0",
            "share_k1",
            "k1_lo",
            "k1_hi",
            "share_k4",
            "k4_lo",
            "k4_hi",
        ]
        table = result.context[cols].to_string(index=False, float_format="{:.3f}".format)
        title = (
            "context classes (share of k* = 0, k* = 1 and k* >= 4, 95% bootstrap over sequences):"
        )
        lines += ["", title, table]
        nv = result.novelty
        lines.append(
            f"new experts per layer: {nv['new_experts_script_change']:.2f} at script changes "
            f"({nv['script_change_states']} states), {nv['new_experts_first_mismatch']:.2f} at "
            f"first mismatches ({nv['first_mismatch_states']}), {nv['new_experts_all']:.2f} overall"
        )
    for case in ab["strongest_cases"][:3]:
        lines.append(
            f"  {case['seq_id']} i={case['i']}: k*={case['k_star']} vs "
            f"{case['k_star_alpha0']} blind | ...{case['context'][-40:]!r} -> "
            f"{case['next_tokens'][:30]!r}"
        )
    return "\n".join(lines)
