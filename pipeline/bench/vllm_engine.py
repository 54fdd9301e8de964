"""Our engine on the vLLM benchmark's cells (pipeline.bench.vllm): the same token prompts, the
same concurrency, every request decoded to max_tokens, recorded in vllm_run_cells' format so one
table holds both engines.

Concurrency 1 runs the plain engine one request at a time (what pipeline.bench.online
times); concurrency c > 1 runs BatchedEngine.generate_many with c generations in flight, a
new one joining as one ends (pipeline.bench.batch): vLLM's closed loop. Wall time covers
everything a request costs, its prefill included, as vLLM's does.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pipeline.decode.batched import BatchedEngine
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.heap import frozen_heap
from pipeline.decode.policies.artifacts import PolicyArtifacts
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.types import Generation, SamplingConfig, StepRecord
from pipeline.models.loading import ModelPair

FIXED_KS = range(1, 7)  # the best fixed K of each cell is picked among these
ENGINE_SPECS: list[tuple[str, dict]] = [
    ("ar", {}),
    *[("fixed", {"k": k}) for k in FIXED_KS],
    ("throughput", {}),
]


def engine_label(name: str, knobs: dict) -> str:
    return "engine " + name + "".join(f":{k}={v}" for k, v in knobs.items())


def _accepted_len(steps: list[list[StepRecord]]) -> float | None:
    """vLLM's mean accepted length: 1 + accepted draft tokens per step that drafted."""
    drafted = [s for run in steps for s in run if s.drafted > 0]
    return 1.0 + sum(s.accepted for s in drafted) / len(drafted) if drafted else None


def _one_at_a_time(
    engine: SpeculativeEngine,
    prompts: list[list[int]],
    policy: Callable,
    max_tokens: int,
    sampling: SamplingConfig,
    seed: int,
) -> dict:
    """Sequential requests, each timed: first token (its first step), finish."""
    outputs, steps, tpot, ttft = [], [], [], []
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        stream = engine.stream(ids, policy(), max_tokens, sampling, seed + i, None, False)
        start, first = time.perf_counter(), None
        for n, _ in enumerate(stream.step_deltas()):
            if n == 1:  # yields: "" after the prefill, then one per step
                first = time.perf_counter()
        end = time.perf_counter()
        gen: Generation = stream.result
        outputs.append(gen.tokens)
        steps.append(gen.steps)
        ttft.append((first or end) - start)
        if len(gen.tokens) > 1 and first is not None:
            tpot.append((end - first) / (len(gen.tokens) - 1))
    wall = time.perf_counter() - t0
    return {
        "outputs": outputs,
        "steps": steps,
        "wall_s": wall,
        "tpot_s": sum(tpot) / len(tpot) if tpot else None,
        "ttft_s": sum(ttft) / len(ttft) if ttft else None,
    }


def _batched(
    engine: BatchedEngine,
    prompts: list[list[int]],
    policy: Callable,
    max_tokens: int,
    sampling: SamplingConfig,
    seed: int,
    concurrency: int,
) -> dict:
    engine.batcher.economy = None  # a batch's plan starts afresh
    seeds = [seed + i for i in range(len(prompts))]
    t0 = time.perf_counter()
    gens = engine.generate_many(
        prompts, policy, max_tokens, sampling, seeds, max_batch=concurrency, stop_at_eos=False
    )
    wall = time.perf_counter() - t0
    # per-request times are not exposed by generate_many: TPOT/TTFT left out at c > 1
    return {
        "outputs": [g.tokens for g in gens],
        "steps": [g.steps for g in gens],
        "wall_s": wall,
        "tpot_s": None,
        "ttft_s": None,
    }


def engine_runs(
    pair: ModelPair,
    cells: list[dict],
    repeats: int,
    artifacts: PolicyArtifacts | None,
    specs: list[tuple[str, dict]] = ENGINE_SPECS,
    progress: Callable[[str], None] = print,
) -> list[dict]:
    """Every (repeat, policy) over every cell, as vllm_run_cells' runs; the policy order rotates
    with the cell and the repeat so drift slows every policy alike."""
    single, batched = SpeculativeEngine(pair), BatchedEngine(pair)
    warm = cells[0]["prompts"][:2]
    with torch.no_grad():
        single.generate(warm[0], make_policy("fixed", k=2), 8, stop_at_eos=False)
        batched.generate_many(warm, lambda: make_policy("fixed", k=2), 8, max_batch=2)
    runs = {
        (r, i): {
            "repeat": r,
            "method": engine_label(*specs[i]),
            "error": None,
            "cells": [None] * len(cells),
        }
        for r in range(repeats)
        for i in range(len(specs))
    }
    for rep in range(repeats):
        for j, cell in enumerate(cells):
            c, temp = int(cell["concurrency"]), float(cell["temperature"])
            sampling = SamplingConfig(temp)
            priced = artifacts.for_sampling(sampling) if artifacts is not None else None
            for turn in range(len(specs)):
                i = (turn + j + rep) % len(specs)
                name, knobs = specs[i]

                def policy(name=name, knobs=knobs, priced=priced):
                    return make_policy(name, priced, **knobs)

                args = (
                    cell["prompts"],
                    policy,
                    int(cell["max_tokens"]),
                    sampling,
                    int(cell.get("seed", 0)),
                )
                with torch.no_grad(), frozen_heap():  # (pipeline.decode.heap)
                    res = _one_at_a_time(single, *args) if c == 1 else _batched(batched, *args, c)
                steps = res.pop("steps")
                res["tokens"] = sum(len(o) for o in res["outputs"])
                res["tok_s"] = res["tokens"] / res["wall_s"]
                res["mean_accepted_len"] = _accepted_len(steps)
                res.update(
                    {k: cell[k] for k in ("domain", "temperature", "concurrency", "max_tokens")}
                )
                runs[rep, i]["cells"][j] = res
                progress(
                    f"  repeat {rep + 1}/{repeats}  {cell['domain']:<9} T={temp:g} "
                    f"c={c:<3} {engine_label(name, knobs):<22} {res['tok_s']:8.1f} tok/s"
                )
    return list(runs.values())
