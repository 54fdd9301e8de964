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


def context_ids(prompt_ids: list[list[int]], index: int, length: int) -> list[int]:
    """A context of exactly ``length`` tokens ending with prompt ``index``: its last tokens,
    or, when it is shorter, the other prompts' tokens before it (real text, cycled)."""
    n = len(prompt_ids)
    # The other prompts in order (this one when it is alone): prepended, again and again.
    filler = [t for j in range(1, n) for t in prompt_ids[(index + j) % n]] or prompt_ids[index]
    if not filler:
        raise ValueError("the prompts have no tokens to build a context from")
    ids = list(prompt_ids[index])
    while len(ids) < length:
        ids = filler[-(length - len(ids)) :] + ids
    return ids[-length:]


def collect_designed_rounds(
    pair: ModelPair,
    prompts: list[Prompt],
    ms: Iterable[int],
    repeats: int = 5,
    max_levels: int = 8,
    max_prompt_tokens: int = 512,
    seed: int = 0,
    log: Callable[[str], None] = print,
    contexts: Iterable[int] = (),
) -> pa.Table:
    """For every prompt and context length L (``contexts``; none given: the prompt's own
    length): every (m, U) cell ``repeats`` times, all in one shuffled order; a row per timed
    pass.
    Setting L as well spans the context term, which would otherwise trade off against
    beta0(m) over the prompts' few lengths. gen_id is prompt|L|m, so that the fit's clustering
    and cross-validation hold out whole groups as they hold out generations."""
    spec, target = pair.spec, pair.target
    ms = sorted(set(ms))
    contexts = sorted(set(contexts))
    if not prompts or not ms or min(ms) < 1 or repeats < 1 or (contexts and contexts[0] < 2):
        raise ValueError("designed calibration needs prompts, m >= 1, repeats >= 1 and "
                         "contexts >= 2 tokens")  # fmt: skip
    cells = [(m, u) for m in ms for u in union_levels(m, spec.top_k, spec.num_experts,
                                                      max_levels)]  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    order = np.random.default_rng(seed)
    max_pos = getattr(target.config, "max_position_embeddings", 0) or 0
    encoded = [encode(pair.tokenizer, p.text, keep_last=max_prompt_tokens) for p in prompts]
    runs = [(i, length) for i in range(len(prompts))
            for length in (contexts or [len(encoded[i])]) if length >= 2]  # fmt: skip
    rows: list[dict] = []
    with torch.no_grad(), ForcedRouting(target, spec) as forced:
        # Every context's cache stays alive, so that one shuffled order interleaves all the
        # (context, m, U) cells: a drift in the machine's speed during the run then spreads
        # over every cell instead of lining up with the context length or the prompt.
        states = []
        for i, length in runs:
            ids = context_ids(encoded, i, length)
            states.append((prompts[i], ids, _prefill(pair, ids[:-1])))
        log(f"[calibrate:designed] {len(states)} contexts x {len(cells)} (m, U) cells x "
            f"{repeats} repeats = {len(states) * len(cells) * repeats:,} passes")  # fmt: skip

        def run(state, m: int, u: int) -> float:
            _, ids, cache = state
            return _timed_pass(pair, forced, cache, len(ids) - 1, ids[-1], m, u, gen)

        for m, u in cells:  # warm-up: allocator, kernels, every shape once; discarded
            run(states[0], m, u)
        plan = [(s_, cell) for s_ in range(len(states)) for cell in cells
                for _ in range(repeats)]  # fmt: skip
        started, report_every = time.perf_counter(), max(1, len(plan) // 10)
        for done, j in enumerate(order.permutation(len(plan)), 1):
            s_, (m, u) = plan[j]
            prompt, ids, _ = states[s_]
            base = len(ids) - 1
            rows.append({
                "gen_id": f"{prompt.prompt_id}|L{len(ids)}|m{m}", "category": prompt.category,
                "k": m - 1, "m": m, "t_target_ms": run(states[s_], m, u), "t_draft_ms": 0.0,
                "draft_forwards": 0, "u_bar": float(u), "ctx_len": len(ids),
                "kv_tokens": base, "kv_occupancy": base / max_pos if max_pos else 0.0,
                "accepted": 0, "round": len(rows),
            })  # fmt: skip
            if done % report_every == 0 or done == len(plan):
                elapsed = time.perf_counter() - started
                log(f"[calibrate:designed] {done:,}/{len(plan):,} passes, "
                    f"ETA {elapsed / done * (len(plan) - done):.0f}s")  # fmt: skip
        forced.set(None)
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
