"""One calibration run: timed rounds on a model pair -> the fitted cost model and every
artifact beside it (rounds.parquet, costmodel.json, per-K summaries from
sql/calibration_per_k.sql, per-m fit table, factor importance, pooled and draft fits, the two
plots), written under one directory."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from pipeline.cost.fit import CostFit, fit_cost_model
from pipeline.cost.plots import plot_draft_vs_k, plot_target_vs_experts
from pipeline.cost.provenance import pair_provenance
from pipeline.cost.rounds import collect_rounds
from pipeline.data.prompts import Prompt
from pipeline.data.shards import write_table_atomic
from pipeline.data.sql import run_query
from pipeline.models.loading import ModelPair

ARTIFACTS = ("costmodel.json", "rounds.parquet", "per_k.csv", "fit_per_m.csv",
             "factor_importance.csv", "pooled_and_draft.json")  # fmt: skip
PLOTS = ("target_vs_experts.png", "draft_vs_k.png")


@dataclass
class CalibrationResult:
    fit: CostFit
    rounds: pd.DataFrame
    per_k: pd.DataFrame
    meta: dict  # what the model was measured on (also in costmodel.json)
    out: Path

    @property
    def paths(self) -> list[Path]:
        return [self.out / name for name in (*ARTIFACTS, *PLOTS)]


def default_repeats(pair: ModelPair) -> int:
    """Timings per pass: CUDA events are exact on GPU; on CPU the median of 3 fights noise."""
    return 1 if pair.device.type == "cuda" else 3


def run_calibration(
    pair: ModelPair,
    prompts: list[Prompt],
    ks: list[int],
    max_new_tokens: int,
    warmup_tokens: int,
    out: Path,
    repeats: int | None = None,
    look_ks: Iterable[int] = (),
) -> CalibrationResult:
    """Time greedy rounds with a fixed chain of K draft tokens for every K in ``ks`` (and look
    rounds, K tokens and K + 1 draft forwards, for every K in ``look_ks``), fit the cost model
    and write it with its report artifacts under ``out``."""
    repeats = repeats or default_repeats(pair)
    rounds = collect_rounds(pair, prompts, ks, max_new_tokens, warmup_tokens, repeats=repeats,
                            look_ks=look_ks)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    rounds_path = out / "rounds.parquet"
    write_table_atomic(rounds, rounds_path)
    df = rounds.to_pandas()
    meta = {
        # device, dtype, experts implementation, checkpoint paths and fingerprints: what
        # CostModel.check_measured_on compares wherever the model is used
        **pair_provenance(pair),
        "batch_size": 1,
        "timing_repeats": repeats,
    }
    fit = fit_cost_model(df, meta)
    fit.model.save(out / "costmodel.json")
    per_k = run_query("calibration_per_k", rounds=rounds_path)
    per_k.to_csv(out / "per_k.csv", index=False)
    fit.per_m.to_csv(out / "fit_per_m.csv", index=False)
    fit.factors.to_csv(out / "factor_importance.csv", index=False)
    (out / "pooled_and_draft.json").write_text(
        json.dumps({"pooled_linear_k": fit.pooled, "draft": fit.draft}, indent=2) + "\n"
    )
    plot_target_vs_experts(df, fit.model, out / "target_vs_experts.png")
    plot_draft_vs_k(df, fit.model, out / "draft_vs_k.png")
    return CalibrationResult(fit, df, per_k, meta, out)
