"""The oracle study over an extraction: solve, write `decisions` and `summary`, the Lmax
sweep, delta space and lambda (policy.json), and the alpha = 0 ablation."""

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
from pipeline.oracle.fanout import SequenceInput, load_inputs, solve_all
from pipeline.oracle.plots import plot_delta_space, plot_lmax_sweep


@dataclass
class StudyResult:
    sweep: pd.DataFrame
    delta: dict[str, Any]
    ablation: dict[str, Any]
    context: pd.DataFrame
    novelty: dict[str, float]
    paths: dict[str, Path]


def _ablation(results: list[dict], inputs: list[SequenceInput], decode, top: int = 5) -> dict:
    changed = total = 0
    cases = []
    s_full = s_policy = s_model = 0.0
    for res, seq in zip(results, inputs, strict=True):
        ab = res["ablation"]
        diff = ab["k_star"] != ab["k_star_alpha0"]
        changed += int(diff.sum())
        total += len(diff)
        for i in np.flatnonzero(diff):
            k_full, k_blind = int(ab["k_star"][i]), int(ab["k_star_alpha0"][i])
            weight = float(ab["visit"][i]) * abs(k_full - k_blind)
            cases.append((weight, seq, int(i), k_full, k_blind))
    for res in results:
        ab = res["ablation"]
        s_full += ab["speedup"]
        s_policy += ab["speedup_alpha0_policy"]
        s_model += ab["speedup_alpha0_model"]
    n = max(1, len(results))
    cases.sort(key=lambda c: -c[0])
    strongest = []
    for weight, seq, i, k_full, k_blind in cases[:top]:
        before = seq.token_ids[max(0, i - 12) : i + 1].tolist()
        after = seq.token_ids[i + 1 : i + 1 + max(k_full, k_blind)].tolist()
        strongest.append({
            "seq_id": seq.seq_id, "i": i, "k_star": k_full, "k_star_alpha0": k_blind,
            "weight": weight, "context": decode(before), "next_tokens": decode(after),
        })  # fmt: skip
    return {
        "states": total,
        "states_changed": changed,
        "share_changed": changed / max(1, total),
        "mean_speedup_bound": s_full / n,
        "mean_speedup_alpha0_policy": s_policy / n,
        "mean_speedup_alpha0_believed": s_model / n,
        "strongest_cases": strongest,
    }


def run_study(
    extract_dir: Path,
    model: CostModel,
    spec: MoESpec,
    lmaxes: list[int],
    decisions_lmax: int,
    out: Path,
    acceptance: str = "surrogate",
    decode=lambda ids: str(ids),
    log=print,
) -> StudyResult:
    inputs = load_inputs(extract_dir, spec, max(lmaxes))
    if not inputs:
        raise ValueError(f"no sequences with tokens under {extract_dir}")
    log(f"[oracle] {len(inputs)} sequences, {sum(len(s.token_ids) - 1 for s in inputs):,} "
        f"states, Lmax sweep {lmaxes[0]}..{lmaxes[-1]}")  # fmt: skip
    results = solve_all(inputs, model, lmaxes, decisions_lmax, acceptance)
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
        "acceptance": acceptance,
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
            sequence_states(seq.seq_id, seq.token_ids, res["ablation"]["k_star"],
                            seq.draft_match, seq.routing, lambda t: decode([t]))
            for seq, res in zip(inputs, results, strict=True)
        ]
    )  # fmt: skip
    context = class_table(states)
    novelty = expert_novelty(states)
    paths["context"] = out / "context_classes.csv"
    context.to_csv(paths["context"], index=False)
    paths["novelty"] = out / "context_novelty.json"
    paths["novelty"].write_text(json.dumps(novelty, indent=2) + "\n")
    paths["sweep_csv"] = out / "lmax_sweep.csv"
    sweep.to_csv(paths["sweep_csv"], index=False)
    paths["sweep_png"] = plot_lmax_sweep(sweep, out / "lmax_sweep.png")
    lam = delta["lambda_ms"] if delta["lambda_ms"] is not None else float("nan")
    paths["delta_png"] = plot_delta_space(deltas, lam, out / "delta_space.png")
    return StudyResult(sweep, delta, ablation, context, novelty, paths)


def format_study(result: StudyResult) -> str:
    sweep = result.sweep
    overall = sweep[sweep["category"] == "all"]
    lines = ["Lmax sweep (sql/lmax_sweep.sql), all sequences:",
             overall[["lmax", "sequences", "speedup_bound", "mean_draft_len", "mean_accepted"]]
             .to_string(index=False, float_format="{:.3f}".format)]  # fmt: skip
    cats = sweep[sweep["category"] != "all"]
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
        f"boundary slope lambda = {d['lambda_ms']:.4f} ms per token of expected progress "
        f"({d['lambda_experts']:.3f} experts per token); written to policy.json",
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
        cols = ["class", "states", "share_k1", "k1_lo", "k1_hi", "share_k4", "k4_lo", "k4_hi"]
        table = result.context[cols].to_string(index=False, float_format="{:.3f}".format)
        title = "context classes (share of k* = 1 and k* >= 4, 95% bootstrap over sequences):"
        lines += ["", title, table]
        nv = result.novelty
        lines.append(
            f"new experts per layer: {nv['new_experts_script_change']:.2f} at script changes "
            f"({nv['script_change_states']} states), {nv['new_experts_first_mismatch']:.2f} at "
            f"first mismatches ({nv['first_mismatch_states']}), {nv['new_experts_all']:.2f} overall"
        )
    for case in ab["strongest_cases"][:3]:
        lines.append(f"  {case['seq_id']} i={case['i']}: k*={case['k_star']} vs "
                     f"{case['k_star_alpha0']} blind | ...{case['context'][-40:]!r} -> "
                     f"{case['next_tokens'][:30]!r}")  # fmt: skip
    return "\n".join(lines)
