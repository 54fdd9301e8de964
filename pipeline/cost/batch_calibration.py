"""Calibrating the batch cost model (pipeline.cost.batch): decode prompts continuously batched
at several batch sizes, once per K of ``ks`` with every generation drafting a chain of K (so
the passes span every P at every batch size, and each step is one clean round structure), and
fit T_T(P, U, L) and
T_D(n) to the batcher's records of the steps' packed forwards."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.cost.batch import BatchCost
from pipeline.decode.batched import BatchedEngine
from pipeline.decode.batching import BatchRecord
from pipeline.decode.policies.registry import make_policy
from pipeline.models.loading import ModelPair


@dataclass
class BatchCalibration:
    cost: BatchCost
    records: list[BatchRecord]
    seconds: float


def calibrate_batch(
    pair: ModelPair,
    prompts: list[list[int]],
    batch_sizes: list[int],
    ks: list[int],
    max_new_tokens: int,
    seed: int = 0,
    progress: Callable[[str], None] = print,
) -> BatchCalibration:
    """Every prompt at every batch size (a warm-up pass first, not recorded)."""
    if not prompts or not batch_sizes or not ks:
        raise ValueError("need prompts, batch sizes and K values to calibrate")
    engine = BatchedEngine(pair)
    engine.batcher.max_records = 1 << 20  # keep every pass of the run
    engine.generate_many(prompts[:2], lambda: _fixed(ks[-1]), min(8, max_new_tokens), max_batch=2)
    engine.batcher.records.clear()
    started = time.perf_counter()
    order = random.Random(seed).sample(ks, len(ks))
    for b in batch_sizes:
        t0 = time.perf_counter()
        for k in order:  # one K for the whole batch per run: clean steps, every P
            engine.generate_many(
                prompts, lambda k=k: _fixed(k), max_new_tokens, max_batch=b, stop_at_eos=False
            )
        progress(
            f"  batch {b:>3}: {len(prompts)} generations x {len(order)} K in "
            f"{time.perf_counter() - t0:.1f} s"
        )
    records = list(engine.batcher.records)
    cost = BatchCost.fit(records, pair.spec.num_experts, pair.spec.top_k)
    return BatchCalibration(cost, records, time.perf_counter() - started)


def _fixed(k: int):
    return make_policy("ar") if k == 0 else make_policy("fixed", k=k)
