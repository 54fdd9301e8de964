"""Decoding for the benchmarks, timed: policies on the same prompts interleaved prompt by
prompt (pipeline.bench.online, pipeline.bench.tree_bound), and transformers' assisted
generation on the same prompts and token budget. Each gives a BenchRow (pipeline.bench.rows)
of measured figures; pricing and bounds are the caller's."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pipeline.bench.rows import BenchRow, make_row
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.heap import frozen_heap
from pipeline.decode.policies.artifacts import PolicyArtifacts
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.types import SamplingConfig, StepRecord
from pipeline.models.loading import ModelPair


def bench_policy(
    pair: ModelPair,
    prompts: list[list[int]],
    name: str | Callable,
    knobs: dict,
    temperature: float,
    max_new_tokens: int,
    artifacts: PolicyArtifacts | None = None,
    label: str | None = None,
) -> BenchRow:
    """``name`` is a policy name, or a callable giving the policy for prompt j. Timed: the
    decoding steps (a session's start, the prompt's prefill, is not)."""
    return bench_policies(
        pair, prompts, [(name, knobs, label)], temperature, max_new_tokens, artifacts
    )[0]


def bench_policies(
    pair: ModelPair,
    prompts: list[list[int]],
    specs: list[tuple[str | Callable, dict, str | None]],
    temperature: float,
    max_new_tokens: int,
    artifacts: PolicyArtifacts | None = None,
    progress: Callable[[str], None] = lambda line: None,
    first_seed: int = 0,
) -> list[BenchRow]:
    """bench_policy for each (name, knobs, label) in ``specs``, interleaved: every policy
    decodes prompt j before any decodes prompt j + 1, in an order that rotates with j. A
    machine whose speed drifts during the run (a shared CPU drifts by tens of percent within
    minutes) then slows every policy alike, instead of whichever ran in the slow minutes.
    Prompt j decodes with seed ``first_seed + j`` for every policy (a repeated run draws anew
    at T > 0 with another ``first_seed``)."""
    engine = SpeculativeEngine(pair)
    sampling = SamplingConfig(temperature=temperature)
    if artifacts is not None:  # the cost model's prices for this temperature's mode
        artifacts = artifacts.for_sampling(sampling)
    seconds = [0.0] * len(specs)
    outputs: list[list[list[int]]] = [[] for _ in specs]
    steps: list[list[list[StepRecord]]] = [[] for _ in specs]
    with frozen_heap():  # no full collection of the loaded libraries inside a timed decode
        for j, ids in enumerate(prompts):
            progress(f"T={temperature:g} prompt {j + 1}/{len(prompts)}")
            for turn in range(len(specs)):
                i = (turn + j) % len(specs)
                name, knobs, _ = specs[i]
                policy = name(j) if callable(name) else make_policy(name, artifacts, **knobs)
                session = engine.start(ids, policy, sampling, seed=first_seed + j)
                started = time.perf_counter()
                while len(session.generated) < max_new_tokens:
                    session.step()
                seconds[i] += time.perf_counter() - started
                outputs[i].append(list(session.generated))  # a last step may overshoot
                steps[i].append(list(session.steps))
    return [
        make_row(name, knobs, label, temperature, seconds[i], outputs[i], steps[i])
        for i, (name, knobs, label) in enumerate(specs)
    ]


@torch.no_grad()
def bench_assisted(
    pair: ModelPair,
    prompts: list[list[int]],
    temperature: float,
    max_new_tokens: int,
    first_seed: int = 0,
) -> BenchRow:
    """transformers' generate(assistant_model=draft), same prompts, token budget and seeds. Its
    time includes both prefills, measured apart (a target and a draft forward over the prompt)
    and subtracted, so it is comparable with the engine's step times."""
    pair.require_draft_model("transformers' assisted generation")
    tokens, seconds, outputs = 0, 0.0, []
    with frozen_heap():  # as bench_policies
        for j, ids in enumerate(prompts):
            torch.manual_seed(first_seed + j)
            kwargs = {"do_sample": temperature > 0}
            if temperature > 0:
                kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
            x = torch.tensor([ids], device=pair.device)
            started = time.perf_counter()
            pair.target(x)
            pair.draft(x)
            prefill = time.perf_counter() - started
            started = time.perf_counter()
            out = pair.target.generate(
                x,
                assistant_model=pair.draft,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                pad_token_id=pair.tokenizer.eos_token_id,
                **kwargs,
            )
            seconds += max(1e-9, time.perf_counter() - started - prefill)
            tokens += out.shape[1] - len(ids)
            outputs.append(out[0, len(ids) :].tolist())
    return BenchRow(
        "transformers assisted",
        temperature,
        tokens,
        seconds,
        float("nan"),
        float("nan"),
        float("nan"),
        outputs=outputs,
    )
