"""Scenarios for tests/test_vllm_engine.py, run in the vLLM environment (one process, a few
engines): python tests/vllm_scenarios.py OUT.json.

Each engine's core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the same engine
code, scheduler and plugin, but a start takes about half a second (``engine``: a small KV cache,
the heap frozen) instead of about 18 (most of which is the spawned engine process importing
vLLM again). The spawned-process path is what tests/test_bench_vllm.py and the Serve app's tests
(test_vllm_app.py, test_serve_sweep.py) run."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "models", "target")
SCHEDULER = "pipeline.vllm_spec.scheduler.CostAwareScheduler"
DRAFT = os.path.join(ROOT, "models", "draft")
HEAD = os.path.join(ROOT, "models", "eagle3-head")
TEXTS = [
    "def fibonacci(n):\n",
    "import numpy as np\n\ndef normalize(x):\n    ",
    "The history of the city begins in",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "Question: what is 12 + 30?\nAnswer:",
    'def is_prime(n: int) -> bool:\n    """Return True if n is prime."""\n',
    "Once upon a time",
    "for i in range(10):\n",
]


# The engines' KV cache: 256 MiB holds ~75,000 of the target's tokens, ample here; zeroing the
# environment's 2 GiB took 1 s of every start.
KV_CACHE_BYTES = 256 << 20


def engine(spec: dict | None, env: dict | None = None, max_model_len: int = 512, **kw):
    from vllm import LLM

    for key in ("SPECBOUND_SCHEDULER",):
        os.environ.pop(key, None)
    os.environ.update(env or {})
    # Set, the environment's size (whole GiB) would override the bytes below; it is read
    # while the engine starts, and restored for what runs next (calibration_run's engine).
    kv_space = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    # vLLM collects garbage 7 times while an engine starts (0.3 s each over the imported
    # modules' objects) and unfreezes them when one shuts down: frozen again, a start's
    # collections see only its own objects.
    gc.freeze()
    try:
        return LLM(
            model=TARGET,
            dtype="float32",
            enforce_eager=True,
            max_model_len=max_model_len,
            max_num_seqs=8,
            seed=0,
            speculative_config=spec,
            disable_log_stats=False,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            **kw,
        )
    finally:
        if kv_space is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = kv_space


def spec_counters(llm) -> dict:
    """vLLM's speculation counters (drafts, draft tokens, accepted tokens)."""
    return {
        m.name: m.value
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")
    }


def ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def main(out_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read when an engine starts
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    result: dict = {}
    greedy = SamplingParams(temperature=0, max_tokens=48)
    # Requests that end mid-generation at different steps: their rows leave the batch.
    short = [SamplingParams(temperature=0, max_tokens=8 + 6 * i) for i in range(len(TEXTS))]

    llm = engine(None)
    tok = llm.get_tokenizer()
    prompts = [
        TokensPrompt(prompt_token_ids=tok(t, add_special_tokens=False)["input_ids"]) for t in TEXTS
    ]
    result["plain_c1"] = [ids(llm.generate([p], greedy, use_tqdm=False))[0] for p in prompts]
    result["plain_c8"] = ids(llm.generate(prompts, greedy, use_tqdm=False))
    result["plain_short"] = ids(llm.generate(prompts, short, use_tqdm=False))
    del llm

    # The cost-aware scheduler over vLLM's draft_model drafter; exploring every third step
    # (a random k) so that every draft length, 0 included, meets the text.
    drafted = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4}
    explore = {"SPECBOUND_SCHEDULER": json.dumps({"explore": 0.34, "seed": 1})}
    llm = engine(drafted, explore, scheduler_cls=SCHEDULER)
    result["sched_c1"] = [ids(llm.generate([p], greedy, use_tqdm=False))[0] for p in prompts]
    result["sched_c8"] = ids(llm.generate(prompts, greedy, use_tqdm=False))
    result["sched_short"] = ids(llm.generate(prompts, short, use_tqdm=False))
    result["sched_spec"] = spec_counters(llm)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    result["sched_steps"] = {
        "steps": scheduler.planner.steps,
        "unfitted": scheduler.planner.unfitted_steps,
        "catch_up": scheduler.catch_up_steps,
        "wind_down": scheduler.wind_down_steps,
        "churn": scheduler.churn_steps,
        "chosen": scheduler.planner.chosen.tolist(),
    }
    # The same prompts in another order: rows are reordered in vLLM's persistent batch.
    result["sched_reversed"] = ids(llm.generate(prompts[::-1], greedy, use_tqdm=False))[::-1]
    del llm

    # What a request asks (pipeline.vllm_spec.request_args), with probabilistic drafting:
    # seeded T = 1 rows draft nothing and so draw what they would without speculation;
    # greedy rows with speculation off keep their text; the others draft.
    sampled_seeds = [
        SamplingParams(temperature=1.0, seed=500 + i, max_tokens=64, ignore_eos=True)
        for i in range(12)
    ]
    off = SamplingParams(temperature=0, max_tokens=48, extra_args={"speculation": "off"})
    capped = SamplingParams(temperature=0, max_tokens=48, extra_args={"max_draft_tokens": 1})
    mixed_prompts = [prompts[i % len(prompts)] for i in range(12)] + prompts[:6]
    mixed = sampled_seeds + [greedy] * 2 + [off] * 2 + [capped] * 2
    llm = engine(None)
    result["plain_mixed"] = ids(llm.generate(mixed_prompts, mixed, use_tqdm=False))
    del llm
    sampled_draft = dict(drafted, draft_sample_method="probabilistic")
    llm = engine(sampled_draft, scheduler_cls=SCHEDULER)
    result["args_mixed"] = ids(llm.generate(mixed_prompts, mixed, use_tqdm=False))
    before = spec_counters(llm)
    result["args_off_c1"] = ids(llm.generate(prompts[:1], off, use_tqdm=False))
    result["args_off_c1_spec"] = [before, spec_counters(llm)]
    planner = llm.llm_engine.engine_core.engine_core.scheduler.planner
    result["args_held_off"] = planner.held_off
    result["args_chosen"] = planner.chosen.tolist()
    del llm

    # vLLM's EAGLE-3 drafter over the committed head, then under the cost-aware scheduler.
    headed = {"method": "eagle3", "model": HEAD, "num_speculative_tokens": 4}
    llm = engine(headed)
    result["eagle3_c1"] = [ids(llm.generate([p], greedy, use_tqdm=False))[0] for p in prompts]
    result["eagle3_c8"] = ids(llm.generate(prompts, greedy, use_tqdm=False))
    result["eagle3_short"] = ids(llm.generate(prompts, short, use_tqdm=False))
    result["eagle3_spec"] = spec_counters(llm)
    del llm
    # With the A/B check in epochs of 3 steps: epochs held at 0 and at 2 between the policy's.
    checked = {"explore": 0.34, "seed": 1, "ab_epoch": 3, "ab_fixed": 2}
    llm = engine(headed, {"SPECBOUND_SCHEDULER": json.dumps(checked)}, scheduler_cls=SCHEDULER)
    result["sched_eagle3_c8"] = ids(llm.generate(prompts, greedy, use_tqdm=False))
    result["sched_eagle3_short"] = ids(llm.generate(prompts, short, use_tqdm=False))
    result["sched_eagle3_spec"] = spec_counters(llm)
    ab = llm.llm_engine.engine_core.engine_core.scheduler.planner.ab
    result["sched_eagle3_ab_epochs"] = {
        str(side): sum(b.sides[side].epochs for b in ab.bands.values()) for side in (-1, 0, 2)
    }
    del llm

    # A KV cache too small for the batch: vLLM preempts requests and recomputes them later
    # (the draft's rows with them: the plugin's drafter catches a resumed row up).
    small = {"num_gpu_blocks_override": 6, "block_size": 32, "max_model_len": 160}
    llm = engine(drafted, explore, scheduler_cls=SCHEDULER, **small)
    long = SamplingParams(temperature=0, max_tokens=96)
    result["preempted"] = ids(llm.generate(prompts, long, use_tqdm=False))
    result["preemptions"] = sum(
        m.value
        for m in llm.get_metrics()
        if m.name == "vllm:num_preemptions" and hasattr(m, "value")
    )
    del llm
    llm = engine(None, **small)
    result["preempted_plain"] = ids(llm.generate(prompts, long, use_tqdm=False))
    del llm

    # jobs.bench_vllm's vLLM run with the methods alternating cell by cell (both engines up
    # at once): two cells, two repeats.
    from pipeline.bench.vllm_run_cells import run_spec

    lines: list[str] = []
    bench_cells = [
        {"domain": "code", "temperature": 0.0, "concurrency": c, "max_tokens": 12, "seed": 0}
        | {"prompts": [p["prompt_token_ids"] for p in prompts[:2]]}
        for c in (1, 2)
    ]
    bench = {
        "model": TARGET,
        "max_model_len": 256,
        "repeats": 2,
        "interleave": "cells",
        "methods": [
            {"name": "none", "speculative_config": None},
            {"name": "dm2", "speculative_config": dict(drafted, num_speculative_tokens=2)},
        ],
        "cells": bench_cells,
    }
    kv_space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB, the least it takes: two engines start
    gc.freeze()  # (see engine: both start before either stops)
    try:
        by_cells = run_spec(bench, Path(os.path.dirname(out_path)) / "by_cells.json", lines.append)
    finally:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE")
        if kv_space is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = kv_space
    result["bench_by_cells"] = {"results": by_cells, "progress": lines}

    # The step-cost calibration's vLLM side (jobs.calibrate_vllm's run) at a small size: the
    # calibration drafter's random lengths and its records of every step (last: it sets
    # SPECBOUND_CALIBRATION in this process's environment).
    from pipeline.vllm_spec import calibration_run

    folder = os.path.dirname(out_path)
    calibration_run.run(
        {
            "target": TARGET,
            "draft": DRAFT,
            "k": 4,
            "prompts": [p["prompt_token_ids"] for p in prompts],
            "batch_sizes": [1, 4],
            "max_tokens": 32,
            "record": os.path.join(folder, "calibration.jsonl"),
            "meta_out": os.path.join(folder, "calibration_meta.json"),
            "max_model_len": 256,
        }
    )
    result["calibration_records"] = os.path.join(folder, "calibration.jsonl")
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # (vLLM may spawn processes: the guard is required)
    sys.path.insert(0, ROOT)
    main(sys.argv[1])
