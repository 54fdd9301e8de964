"""One calibration run: timed rounds on a model pair -> the fitted cost model and every
artifact beside it (rounds.parquet, costmodel.json, per-K summaries from
sql/calibration_per_k.sql, per-m fit table, factor importance, pooled and draft fits, the two
plots), written under one directory.

Three designs of the target's passes: ``forced`` (the default; pipeline.cost.designed): after
every round, a pass with the routing set to the next (m, U) cell of a shuffled design spanning
every union size at every m, timed at that round's state exactly as the round; the same cells in
a separate shuffled run at set context lengths (``forced-contexts``); or ``observational``
(the rounds themselves: U is whatever the router chose). The forced designs still time the
rounds, which price the draft line and are the held-out test of the designed model; both fits
are written side by side (design_comparison.csv) with the per-cell noise left (cells.csv)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from pipeline.cost.design_stats import cell_dispersion, cell_medians, error_on, heldout_summary
from pipeline.cost.designed import InSituDesign
from pipeline.cost.designed_contexts import collect_designed_rounds, prompt_contexts
from pipeline.cost.fit import CostFit, fit_cost_model
from pipeline.cost.modes import fit_modes
from pipeline.cost.plots import plot_draft_vs_k, plot_target_vs_experts
from pipeline.cost.provenance import pair_provenance
from pipeline.cost.rounds import collect_rounds
from pipeline.data.prompts import Prompt
from pipeline.data.shards import write_table_atomic
from pipeline.data.sql import run_query
from pipeline.decode.types import SamplingConfig
from pipeline.models.loading import ModelPair

ARTIFACTS = (
    "costmodel.json",
    "rounds.parquet",
    "per_k.csv",
    "fit_per_m.csv",
    "factor_importance.csv",
    "pooled_and_draft.json",
)
DESIGNED_ARTIFACTS = (
    "designed_rounds.parquet",
    "cells.csv",
    "design_comparison.csv",
    "design_summary.json",
    "costmodel_observational.json",
)
DESIGNS = ("forced", "forced-contexts", "observational")
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
    summary: dict | None = None  # both models on the rounds, overall (design_summary.json)

    @property
    def paths(self) -> list[Path]:
        extra = DESIGNED_ARTIFACTS if self.observational is not None else ()
        return [self.out / name for name in (*ARTIFACTS, *extra, *PLOTS)]


# Timings per pass. One, as decoding runs each pass once: a pass repeated back to back finds
# its experts' weights in cache. On this CPU the medians of 3 and of 5 were no less noisy than
# single passes (held-out MAPE 9.2% and 8.4% against 7.3-8.0%). More repeats stay available.
DEFAULT_REPEATS = 1


def run_calibration(
    pair: ModelPair,
    prompts: list[Prompt],
    ks: list[int],
    max_new_tokens: int,
    warmup_tokens: int,
    out: Path,
    repeats: int | None = None,
    look_ks: Iterable[int] = (),
    design: str = "forced",
    designed_ms: Iterable[int] = (),
    designed_repeats: int = 5,
    max_levels: int = 8,
    designed_contexts: Iterable[int] | None = None,
    designed_per_round: int = 1,
    modes: Sequence[SamplingConfig] = (),
) -> CalibrationResult:
    """Time rounds with a fixed chain of K draft tokens for every K in ``ks`` (and look rounds,
    K tokens and K + 1 draft forwards, for every K in ``look_ks``) in each decoding mode of
    ``modes`` (() : greedy), fit the cost model and write it with its report artifacts under
    ``out``. The first mode's rounds give the file's own draft line; every mode gets its draft
    and acceptance-walk lines in ``modes`` (pipeline.cost.modes).

    ``design="forced"`` fits the target on designed passes (every m in ``designed_ms``,
    default K + 1 for K in ``ks``) timed in situ: ``designed_per_round`` after every round, at
    that round's state, with the rounds' own repeats. ``"forced-contexts"`` times them in a
    separate shuffled run instead, ``designed_repeats`` per cell at the context lengths
    ``designed_contexts`` (default: 3 spread over the prompts' lengths to the end of their
    generations; () for the prompts' own lengths). ``"observational"`` fits the rounds."""
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {', '.join(DESIGNS)}, got {design!r}")
    repeats = repeats or DEFAULT_REPEATS
    ms = list(designed_ms) or [k + 1 for k in ks]
    insitu = None
    if design == "forced":
        insitu = InSituDesign(pair.spec, ms, max_levels, repeats, designed_per_round)
    rounds = collect_rounds(
        pair,
        prompts,
        ks,
        max_new_tokens,
        warmup_tokens,
        repeats=repeats,
        look_ks=look_ks,
        observer=insitu,
        modes=modes,
    )
    out.mkdir(parents=True, exist_ok=True)
    rounds_path = out / "rounds.parquet"
    write_table_atomic(rounds, rounds_path)
    df = rounds.to_pandas()
    base = (list(modes) or [SamplingConfig()])[0]
    # The file's own draft line is the first mode's; the rounds of every mode price the target.
    base_df = df[df["temperature"] == base.temperature].reset_index(drop=True)
    meta = {
        # device, dtype, experts implementation, checkpoint paths and fingerprints: what
        # CostModel.check_measured_on compares wherever the model is used
        **pair_provenance(pair),
        "batch_size": 1,
        "timing_repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "design": design,
        # The mode the file's own draft line prices (every mode's prices: ``modes``).
        "sampling": asdict(base),
    }
    result_extra: dict = {}
    if design == "observational":
        fit = fit_cost_model(df, meta, draft_rounds=base_df)
    else:
        # What only the designed fit was measured with; the observational file keeps ``meta``.
        designed_meta = dict(meta)
        if insitu is not None:
            designed = insitu.table()
            designed_meta["designed_per_round"] = designed_per_round
            target_rounds = designed_df = designed.to_pandas()  # a row: median of its repeats
        else:
            if designed_contexts is None:  # span what the observational rounds saw
                low, high = int(df["ctx_len"].min()), int(df["ctx_len"].max())
                designed_contexts = sorted({int(x) for x in np.linspace(low, high, 3).round()})
            contexts = prompt_contexts(pair.tokenizer, prompts, designed_contexts)
            designed = collect_designed_rounds(
                pair.target, pair.spec, contexts, ms, designed_repeats, max_levels
            )
            designed_meta["designed_contexts"] = list(designed_contexts)
            designed_meta["designed_repeats"] = designed_repeats
            designed_meta["designed_statistic"] = "cell median"
            # The fit reads each cell's median over its repeats (the noise of one pass is
            # reported per cell, cells.csv).
            designed_df = designed.to_pandas()
            target_rounds = cell_medians(designed_df)
        write_table_atomic(designed, out / "designed_rounds.parquet")
        observational = fit_cost_model(
            df, {**meta, "design": "observational"}, draft_rounds=base_df
        )
        # The draft line comes from the observational rounds (designed passes run no draft).
        fit = fit_cost_model(target_rounds, designed_meta, draft_rounds=base_df)
        # How each model prices the rounds: held out for the designed one, in-sample for the
        # observational one (its own out-of-sample figures are per m in its fit).
        fit.model.meta["fit"]["on_observational_rounds"] = heldout_summary(fit.model, df)
        observational.model.meta["fit"]["on_own_rounds"] = heldout_summary(observational.model, df)
        observational.model.save(out / "costmodel_observational.json")
        comparison = compare_designs(fit, observational, df)
        comparison.to_csv(out / "design_comparison.csv", index=False)
        cells = cell_dispersion(designed_df)
        cells.to_csv(out / "cells.csv", index=False)
        summary = {
            "designed_on_observational_rounds": fit.model.meta["fit"]["on_observational_rounds"],
            "observational_on_own_rounds": observational.model.meta["fit"]["on_own_rounds"],
        }
        (out / "design_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        result_extra = {
            "observational": observational,
            "comparison": comparison,
            "cells": cells,
            "summary": summary,
        }
    top_p = next((mode.top_p for mode in modes if not mode.greedy), 1.0)
    fit.model.meta["modes"] = fit_modes(df, fit.model, top_p)
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
    both = designed.per_m[cols].merge(
        observational.per_m[cols], on="m", how="outer", suffixes=("_forced", "_observational")
    )
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
