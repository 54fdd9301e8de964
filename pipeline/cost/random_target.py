"""Designed calibration of a real-shape MoE with random weights: the target's verification
cost T_T = beta0(m) + alpha(m) U + c L on a layout (e.g. Qwen3-30B-A3B) without its checkpoint.

The model is built from its config straight on the device (pipeline.models.random_moe), the
routing is forced to every union size U at every m (pipeline.cost.designed) at contexts of
random tokens (pipeline.cost.designed_contexts), and the per-m fit is run on the cells' medians,
as `jobs.calibrate --design forced-contexts` does. Only the target runs: no draft line here.

Written under ``out``: designed_rounds.parquet (a row per timed pass, ROUNDS_SCHEMA), cells.csv
(per (m, U) cell: passes, median, MAD), fit_per_m.csv and target_fit.json (coefficients with
clustered SEs, OOS metrics, where it was measured, and the comparison with the paper's A100
alpha(m)).
"""

from __future__ import annotations

import json
import platform
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import transformers
from transformers import PretrainedConfig

from pipeline.cost.design_stats import beta0_monotone, cell_dispersion, cell_medians
from pipeline.cost.designed_contexts import collect_designed_rounds, random_contexts
from pipeline.cost.fit import drop_interference, fit_per_m
from pipeline.cost.ols import n_splits, num
from pipeline.data.shards import write_table_atomic
from pipeline.models.adapters import moe_spec
from pipeline.models.loading import pick_device, pick_dtype
from pipeline.models.random_moe import LAYOUTS, build_random_moe, layout_config, parameter_count

ARTIFACTS = ("designed_rounds.parquet", "cells.csv", "fit_per_m.csv", "target_fit.json")

# The paper's alpha(m) for Qwen3-30B-A3B in bf16 on an A100 (ms per unique expert, U being the
# mean over MoE layers): about 0.08 up to m = 4 positions per pass, about 0.27 from m = 5.
# Only a run of the same layout, in bf16, on a GPU is comparable to it: a CPU or a scaled-down
# model has other costs per expert altogether (the table is then printed, flagged, as context).
PAPER_LAYOUT = "qwen3-30b-a3b"
PAPER_A100_ALPHA_MS = {"m<=4": 0.08, "m>=5": 0.27}


def paper_alpha(m: int) -> float:
    return PAPER_A100_ALPHA_MS["m<=4"] if m <= 4 else PAPER_A100_ALPHA_MS["m>=5"]


@dataclass
class RandomCalibration:
    per_m: pd.DataFrame  # m, n, beta0, alpha with clustered SE / p, in-sample and OOS metrics
    coef: dict[str, Any]  # beta0 / alpha per m, c, c_se
    paper: pd.DataFrame  # m, alpha, alpha_se, paper_alpha, ratio
    cells: pd.DataFrame  # per (m, U): passes, median ms, MAD
    rounds: pd.DataFrame  # every timed pass
    meta: dict[str, Any]
    notes: list[str]
    differences: list[str]  # what separates this measurement from the paper's (empty: none)
    out: Path

    @property
    def paths(self) -> list[Path]:
        return [self.out / name for name in ARTIFACTS]


def differences_from_paper(
    config: PretrainedConfig,
    device: torch.device,
    dtype: torch.dtype,
    device_name: str,
    experts_implementation: str,
) -> list[str]:
    """What separates this measurement from the paper's (empty: like with like, up to the
    GPU model)."""
    out = []
    paper, ours = layout_fields(layout_config(PAPER_LAYOUT)), layout_fields(config)
    shape = [k for k in paper if ours.get(k) != paper[k]]
    if config.model_type != LAYOUTS[PAPER_LAYOUT]["model_type"] or shape:
        out.append(
            "another layout: " + ", ".join(f"{k} {ours.get(k)} vs {paper.get(k)}" for k in shape)
        )
    if device.type != "cuda":
        out.append(f"device {device.type}, the paper's is an A100 GPU")
    elif "A100" not in device_name:
        out.append(f"GPU {device_name}, the paper's is an A100")
    if dtype != torch.bfloat16:
        out.append(f"dtype {str(dtype).removeprefix('torch.')}, the paper's is bfloat16")
    if experts_implementation != "grouped_mm":  # eager on a GPU prices kernel launches
        out.append(f"experts kernel {experts_implementation}, a GPU serves MoE with grouped_mm")
    return out


def layout_fields(config: PretrainedConfig) -> dict[str, Any]:
    """The fields a layout sets (through getattr: aliases such as num_experts are not in
    to_dict)."""
    return {k: getattr(config, k, None) for k in LAYOUTS[PAPER_LAYOUT] if k != "model_type"}


def paper_comparison(per_m: pd.DataFrame) -> pd.DataFrame:
    """Per m: our alpha(m) (with its SE), the paper's A100 figure and their ratio (none where
    alpha was not estimated: m = 1, U constant)."""
    rows = []
    for r in per_m.itertuples():
        estimated = pd.notna(r.alpha_se)
        ref = paper_alpha(int(r.m))
        rows.append(
            {
                "m": int(r.m),
                "alpha": r.alpha if estimated else float("nan"),
                "alpha_se": r.alpha_se,
                "paper_alpha": ref,
                "ratio": r.alpha / ref if estimated else float("nan"),
            }
        )
    return pd.DataFrame(rows)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def run_random_calibration(
    config: PretrainedConfig,
    device: str | torch.device | None,
    dtype: str | torch.dtype | None,
    experts_implementation: str,
    ms: Iterable[int],
    lengths: Iterable[int],
    per_length: int,
    repeats: int,
    max_levels: int,
    out: Path,
    seed: int = 0,
    log: Callable[[str], None] = print,
    layout: str = "",
) -> RandomCalibration:
    """Build the random-weight model of ``config``, time the designed passes (every m in
    ``ms``, every U level, ``per_length`` random contexts at every length in ``lengths``,
    ``repeats`` each, shuffled), fit per m and write the artifacts under ``out``."""
    dev = pick_device(None if device is None else str(device))
    dt = dtype if isinstance(dtype, torch.dtype) else pick_dtype(dev, dtype)
    spec = moe_spec(config)
    contexts = random_contexts(int(config.vocab_size), lengths, per_length, seed)
    ms = sorted(set(ms))
    # gen_id is context|m: clustered SEs and GroupKFold need several of them (fails early,
    # before the model is built, rather than after an hour of timing)
    if len(contexts) * len(ms) < 2:
        raise ValueError("the fit needs >= 2 (context, m) groups: add contexts or m values")
    params = parameter_count(config)
    log(
        f"[calibrate_random] building {layout or config.model_type}: {params:,} "
        f"parameters, {spec.num_moe_layers} MoE layers x {spec.num_experts} experts, top-"
        f"{spec.top_k}, on {dev} in {str(dt).removeprefix('torch.')} "
        f"(experts={experts_implementation})"
    )
    model = build_random_moe(config, dev, dt, experts_implementation, seed)
    table = collect_designed_rounds(model, spec, contexts, ms, repeats, max_levels, seed, log)
    name = device_name(dev)
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    out.mkdir(parents=True, exist_ok=True)
    write_table_atomic(table, out / "designed_rounds.parquet")
    rounds = table.to_pandas()
    cells = cell_dispersion(rounds)
    cells.to_csv(out / "cells.csv", index=False)
    # As jobs.calibrate's forced-contexts design: each cell's median over its repeats, timer
    # bursts dropped, clustered by context|m.
    df, dropped = drop_interference(cell_medians(rounds))
    n_splits(df["gen_id"])
    coef, per_m, notes = fit_per_m(df)
    if dropped:
        notes.append(
            f"{dropped} cells dropped as timing interference (> 8 robust SD above "
            "the median of their m)"
        )
    notes += [f"beta0 not monotone in m: {p}" for p in beta0_monotone(per_m)]
    per_m.to_csv(out / "fit_per_m.csv", index=False)
    paper = paper_comparison(per_m)
    differences = differences_from_paper(config, dev, dt, name, experts_implementation)
    meta = {
        "layout": layout or config.model_type,
        "model_type": config.model_type,
        "parameters": params,
        "moe_layers": spec.num_moe_layers,
        "num_experts": spec.num_experts,
        "top_k": spec.top_k,
        "device": str(dev),
        "device_name": name,
        "dtype": str(dt).removeprefix("torch."),
        "experts_implementation": experts_implementation,
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "weights": "random",
        "design": "forced",
        "designed_statistic": "cell median",
        "contexts": sorted(set(lengths)),
        "per_length": per_length,
        "repeats": repeats,
        "max_levels": max_levels,
        "seed": seed,
        "passes": len(rounds),
        "config": layout_fields(config),
    }
    result = RandomCalibration(per_m, coef, paper, cells, rounds, meta, notes, differences, out)
    (out / "target_fit.json").write_text(json.dumps(fit_json(result), indent=2, default=str) + "\n")
    return result


def fit_json(result: RandomCalibration) -> dict[str, Any]:
    per_m = {
        str(int(r.m)): {
            "n": int(r.n),
            "beta0": num(r.beta0),
            "beta0_se": num(r.beta0_se),
            "alpha": num(r.alpha),
            "alpha_se": num(r.alpha_se),
            "alpha_p": num(r.alpha_p),
            "r2": num(r.r2),
            "oos_r2": num(r.oos_r2),
            "oos_rmse_ms": num(r.oos_rmse),
            "oos_mape_pct": num(r.oos_mape),
        }
        for r in result.per_m.itertuples()
    }
    return {
        "model": "T_T = beta0(m) + alpha(m) U + c L (ms; U unique experts per MoE layer, "
        "L context tokens)",
        "beta0": {m: v["beta0"] for m, v in per_m.items()},
        "alpha": {m: v["alpha"] for m, v in per_m.items()},
        "c": num(result.coef["c"]),
        "c_se": num(result.coef["c_se"]),
        "per_m": per_m,
        "paper_comparison": {
            "source": "Limits paper, Qwen3-30B-A3B, bfloat16, A100",
            "paper_alpha_ms": PAPER_A100_ALPHA_MS,
            "comparable": not result.differences,
            "differences": result.differences,
            "per_m": [
                {k: (num(v) if isinstance(v, float) else v) for k, v in row.items()}
                for row in result.paper.to_dict("records")
            ],
        },
        "notes": result.notes,
        "meta": result.meta,
    }
