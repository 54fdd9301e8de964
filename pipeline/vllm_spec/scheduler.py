"""The cost-aware draft length as a vLLM scheduler: vLLM drafts with its own ``draft_model``
runner (the draft's forwards inside vLLM's model runner, its paged KV cache), and this
scheduler chooses how many tokens that runner drafts at each step, by the modelled tokens per
millisecond of the batch it schedules (pipeline.vllm_spec.step_planner), both halves of the
model learned from the engine's own steps.

    LLM(model="models/target", enforce_eager=True, dtype="float32",
        scheduler_cls="pipeline.vllm_spec.scheduler.CostAwareScheduler",
        speculative_config={"method": "draft_model", "model": "models/draft",
                            "num_speculative_tokens": 4})

vLLM's contract (0.32, vllm/v1/core/sched/scheduler.py and gpu_model_runner.py): the
scheduler's ``SchedulerOutput.num_spec_tokens_to_schedule`` is the number of draft tokens the
runner's drafter makes at the end of the step (vLLM's own per-batch-size schedule,
``num_speculative_tokens_per_batch_size``, sets it the same way, after KV slots for K are
reserved); 0 still runs the draft's catch-up forward and proposes nothing. Greedy output is
vLLM's rejection sampling either way: the text equals decoding without speculation.
Settings: ``SPECBOUND_SCHEDULER`` (a JSON object of PlannerConfig's fields), read at start.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from pipeline.vllm_spec.step_planner import PlannerConfig, StepPlanner

PRUNE_EVERY = 64  # steps between forgetting finished requests' acceptance


class CostAwareScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.planner = StepPlanner(self.num_spec_tokens, PlannerConfig.from_env())
        if self.num_spec_tokens > 0:
            # Marks the draft length as dynamic, as vLLM's own schedule does: no padding of
            # new decodes to K + 1 tokens (that padding serves CUDA graphs of a fixed K).
            self.dynamic_sd_lookup = [self.num_spec_tokens] * (
                self.scheduler_config.max_num_seqs + 1
            )
        self._step: tuple[float, int, int, int] | None = None  # started, P, k, B

    def schedule(self, *args: Any, **kwargs: Any):
        started = time.perf_counter()
        for request in self.running:
            if request.spec_token_ids:
                # The drafted chain's tail not worth verifying is dropped (vLLM drops invalid
                # draft tokens of structured output the same way).
                del request.spec_token_ids[
                    self.planner.keep(request.request_id, len(request.spec_token_ids)) :
                ]
        output = super().schedule(*args, **kwargs)
        rows = list(output.num_scheduled_tokens)
        if self.num_spec_tokens > 0 and rows:
            output.num_spec_tokens_to_schedule = self.planner.choose(rows)
        self._step = (
            started,
            output.total_num_scheduled_tokens,
            output.num_spec_tokens_to_schedule,
            len(rows),
        )
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any):
        if self._step is not None and self._step[3] > 0:
            started, positions, k, rows = self._step
            ms = (time.perf_counter() - started) * 1e3
            made = sum(len(s) for s in model_runner_output.sampled_token_ids or [])
            self.planner.observe_step(positions, k, rows, ms, made)
        self._step = None
        sampled = model_runner_output.sampled_token_ids or []
        index = model_runner_output.req_id_to_index
        for req_id, drafted in scheduler_output.scheduled_spec_decode_tokens.items():
            i = index.get(req_id)
            if i is None or i >= len(sampled) or not sampled[i]:
                continue
            valid = sum(1 for t in drafted if t >= 0)
            self.planner.observe_chain(req_id, valid, len(sampled[i]) - 1)
        if self.planner.steps % PRUNE_EVERY == 0:
            self.planner.forget_requests(set(self.requests))
        return super().update_from_output(scheduler_output, model_runner_output)
