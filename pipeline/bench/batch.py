"""The continuous-batching benchmark (jobs.bench_batch): policies decoding the same prompts
continuously batched in this process, at each batch size, in one run.

Each repeat runs every (batch size, policy) cell once, in an order that alternates between
repeats, so the machine's drift slows every cell alike; each cell reports output tokens/s per
repeat, their mean and spread, and its ratio to the best fixed K at the same batch size (the
best one in that run). Batch size 1 runs the same batched code with one generation at a time:
what a replica without batching decodes.

Every policy is built before anything decodes (a cost-aware one checks there that its cost
model prices the chains it may draft); the bench itself prices no step with the cost model,
so nothing else needs covering. A cell whose decoding fails is marked failed and leaves the
remaining repeats, the other cells go on; ``record`` gets every repeat's result (or the
failure) as it is done.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pipeline.bench.guard import PolicyFailure, failure_lines
from pipeline.decode.batched import BatchedEngine
from pipeline.decode.heap import frozen_heap
from pipeline.decode.policies.artifacts import PolicyArtifacts
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.types import SamplingConfig
from pipeline.models.loading import ModelPair


@dataclass
class BatchCell:
    batch: int
    label: str
    name: str
    knobs: dict
    tok_s: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    failed: PolicyFailure | None = None  # the cell's decoding failed: left out of the table

    @property
    def mean(self) -> float:
        return float(np.mean(self.tok_s))


def label(name: str, knobs: dict) -> str:
    return name + "".join(f" {k}={v}" for k, v in knobs.items())


def bench_batch(
    pair: ModelPair,
    prompts: list[list[int]],
    specs: list[tuple[str, dict]],
    batch_sizes: list[int],
    max_new_tokens: int,
    temperature: float,
    repeats: int,
    artifacts: PolicyArtifacts | None,
    progress=print,
    record: Callable[[dict], None] = lambda result: None,
) -> list[BatchCell]:
    for name, knobs in specs:  # every policy builds before anything decodes
        try:
            make_policy(name, artifacts, **knobs)
        except ValueError as exc:
            raise ValueError(f"bench_batch, before decoding: {label(name, knobs)}: {exc}") from None
    engine = BatchedEngine(pair)
    sampling = SamplingConfig(temperature)
    if artifacts is not None:  # the cost model's prices for this temperature's mode
        artifacts = artifacts.for_sampling(sampling)
    engine.generate_many(
        prompts[:2], lambda: make_policy("fixed", k=2), 8, sampling, max_batch=2
    )  # warm-up
    cells = [BatchCell(b, label(n, k), n, k) for b in batch_sizes for n, k in specs]
    for rep in range(repeats):
        for cell in cells if rep % 2 == 0 else cells[::-1]:
            if cell.failed is not None:
                continue
            engine.batcher.economy = None  # a batch's plan starts afresh
            where = f"batch {cell.batch}, repeat {rep + 1}"
            try:
                with frozen_heap():  # (pipeline.decode.heap)
                    t0 = time.perf_counter()
                    out = engine.generate_many(
                        prompts,
                        lambda c=cell: make_policy(c.name, artifacts, **c.knobs),
                        max_new_tokens,
                        sampling,
                        max_batch=cell.batch,
                        stop_at_eos=False,
                    )
                    seconds = time.perf_counter() - t0
            except Exception as exc:  # this cell only: the others go on
                cell.failed = PolicyFailure.of(cell.label, where, exc)
                progress(f"  {cell.failed.line()}")
                record(cell.failed.record(batch=cell.batch))
                continue
            cell.tok_s.append(sum(len(g.tokens) for g in out) / seconds)
            cell.steps.append(sum(len(g.steps) for g in out))
            record(
                {
                    "batch": cell.batch,
                    "policy": cell.label,
                    "repeat": rep + 1,
                    "tok_s": cell.tok_s[-1],
                    "steps": cell.steps[-1],
                }
            )
            progress(
                f"  repeat {rep + 1}/{repeats}  batch {cell.batch:>2}  {cell.label:<24} "
                f"{cell.tok_s[-1]:7.1f} tok/s"
            )
    return cells


def format_batch_bench(cells: list[BatchCell], header: str) -> str:
    lines = [
        "",
        header,
        "",
        f"{'batch':>5}  {'policy':<24}{'tok/s (mean)':>13}{'spread':>9}  per repeat"
        f"{'':>14}{'vs best fixed K':>16}",
    ]
    for b in sorted({c.batch for c in cells}):
        row = [c for c in cells if c.batch == b and c.failed is None]
        fixed = [c for c in row if c.name == "fixed"]
        best = max(fixed, key=lambda c: c.mean) if fixed else None
        for c in row:
            spread = (max(c.tok_s) - min(c.tok_s)) / c.mean
            ratio = ""
            if best is not None:
                per = [x / y for x, y in zip(c.tok_s, best.tok_s, strict=True)]
                ratio = f"{c.mean / best.mean:.3f}x ({min(per):.2f}-{max(per):.2f})"
            reps = " ".join(f"{x:6.1f}" for x in c.tok_s)
            lines.append(
                f"{b:>5}  {c.label:<24}{c.mean:>13.1f}{spread:>8.1%}  {reps:<24}{ratio:>16}"
            )
        if best is not None:
            lines.append(f"{'':>7}best fixed K at batch {b}: {best.label}")
    lines += failure_lines([c.failed for c in cells if c.failed is not None])
    return "\n".join(lines)
