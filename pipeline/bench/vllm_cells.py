"""Benchmark cells on one vLLM engine (runs in the vLLM environment: vllm, numpy, json only).

A cell is one (domain, temperature, concurrency) point: its prompts (token ids) decoded in a
closed loop with exactly ``concurrency`` requests in flight until the prompts run out, driven
through ``llm.llm_engine`` (add_request / step / has_unfinished_requests), so the batch size
is ours to set rather than whatever ``LLM.generate`` would admit at once. Every request runs to
``max_tokens`` (``ignore_eos``) so every method decodes the same number of tokens.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py), summed over engine labels.
SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
}
DRAFTER_STATS_ENV = "SPECBOUND_DRAFTER_STATS"  # pipeline.vllm_spec.stats's
PLANNER_LOG_ENV = "SPECBOUND_PLANNER_LOG"  # pipeline.vllm_spec.scheduler's report lines


@contextmanager
def environ(extra: dict[str, str] | None) -> Iterator[None]:
    """Env settings the engine reads at start (its processes inherit them), restored after."""
    saved = {k: os.environ.get(k) for k in extra or {}}
    os.environ.update(extra or {})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def spec_counters(llm: Any) -> dict[str, float]:
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    names = {v: k for k, v in SPEC_COUNTERS.items()}
    for metric in llm.get_metrics():
        key = names.get(metric.name)
        if key is not None and hasattr(metric, "value"):
            totals[key] += float(metric.value)
    return totals


def counters(env: str) -> dict[str, float] | None:
    """The plugin's drafter's counters in the file ``$env`` names (pipeline.vllm_spec.stats),
    or None: no file named, no file yet, or the module not there (the plugin is written apart
    from this harness)."""
    path = os.environ.get(env)
    if not path or not os.path.exists(path):
        return None
    try:
        from pipeline.vllm_spec.stats import read_drafter_stats
    except ImportError:
        return None
    return read_drafter_stats(path)


def _delta(after: dict | None, before: dict | None) -> dict | None:
    if after is None:
        return None
    return {k: v - (before or {}).get(k, 0.0) for k, v in after.items()}


def _sampling(temperature: float, max_tokens: int, seed: int) -> Any:
    from vllm import SamplingParams

    if temperature == 0:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # top_k/top_p off: the plain softmax at T, as our engine samples. Seeded, so a method's
    # draws are the same in every repeat; "speculation": "on" because under the cost-aware
    # scheduler a seeded sampled request otherwise drafts nothing (so that its seed repeats
    # its text: pipeline.vllm_spec.request_args); vLLM's own methods ignore the key.
    return SamplingParams(
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        seed=seed,
        max_tokens=max_tokens,
        ignore_eos=True,
        extra_args={"speculation": "on"},
    )


def closed_loop(
    llm: Any,
    prompts: list[list[int]],
    concurrency: int,
    temperature: float,
    max_tokens: int,
    seed: int,
    tag: str = "r",
) -> dict:
    """Decode ``prompts`` keeping ``concurrency`` requests in flight: per-request output ids
    and times (first token, finish) on this process's clock, relative to the cell's start."""
    from vllm import TokensPrompt

    engine = llm.llm_engine
    n = len(prompts)
    added: dict[int, float] = {}
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    tokens: list[list[int]] = [[] for _ in prompts]
    index: dict[str, int] = {}
    nxt = 0
    t0 = time.perf_counter()

    def add() -> None:
        nonlocal nxt
        i, nxt = nxt, nxt + 1
        rid = f"{tag}-{i}"
        params = _sampling(temperature, max_tokens, seed + i)
        internal = engine.add_request(rid, TokensPrompt(prompt_token_ids=prompts[i]), params)
        index[rid] = index[internal] = i  # outputs carry the external id; keep both
        added[i] = time.perf_counter() - t0

    while nxt < min(concurrency, n):
        add()
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter() - t0
        for out in outs:
            i = index[out.request_id]
            if i not in first and out.outputs and out.outputs[0].token_ids:
                first[i] = now
            if out.finished:
                done[i] = now
                tokens[i] = list(out.outputs[0].token_ids)
                if nxt < n:
                    add()
    wall = time.perf_counter() - t0
    total = sum(len(t) for t in tokens)
    tpot = [(done[i] - first[i]) / (len(tokens[i]) - 1) for i in range(n) if len(tokens[i]) > 1]
    ttft = [first[i] - added[i] for i in range(n) if i in first]
    return {
        "outputs": tokens,
        "tokens": total,
        "wall_s": wall,
        "tok_s": total / wall if wall > 0 else float("nan"),
        "tpot_s": sum(tpot) / len(tpot) if tpot else None,
        "ttft_s": sum(ttft) / len(ttft) if ttft else None,
    }


def run_cell(llm: Any, cell: dict, tag: str) -> dict:
    spec0 = spec_counters(llm)
    drafter0 = counters(DRAFTER_STATS_ENV)
    res = closed_loop(
        llm,
        cell["prompts"],
        int(cell["concurrency"]),
        float(cell["temperature"]),
        int(cell["max_tokens"]),
        int(cell.get("seed", 0)),
        tag,
    )
    spec = _delta(spec_counters(llm), spec0)
    res["spec"] = spec
    drafts = spec["drafts"] if spec else 0.0
    res["mean_accepted_len"] = 1.0 + spec["accepted"] / drafts if drafts else None
    res["acceptance_rate"] = spec["accepted"] / spec["draft_tokens"] if drafts else None
    res["drafter"] = _delta(counters(DRAFTER_STATS_ENV), drafter0)
    res.update({k: cell[k] for k in ("domain", "temperature", "concurrency", "max_tokens")})
    res["seed"] = int(cell.get("seed", 0))
    return res


def start_llm(
    model: str,
    max_model_len: int,
    max_num_seqs: int,
    speculative_config: dict | None,
    seed: int = 0,
    **engine_kwargs: Any,
) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = dict(engine_kwargs)  # e.g. scheduler_cls
    if speculative_config:
        kwargs["speculative_config"] = dict(speculative_config)
    # Prefix caching off: the same prompts recur across cells and repeats, and a cache hit
    # would make a later cell's prefill free; our engine caches nothing across generations.
    return LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        disable_log_stats=False,
        enable_prefix_caching=False,
        seed=seed,
        **kwargs,
    )


def shutdown_llm(llm: Any) -> None:
    """Stop the engine's processes now (LLM has no close() in 0.32: its engine-core client
    has shutdown()), so the next LLM() in this process starts on a free machine."""
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        del llm
        gc.collect()


@contextmanager
def engine_session(
    model: str,
    max_model_len: int,
    speculative_config: dict | None,
    cells: list[dict],
    env: dict[str, str] | None = None,
    engine_kwargs: dict[str, Any] | None = None,
) -> Iterator[tuple[Any, float]]:
    """(an engine sized for ``cells``, its start time in s) until the block ends; one short
    warm-up generation first (the engine's first steps are slow). ``env`` is set while it
    starts, warms up and stops (several engines may be open at once: a cell run on one sets
    it again, ``environ``)."""
    max_num_seqs = max([int(c["concurrency"]) for c in cells] + [1])
    with environ(env):
        t0 = time.perf_counter()
        llm = start_llm(
            model, max_model_len, max_num_seqs, speculative_config, **(engine_kwargs or {})
        )
        start_s = time.perf_counter() - t0
    try:
        with environ(env):
            warm = cells[0]["prompts"][: max(1, min(2, max_num_seqs))]
            closed_loop(llm, warm, len(warm), 0.0, 8, 0, "warmup")
        yield llm, start_s
    finally:
        with environ(env):
            shutdown_llm(llm)


def cell_line(cell: dict, res: dict) -> str:
    """A cell's progress line."""
    acc = res["mean_accepted_len"]
    return (
        f"    {cell['domain']:<9} T={cell['temperature']:g} "
        f"c={cell['concurrency']:<3} {res['tok_s']:8.1f} tok/s"
        + (f"  acc len {acc:.2f}" if acc else "")
    )


def run_method(
    model: str,
    max_model_len: int,
    speculative_config: dict | None,
    cells: list[dict],
    env: dict[str, str] | None = None,
    progress: Callable[[str], None] = print,
    engine_kwargs: dict[str, Any] | None = None,
) -> dict:
    """Every cell on one engine: {"start_s", "cells": [...]}; the drafter's counters are read
    as deltas."""
    with engine_session(model, max_model_len, speculative_config, cells, env, engine_kwargs) as (
        llm,
        start_s,
    ):
        out = []
        with environ(env):
            for j, cell in enumerate(cells):
                res = run_cell(llm, cell, f"c{j}")
                progress(cell_line(cell, res))
                out.append(res)
    return {"start_s": start_s, "cells": out}
