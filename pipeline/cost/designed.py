"""Designed calibration: timed verification passes whose routing is *set*, not observed.

A verification pass's time depends on which experts it computes, not on what the router would
have chosen. So for each m (positions per pass) the per-layer union of selected experts is
forced to every size U in its feasible range (top_k .. min(m top_k, n_experts); evenly spaced
levels when there are many), with random expert identities and random assignment of tokens to
them (pipeline.models.forced_routing). The (m, U) cells run interleaved in a shuffled order,
several repeats each, at the contexts the prompts give, after a warm-up, on a fixed number of
torch threads. That spans U fully at every m, which natural routing never does, and separates
alpha(m) from beta0(m); it also calibrates models whose weights are random, where natural
routing means nothing.

The rows follow the `rounds` table (ROUNDS_SCHEMA), one per timed pass, with draft_forwards 0
(no draft runs; the draft line comes from observational rounds), so the same fit reads them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from pipeline.cost.model import CostModel
from pipeline.cost.ols import metrics
from pipeline.data.prompts import Prompt, encode
from pipeline.data.schemas import ROUNDS_SCHEMA
from pipeline.models.forced_routing import ForcedRouting, design_plan, feasible_unions
from pipeline.models.kvcache import crop_to
from pipeline.models.loading import ModelPair
from pipeline.models.timing import timed


def union_levels(m: int, top_k: int, num_experts: int, max_levels: int) -> list[int]:
    """The U values to force at m: all feasible ones, or ``max_levels`` evenly spaced between
    the smallest and the largest (both included)."""
    feasible = list(feasible_unions(m, top_k, num_experts))
    if len(feasible) <= max_levels:
        return feasible
    picks = np.linspace(0, len(feasible) - 1, max_levels).round().astype(int)
    return sorted({feasible[i] for i in picks})


def collect_designed_rounds(
    pair: ModelPair,
    prompts: list[Prompt],
    ms: Iterable[int],
    repeats: int = 5,
    max_levels: int = 8,
    max_prompt_tokens: int = 512,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> pa.Table:
    """For every prompt (its context): every (m, U) cell ``repeats`` times in a shuffled
    order; a row per timed pass. gen_id is prompt|m, so that the fit's clustering and
    cross-validation hold out whole (prompt, m) groups as they hold out generations."""
    spec, target = pair.spec, pair.target
    ms = sorted(set(ms))
    if not prompts or not ms or min(ms) < 1 or repeats < 1:
        raise ValueError("designed calibration needs prompts, m >= 1 and repeats >= 1")
    cells = [(m, u) for m in ms for u in union_levels(m, spec.top_k, spec.num_experts,
                                                      max_levels)]  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    order = np.random.default_rng(seed)
    max_pos = getattr(target.config, "max_position_embeddings", 0) or 0
    rows: list[dict] = []
    started = time.perf_counter()
    with torch.no_grad(), ForcedRouting(target, spec) as forced:
        for n, prompt in enumerate(prompts, 1):
            ids = encode(pair.tokenizer, prompt.text, keep_last=max_prompt_tokens)
            if len(ids) < 2:
                continue
            cache = _prefill(pair, ids[:-1])
            base = len(ids) - 1

            def run(m: int, u: int, cache=cache, base=base, last=ids[-1]) -> float:
                return _timed_pass(pair, forced, cache, base, last, m, u, gen)

            if n == 1:  # warm-up: allocator, kernels, every shape once; discarded
                for m, u in cells:
                    run(m, u)
            plan = [cell for cell in cells for _ in range(repeats)]
            for i in order.permutation(len(plan)):
                m, u = plan[i]
                rows.append({
                    "gen_id": f"{prompt.prompt_id}|m{m}", "category": prompt.category,
                    "k": m - 1, "m": m, "t_target_ms": run(m, u), "t_draft_ms": 0.0,
                    "draft_forwards": 0, "u_bar": float(u), "ctx_len": len(ids),
                    "kv_tokens": base, "kv_occupancy": base / max_pos if max_pos else 0.0,
                    "accepted": 0, "round": len(rows),
                })  # fmt: skip
            forced.set(None)
            elapsed = time.perf_counter() - started
            log(f"[calibrate:designed] prompt {n}/{len(prompts)}: {len(rows):,} passes, "
                f"ETA {elapsed / n * (len(prompts) - n):.0f}s")  # fmt: skip
    return pa.Table.from_pylist(rows, schema=ROUNDS_SCHEMA)


def _timed_pass(pair: ModelPair, forced: ForcedRouting, cache, base: int, last: int, m: int,
                u: int, gen: torch.Generator) -> float:  # fmt: skip
    """One verification-shaped pass (the last committed token and m - 1 random ones) with
    the routing forced to a union of u experts per layer; its time in ms, cache rolled back."""
    tokens = [last, *torch.randint(int(pair.target.config.vocab_size), (m - 1,),
                                   generator=gen).tolist()]  # fmt: skip
    forced.set(design_plan(m, u, pair.spec, gen))
    batch = torch.tensor([tokens], device=pair.device)
    _, t_ms = timed(pair.device, lambda: pair.target(batch, past_key_values=cache,
                                                     use_cache=True))  # fmt: skip
    crop_to(cache, base)
    return t_ms


def _prefill(pair: ModelPair, ids: list[int]):
    from transformers import DynamicCache

    cache = DynamicCache(config=pair.target.config)
    if ids:
        pair.target(torch.tensor([ids], device=pair.device), past_key_values=cache,
                    use_cache=True)  # fmt: skip
    return cache


def cell_medians(rounds: pd.DataFrame) -> pd.DataFrame:
    """One row per (prompt, m, U) cell: the median of its repeated passes (the robust cell
    statistic the fit reads; a timer burst in one repeat moves it little)."""
    keys = ["gen_id", "category", "k", "m", "u_bar", "ctx_len", "kv_tokens", "kv_occupancy"]
    out = rounds.groupby(keys, as_index=False).agg(
        t_target_ms=("t_target_ms", "median"), t_draft_ms=("t_draft_ms", "median"),
        draft_forwards=("draft_forwards", "first"), accepted=("accepted", "first"),
        round=("round", "min"), repeats=("t_target_ms", "size"),
    )  # fmt: skip
    return out


def cell_dispersion(rounds: pd.DataFrame) -> pd.DataFrame:
    """Per (m, U) cell: passes, median time and the noise left after the design (the MAD,
    1.4826-scaled, relative to the median)."""
    grouped = rounds.groupby(["m", "u_bar"])["t_target_ms"]
    out = grouped.agg(n="size", median_ms="median").reset_index()
    mad = grouped.apply(lambda x: float((x - x.median()).abs().median() * 1.4826))
    out["mad_ms"] = mad.to_numpy()
    out["rel_mad_pct"] = 100 * out["mad_ms"] / out["median_ms"]
    return out


def error_on(model: CostModel, rounds: pd.DataFrame) -> pd.DataFrame:
    """How well ``model`` prices other rounds (the designed model on held-out observational
    rounds: how it will be used): per m and overall, R2, RMSE and MAPE."""
    y = rounds["t_target_ms"].to_numpy(float)
    pred = np.array([model.t_target(int(r.m), float(r.u_bar), float(r.ctx_len))
                     for r in rounds.itertuples()])  # fmt: skip
    out = []
    for m in sorted(int(m) for m in rounds["m"].unique()):
        sel = (rounds["m"] == m).to_numpy()
        out.append({"m": m, "n": int(sel.sum()), **metrics(y[sel], pred[sel])})
    out.append({"m": "all", "n": len(y), **metrics(y, pred)})
    return pd.DataFrame(out)


def beta0_monotone(per_m: pd.DataFrame, z: float = 1.96) -> list[str]:
    """Where beta0(m) falls as m grows beyond its intervals (each m against the next): an
    empty list is monotone within the intervals. An m whose slope was not estimated (m = 1:
    U is always top_k there, so beta0 absorbs alpha top_k) is a different intercept and is
    left out."""
    rows = per_m.sort_values("m").reset_index(drop=True)
    if "alpha_se" in rows.columns:
        rows = rows[rows["alpha_se"].notna()].reset_index(drop=True)
    problems = []
    for a, b in zip(rows.itertuples(), rows.iloc[1:].itertuples(), strict=False):
        if b.beta0 + z * b.beta0_se < a.beta0 - z * a.beta0_se:
            problems.append(f"beta0({b.m}) = {b.beta0:.3f} +- {z * b.beta0_se:.3f} below "
                            f"beta0({a.m}) = {a.beta0:.3f} +- {z * a.beta0_se:.3f}")  # fmt: skip
    return problems
