"""One calibration run: timed rounds on a model pair -> the fitted cost model and every
artifact beside it (rounds.parquet, costmodel.json, per-K summaries from
sql/calibration_per_k.sql, per-m fit table, factor importance, pooled and draft fits, the two
plots), written under one directory.

Two designs of the target's rounds: ``observational`` (speculative rounds as decoding runs
them: U is whatever the router chose) and ``forced`` (pipeline.cost.designed: every U level at
every m, routing set). The forced design also runs the observational rounds, which price the
draft line and are the held-out test of the designed model; both fits are written side by side
(design_comparison.csv) with the per-cell noise left (cells.csv)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from pipeline.cost.designed import (
    cell_dispersion,
    cell_medians,
    collect_designed_rounds,
    error_on,
)
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
DESIGNED_ARTIFACTS = ("designed_rounds.parquet", "cells.csv", "design_comparison.csv",
                      "costmodel_observational.json")  # fmt: skip
DESIGNS = ("observational", "forced")
PLOTS = ("target_vs_experts.png", "draft_vs_k.png")


@dataclass
class CalibrationResult:
    fit: CostFit
    rounds: pd.DataFrame
    per_k: pd.DataFrame
    meta: dict  # what the model was measured on (also in costmodel.json)
    out: Path
    observational: CostFit | None = None  # the forced design's side-by-side observational fit
    comparison: pd.DataFrame | None = None  # per m: both designs, and designed-on-observational
    cells: pd.DataFrame | None = None  # per (m, U) cell: the noise left

    @property
    def paths(self) -> list[Path]:
        extra = DESIGNED_ARTIFACTS if self.observational is not None else ()
        return [self.out / name for name in (*ARTIFACTS, *extra, *PLOTS)]


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
    design: str = "observational",
    designed_ms: Iterable[int] = (),
    designed_repeats: int = 5,
    max_levels: int = 8,
    designed_contexts: Iterable[int] | None = None,
) -> CalibrationResult:
    """Time greedy rounds with a fixed chain of K draft tokens for every K in ``ks`` (and look
    rounds, K tokens and K + 1 draft forwards, for every K in ``look_ks``), fit the cost model
    and write it with its report artifacts under ``out``. ``design="forced"`` fits the target
    on designed passes (every m in ``designed_ms``, default K + 1 for K in ``ks``) instead,
    at the context lengths ``designed_contexts`` (default: 3 spread over the observational
    rounds' range; () for the prompts' own lengths)."""
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {', '.join(DESIGNS)}, got {design!r}")
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
        "torch_threads": torch.get_num_threads(),
        "design": design,
    }
    if design == "forced":
        if designed_contexts is None:  # span what the observational rounds saw
            low, high = int(df["ctx_len"].min()), int(df["ctx_len"].max())
            designed_contexts = sorted({int(x) for x in np.linspace(low, high, 3).round()})
        designed = collect_designed_rounds(pair, prompts, list(designed_ms) or
                                           [k + 1 for k in ks], designed_repeats,
                                           max_levels, contexts=designed_contexts)  # fmt: skip
        meta["designed_contexts"] = list(designed_contexts)
        write_table_atomic(designed, out / "designed_rounds.parquet")
        des = designed.to_pandas()
        observational = fit_cost_model(df, {**meta, "design": "observational"})
        observational.model.save(out / "costmodel_observational.json")
        # The fit reads each cell's median over its repeats (the noise of one pass is
        # reported per cell, cells.csv); the draft line comes from the observational rounds.
        fit = fit_cost_model(cell_medians(des), {**meta, "designed_repeats": designed_repeats,
                                                 "designed_statistic": "cell median"},
                             draft_rounds=df)  # fmt: skip
        comparison = compare_designs(fit, observational, df)
        comparison.to_csv(out / "design_comparison.csv", index=False)
        cells = cell_dispersion(des)
        cells.to_csv(out / "cells.csv", index=False)
        result_extra = {"observational": observational, "comparison": comparison,
                        "cells": cells}  # fmt: skip
    else:
        fit = fit_cost_model(df, meta)
        result_extra = {}
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
    return CalibrationResult(fit, df, per_k, meta, out, **result_extra)


def compare_designs(
    designed: CostFit, observational: CostFit, rounds: pd.DataFrame
) -> pd.DataFrame:
    """Per m, both designs' alpha(m) and beta0(m) with standard errors and fit quality, and
    the designed model's error on the observational rounds (how it will be used)."""
    cols = ["m", "n", "beta0", "beta0_se", "alpha", "alpha_se", "r2", "oos_r2", "oos_mape"]
    both = designed.per_m[cols].merge(observational.per_m[cols], on="m", how="outer",
                                      suffixes=("_forced", "_observational"))  # fmt: skip
    held = error_on(designed.model, rounds)
    held = (
        held[held["m"] != "all"]
        .astype({"m": int})
        .rename(
            columns={
                "n": "n_heldout",
                "r2": "heldout_r2",
                "rmse": "heldout_rmse",
                "mape": "heldout_mape",
            }
        )
    )
    return both.merge(held, on="m", how="left")
