"""The cost-aware draft length as a vLLM scheduler: vLLM drafts with its own ``draft_model``
(or ``eagle3``) runner, and this scheduler chooses how many tokens that runner drafts at each
step, by the modelled tokens per millisecond of the batch it schedules
(pipeline.vllm_spec.step_planner), starting from the pair's offline acceptance model and
vLLM step-cost calibration (pipeline.vllm_spec.priors) and refined from the engine's steps.

    LLM(model="models/target", enforce_eager=True, dtype="float32",
        scheduler_cls="pipeline.vllm_spec.scheduler.CostAwareScheduler",
        speculative_config={"method": "draft_model", "model": "models/draft",
                            "num_speculative_tokens": 4,
                            "draft_sample_method": "probabilistic"})

vLLM's contract (0.32, vllm/v1/core/sched/scheduler.py and gpu_model_runner.py): the
scheduler's ``SchedulerOutput.num_spec_tokens_to_schedule`` is the number of draft tokens the
runner's drafter makes at the end of the step (vLLM's own per-batch-size schedule,
``num_speculative_tokens_per_batch_size``, sets it the same way, after KV slots for K are
reserved). One K serves the whole batch; each row's chain is then verified only as far as its
own acceptance pays (``keep``), so a row that does not pay verifies nothing. With the
project's plugin (pipeline.vllm_spec.plugin) a step at 0 runs no draft forward. Each row is
priced at its own temperature (greedy or sampled acceptance), read from its request's
sampling parameters, and each row drafts at most what its request allows
(pipeline.vllm_spec.request_args: ``vllm_xargs`` speculation off or a cap; a seeded sampled
request drafts nothing, so that its seed repeats its text). Greedy output is vLLM's
rejection sampling either way: the text equals decoding without speculation. Settings:
``SPECBOUND_SCHEDULER`` (a JSON object of PlannerConfig's fields), read at start.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from pipeline.vllm_spec.planner_config import PlannerConfig
from pipeline.vllm_spec.priors import load_priors, mode_of
from pipeline.vllm_spec.request_args import draft_cap
from pipeline.vllm_spec.step_planner import StepPlanner

PRUNE_EVERY = 64  # steps between forgetting finished requests' acceptance
REPORT_EVERY = 4096  # steps between log lines of the planner's state (and one at shutdown)
# A file the planner's report lines are also appended to (the benchmark keeps one per run, as
# vLLM's log level there hides INFO).
REPORT_ENV = "SPECBOUND_PLANNER_LOG"
# A child of vLLM's logger: its handler and level apply (a logger of our own prints nothing
# from the engine process).
log = logging.getLogger("vllm.specbound.scheduler")


class CostAwareScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        config = PlannerConfig.from_env()
        spec = self.vllm_config.speculative_config
        draft = getattr(spec, "model", None) if spec is not None else None
        if config.stop_below > 0 and getattr(spec, "method", None) != "draft_model":
            raise ValueError(
                "stop_below: the acceptance stop reads a draft model's acceptance model; this "
                f"engine drafts with {getattr(spec, 'method', None)}"
            )
        device = str(getattr(self.vllm_config.device_config, "device_type", "cpu") or "cpu")
        target = getattr(self.vllm_config.model_config, "model", None)
        priors = load_priors(draft, device, target) if config.offline_priors else load_priors(None)
        log.info("cost-aware scheduler: priors from %s", ", ".join(priors.sources) or "defaults")
        self.planner = StepPlanner(self.num_spec_tokens, config, priors)
        if self.num_spec_tokens > 0:
            # Marks the draft length as dynamic, as vLLM's own schedule does: no padding of
            # new decodes to K + 1 tokens (that padding serves CUDA graphs of a fixed K).
            self.dynamic_sd_lookup = [self.num_spec_tokens] * (
                self.scheduler_config.max_num_seqs + 1
            )
        # Rows scheduled at a k = 0 step since they last drafted: with the plugin the draft
        # skipped their tokens, and the next drafting step's first pass catches them up.
        self._behind: set[str] = set()
        # Per request, its computed tokens the draft had processed at its last drafted step
        # (the others are the backlog a catch-up processes); 0 for one never drafted.
        self._drafted_to: dict[str, int] = {}
        self._caught_up = 0  # tokens this step's draft pass catches up
        self.catch_up_steps = 0  # steps timed with a catch-up in them, not fitted (a report)
        self.wind_down_steps = 0  # steps at 0 that verified drafts, not fitted (a report)
        # Steps whose window saw a request arrive or end, not fitted (a report): served, such a
        # step also pays the serving stack's work for that request on the same cores (7-row
        # K = 5 steps 51 ms where 8-row ones took 33), which no draft length causes.
        self.churn_steps = 0
        self._arrived = False
        # started, P (verified positions: a prompt's are not), k, B, whether every row only
        # decodes, the switch it makes (or None), the tokens it catches up
        self._step: tuple[float, int, int, int, bool, str | None, int] | None = None
        self._done: tuple[float, int, int, int, bool, str | None, int, int] | None = None

    def schedule(self, *args: Any, **kwargs: Any):
        started = time.perf_counter()
        if self._done is not None:
            # The last step, timed from its schedule to this one: its whole cycle in the
            # engine's loop, vLLM's own update_from_output and the drafted tokens'
            # hand-over included, which a window ending at update_from_output misses.
            self._observe(started)
        self._arrived = False
        planner = self.planner
        rows = len(self.running)
        for request in self.running:
            if request.request_id not in planner.modes:
                params = request.sampling_params
                planner.set_mode(request.request_id, mode_of(getattr(params, "temperature", 0)))
                planner.prefill.set_shape(
                    request.request_id, request.num_prompt_tokens, getattr(params, "max_tokens", 0)
                )
                cap = draft_cap(params, self.num_spec_tokens)
                if cap < self.num_spec_tokens:
                    planner.set_cap(request.request_id, cap)
            if request.spec_token_ids:
                # The drafted chain's tail not worth verifying is dropped (vLLM drops invalid
                # draft tokens of structured output the same way): from the first -1 (a token
                # the drafter's acceptance stop did not propose), then by the marginal rule.
                drafted = request.spec_token_ids
                if min(drafted) < 0:
                    del drafted[next(j for j, t in enumerate(drafted) if t < 0) :]
                del request.spec_token_ids[
                    planner.keep(request.request_id, len(request.spec_token_ids), rows) :
                ]
        output = super().schedule(*args, **kwargs)
        ids = list(output.num_scheduled_tokens)
        if self.num_spec_tokens > 0 and ids:
            output.num_spec_tokens_to_schedule = planner.choose(ids)
        spec = output.scheduled_spec_decode_tokens
        self._step = (
            started,
            len(ids) + sum(len(tokens) for tokens in spec.values()),  # verified positions
            output.num_spec_tokens_to_schedule,
            len(ids),
            _decode_only(output),
            self._switch(ids, output),
            self._caught_up,
        )
        return output

    def _switch(self, ids: list[str], output: Any) -> str | None:
        """Whether the step switches drafting "on" or "off" (else None): such a step costs
        what neither of its k's steady steps does; it is not fitted (it would price that k at
        the switch's cost) but measured as a switch (pipeline.vllm_spec.switch_cost). On: its
        draft pass also catches up what steps at 0 skipped. Off: a step at 0 that still
        verifies the last drafts runs on vLLM's speculative path (16-row ones took 11-12.5 ms
        where steps at 0 run as plain steps took 8.2-9.6), where every later step at 0 runs as
        a plain step (pipeline.vllm_spec.free_when_off)."""
        if self._catches_up(ids, output):
            return "on"
        off = output.num_spec_tokens_to_schedule == 0 and bool(output.scheduled_spec_decode_tokens)
        self.wind_down_steps += int(off)
        return "off" if off else None

    def _catches_up(self, ids: list[str], output: Any) -> bool:
        """Whether this step's draft pass also catches up tokens an earlier step at k = 0
        skipped: such a step costs more than the model's terms say (its first pass covers
        every missed token), and fitted it would price drafting at what switching costs."""
        if self.num_spec_tokens == 0:
            return False
        self._caught_up = 0
        if output.num_spec_tokens_to_schedule == 0:
            self._behind.update(ids)
            return False
        scheduled, drafted_to = output.num_scheduled_tokens, self._drafted_to
        for req_id in ids:
            done = self.requests[req_id].num_computed_tokens  # this step's tokens included
            if req_id in self._behind:
                self._caught_up += max(done - scheduled[req_id] - drafted_to.get(req_id, 0), 0)
            drafted_to[req_id] = done
        behind = not self._behind.isdisjoint(ids)
        self._behind.difference_update(ids)
        self.catch_up_steps += int(behind)
        return behind

    def add_request(self, request: Any) -> None:
        self._arrived = True
        super().add_request(request)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any):
        if self._step is not None and self._step[3] > 0:
            made = sum(len(s) for s in model_runner_output.sampled_token_ids or [])
            self._done = (*self._step, made)
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
            self._behind.intersection_update(self.requests)
            for gone in set(self._drafted_to) - set(self.requests):
                del self._drafted_to[gone]
        if self.planner.steps % REPORT_EVERY == 0 and self.planner.steps:
            self._report("")
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._done is not None and not self.has_requests():
            # The engine waits for work now: the step ends here, not at the next schedule.
            self._observe(time.perf_counter())
        return outputs

    def _observe(self, now: float) -> None:
        started, positions, k, rows, decode, switch, caught_up, made = self._done
        self._done = None
        # finished_req_ids: the requests freed since the last schedule (ended or aborted).
        churn = decode and (self._arrived or bool(self.finished_req_ids))
        self.churn_steps += int(churn)
        clean = decode and not churn
        self.planner.observe_step(
            positions,
            k,
            rows,
            (now - started) * 1e3,
            made,
            clean and switch is None,
            switch if clean else None,
            caught_up,
        )

    def _free_request(self, request: Any, *args: Any, **kwargs: Any):
        # Its output teaches the planner how long requests run (draft_prefill).
        self.planner.prefill.ended(request.request_id, request.num_output_tokens)
        return super()._free_request(request, *args, **kwargs)

    def shutdown(self) -> None:
        self._report(" at shutdown")
        super().shutdown()

    def _report(self, when: str) -> None:
        line = (
            f"cost-aware scheduler{when}: {self.planner.report()}; "
            f"{self.catch_up_steps} steps caught the draft up, {self.wind_down_steps} at 0 "
            f"verified drafts and {self.churn_steps} saw a request arrive or end, not fitted"
        )
        log.info(line)
        path = os.environ.get(REPORT_ENV)
        if path:
            try:
                with open(path, "a") as out:
                    out.write(line + "\n")
            except OSError as exc:  # a report is never worth a failed step
                log.warning("cost-aware scheduler: cannot write %s: %s", path, exc)


def _decode_only(output: Any) -> bool:
    """Whether every scheduled row verifies its drafts only (its one new token and its draft
    tokens): no prompt or resumed request is (re)filled in the step."""
    spec = output.scheduled_spec_decode_tokens
    return not output.scheduled_new_reqs and all(
        n == 1 + len(spec.get(req_id, ())) for req_id, n in output.num_scheduled_tokens.items()
    )
