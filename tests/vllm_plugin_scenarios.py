"""Scenarios for tests/test_vllm_plugin.py, run in the vLLM environment with the project's
plugin installed (make vllm-env): python tests/vllm_plugin_scenarios.py OUT.json.

Engines run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so ``StretchScheduler`` below
is the engine's scheduler and its records are read directly."""

from __future__ import annotations

import importlib
import json
import os
import random
import sys
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from vllm_scenarios import TEXTS, engine, ids, spec_counters  # noqa: E402

from pipeline.vllm_spec.scheduler import CostAwareScheduler  # noqa: E402

DRAFT = os.path.join(ROOT, "models", "draft")
HEAD = os.path.join(ROOT, "models", "eagle3-head")
DRAFTERS = {
    "draft": {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 3},
    "head": {"method": "eagle3", "model": HEAD, "num_speculative_tokens": 3},
}
TARGET = os.path.join(ROOT, "models", "target")
STRETCHES_ENV = "SPECBOUND_TEST_STRETCHES"
RECORDS: list[list[Any]] = []  # [request id, committed tokens, proposal] per drafted row


class StretchScheduler(Scheduler):
    """K draft tokens at every step, or, with ``skip``, none in random stretches of 1-20 steps
    between drafting stretches of 1-5; records every proposal with the length of the committed
    text it continues."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        cfg = json.loads(os.environ.get(STRETCHES_ENV) or "{}")
        self.skip = bool(cfg.get("skip"))
        self.rng = random.Random(cfg.get("seed", 0))
        self.left, self.off = 0, True
        self.dynamic_sd_lookup = [self.num_spec_tokens] * (self.scheduler_config.max_num_seqs + 1)

    def schedule(self, *args: Any, **kwargs: Any):
        output = super().schedule(*args, **kwargs)
        if self.skip and output.num_scheduled_tokens:
            if self.left == 0:
                self.off = not self.off
                self.left = self.rng.randint(1, 20) if self.off else self.rng.randint(1, 5)
            self.left -= 1
            if self.off:
                output.num_spec_tokens_to_schedule = 0
        return output

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        _record(self, draft_token_ids)
        super().update_draft_token_ids(draft_token_ids)


def _record(scheduler: Any, draft_token_ids: Any) -> None:
    for req_id, tokens in zip(
        draft_token_ids.req_ids, draft_token_ids.draft_token_ids, strict=True
    ):
        request = scheduler.requests.get(req_id)
        if request is not None and len(tokens) > 0:
            RECORDS.append([req_id, request.num_tokens, [int(t) for t in tokens]])


class StoppingScheduler(CostAwareScheduler):
    """The cost-aware scheduler, recording every proposal as the drafter made it (-1 where
    its acceptance stop proposed nothing) before it cuts them."""

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        _record(self, draft_token_ids)
        super().update_draft_token_ids(draft_token_ids)


HOLD = [False]  # HoldScheduler drafts nothing while set


class HoldScheduler(StretchScheduler):
    """K draft tokens at every step (recorded), none while ``HOLD[0]`` is set."""

    def schedule(self, *args: Any, **kwargs: Any):
        output = super().schedule(*args, **kwargs)
        if HOLD[0]:
            output.num_spec_tokens_to_schedule = 0
        return output


def cached_prefix() -> dict:
    """A request whose every step skipped the draft leaves its prompt's blocks in vLLM's
    prefix cache without draft KV; a later request on that prefix drafts. Its proposals, with
    the stale-prefix check off and on (each on a prefix of its own), and those of the same
    request computing its prefix itself (reading no cache): the reference."""
    from vllm import SamplingParams

    from pipeline.vllm_spec.catch_up_draft import CatchUp

    module = importlib.import_module("vllm_plugin_scenarios")
    os.environ[STRETCHES_ENV] = "{}"
    sched = "vllm_plugin_scenarios.HoldScheduler"
    llm = engine(DRAFTERS["draft"], scheduler_cls=sched, block_size=32)
    first = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    later = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    uncached = SamplingParams(
        temperature=0, max_tokens=48, ignore_eos=True, skip_reading_prefix_cache=True
    )

    def drafted(llm, prompt: str, params) -> dict[str, list[int]]:
        module.RECORDS.clear()
        llm.generate([prompt], params, use_tqdm=False)
        return {str(n): p for _, n, p in module.RECORDS}

    result: dict = {}
    for check, texts in ((False, TEXTS), (True, TEXTS[::-1])):
        prefix = " ".join(texts) * 2  # 238 tokens: 7 full blocks of 32
        CatchUp.check_prefix = check
        module.HOLD[0] = True
        llm.generate([prefix], first, use_tqdm=False)
        module.HOLD[0] = False
        result[f"check_{check}"] = drafted(llm, prefix + "\n# next", later)
        result[f"reference_{check}"] = drafted(llm, prefix + "\n# next", uncached)
    CatchUp.check_prefix = True
    metrics = llm.get_metrics()
    hits = [m.value for m in metrics if m.name == "vllm:prefix_cache_hits" and hasattr(m, "value")]
    result["prefix_hits"] = sum(hits)
    del llm
    return result


def crowded() -> dict:
    """Seven requests decode with the draft held off for 40 steps (a backlog of missed tokens
    each), then a long prompt arrives and every step drafts: its prefill chunks fill the
    drafter's token buffers (max_num_batched_tokens 256), leaving no room for the others'
    catch-up in those steps. Greedy text per request, and the drafter's counters."""
    from vllm import SamplingParams

    from pipeline.vllm_spec.stats import read_drafter_stats

    hold = importlib.import_module("vllm_plugin_scenarios").HOLD
    stats_path = os.path.join(os.environ["SPECBOUND_TEST_DIR"], "drafter_crowded")
    os.environ["SPECBOUND_DRAFTER_STATS"] = stats_path
    os.environ[STRETCHES_ENV] = "{}"
    llm = engine(
        DRAFTERS["draft"],
        max_model_len=1024,
        max_num_batched_tokens=256,
        enable_chunked_prefill=True,
        scheduler_cls="vllm_plugin_scenarios.HoldScheduler",
    )
    core = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    texts: dict[str, list[int]] = {}

    def step() -> None:
        for out in core.step():
            if out.finished:
                texts[out.request_id] = list(out.outputs[0].token_ids)

    hold[0] = True
    for i, text in enumerate(TEXTS[:7]):
        core.add_request(str(i), text, params)
    for _ in range(40):
        step()
    hold[0] = False
    core.add_request("long", " ".join(TEXTS) * 8, params)
    while core.has_unfinished_requests():
        step()
    del llm
    return {"text": texts, "stats": read_drafter_stats(stats_path)}


def proposals(
    params,
    skip: bool,
    seed: int = 0,
    catch_up: bool = True,
    backlog: int | None = None,
    drafter: str = "draft",
) -> dict:
    """Greedy text and every proposal keyed by (prompt, committed length)."""
    from pipeline.vllm_spec.catch_up_draft import CatchUp
    from pipeline.vllm_spec.stats import read_drafter_stats

    os.environ[STRETCHES_ENV] = json.dumps({"skip": skip, "seed": seed})
    # The engine imports this file as a module of its own (scheduler_cls), not as __main__.
    records = importlib.import_module("vllm_plugin_scenarios").RECORDS
    CatchUp.catch_up = catch_up
    CatchUp.backlog_limit = backlog
    records.clear()
    stats_path = os.path.join(
        os.environ["SPECBOUND_TEST_DIR"], f"drafter_{skip}_{catch_up}_{backlog}"
    )
    if os.path.exists(stats_path):
        os.remove(stats_path)
    os.environ["SPECBOUND_DRAFTER_STATS"] = stats_path
    llm = engine(DRAFTERS[drafter], scheduler_cls="vllm_plugin_scenarios.StretchScheduler")
    outs = llm.generate(TEXTS, params)
    # The engine's request ids are the outputs' with a suffix ("0" -> "0-9ce234d8").
    order = {o.request_id: i for i, o in enumerate(outs)}
    keyed = {f"{order[r.split('-')[0]]}:{n}": p for r, n, p in records}
    result = {"text": ids(outs), "proposals": keyed, "stats": read_drafter_stats(stats_path)}
    CatchUp.catch_up = True
    CatchUp.backlog_limit = None
    del llm
    return result


def stopped(params) -> dict:
    """The acceptance stop at K = 8 under the cost-aware scheduler held at K: greedy text,
    every raw proposal keyed as proposals() keys them, and the drafter's counts; then the
    message of an engine that asks for the stop under vLLM's own scheduler."""
    records = importlib.import_module("vllm_plugin_scenarios").RECORDS
    records.clear()
    spec = {**DRAFTERS["draft"], "num_speculative_tokens": 8}
    env = {"SPECBOUND_SCHEDULER": json.dumps({"design": "fixed", "stop_below": 0.3})}
    llm = engine(spec, env=env, scheduler_cls="vllm_plugin_scenarios.StoppingScheduler")
    outs = llm.generate(TEXTS, params)
    order = {o.request_id: i for i, o in enumerate(outs)}
    keyed = {f"{order[r.split('-')[0]]}:{n}": p for r, n, p in records}
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    stop = runner.model_runner.drafter.acceptance_stop
    # What the stop followed of each request's text: [its length, whether the two agree where
    # both go, the text's length]. (A request's last step may verify tokens past its
    # max_tokens, which the stop follows and the output drops.)
    whole = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs}
    followed = []
    for req_id, text in stop.texts.items():
        full, seen = whole[req_id.split("-")[0]], text.index.tokens
        common = min(len(seen), len(full))
        followed.append([len(seen), seen[:common] == full[:common], len(full)])
    result = {
        "text": ids(outs),
        "proposals": keyed,
        "stopped_steps": stop.stopped_steps,
        "spec": spec_counters(llm),
        "followed": followed,
    }
    del llm
    try:
        engine(spec, env=env, scheduler_cls="vllm_plugin_scenarios.StretchScheduler")
        result["refused"] = ""
    except Exception as exc:  # vLLM wraps what the drafter raises
        result["refused"] = f"{exc} {exc.__cause__ or ''}"
    return result


def main(out_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ["SPECBOUND_TEST_DIR"] = os.path.dirname(os.path.abspath(out_path))
    from vllm import SamplingParams

    result: dict = {}
    greedy = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    seeded = [
        SamplingParams(temperature=1.0, seed=7 + i, max_tokens=32, ignore_eos=True)
        for i in range(len(TEXTS))
    ]
    llm = engine(None)
    result["plain"] = ids(llm.generate(TEXTS, greedy))
    result["plain_seeded"] = ids(llm.generate(TEXTS, seeded))
    del llm
    # A speculating engine that drafts nothing (vLLM's own batch-size table at 0).
    off = {
        "method": "draft_model",
        "model": DRAFT,
        "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": [[1, 1000, 0]],
    }
    llm = engine(off)
    result["off_seeded"] = ids(llm.generate(TEXTS, seeded))
    result["off_spec"] = spec_counters(llm)
    del llm
    for name in DRAFTERS:
        tag = "" if name == "draft" else f"{name}_"
        result[f"{tag}never_skipped"] = proposals(greedy, skip=False, drafter=name)
        result[f"{tag}skipped"] = proposals(greedy, skip=True, seed=1, drafter=name)
        # The bound is per row for the draft model, for the batch for the head.
        result[f"{tag}skipped_flushing"] = proposals(
            greedy, skip=True, seed=2, backlog=16 if name == "draft" else 48, drafter=name
        )
        result[f"{tag}skipped_stale"] = proposals(
            greedy, skip=True, seed=1, catch_up=False, drafter=name
        )
    result["stopped"] = stopped(greedy)
    result["cached_prefix"] = cached_prefix()
    result["crowded"] = crowded()
    # The target drafting for itself at T = 1: identical distributions accept every token.
    sampled = SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True)
    for method in ("probabilistic", "greedy"):
        llm = engine(
            {
                "method": "draft_model",
                "model": TARGET,
                "num_speculative_tokens": 2,
                "draft_sample_method": method,
            }
        )
        llm.generate(TEXTS, sampled)
        result[f"self_draft_t1_{method}"] = spec_counters(llm)
        del llm
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
