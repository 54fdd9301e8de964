"""A step that drafts nothing costs what a step without speculation costs (installed by the
plugin over vLLM 0.32's ``GPUModelRunner``, which the CPU runner inherits).

Besides the draft's forward (skipped by pipeline.vllm_spec.catch_up_draft), a speculating
engine does three things at every step that a step drafting nothing does not need:

- it samples through the rejection sampler even when no row has a draft token (its metadata
  is built whenever speculation is configured), which at T = 0 adds an argmax and a kernel
  call per step: with no draft token anywhere, the plain sampler gives the same tokens, so
  that step is sampled by it (a request asking for logprobs keeps vLLM's path);
- before calling the drafter it prepares the drafter's inputs (next tokens, padded inputs):
  when the drafter would skip the step anyway, the runner now asks it first and skips that
  preparation too;
- after every step the engine core asks the worker for the drafted tokens
  (``EngineCore.post_step``: ``take_draft_token_ids``, a round trip to the worker process in
  a multiprocess engine): after a step that drafted none it no longer asks (the scheduler has
  already cleared every request's draft tokens when it scheduled them).
Measured on this CPU in-process (no worker round trip there): the first two were most of what
a speculating engine at k = 0 cost over ``none`` once the draft forward was gone
(docs/vllm_plugin.md).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from pipeline.vllm_spec.catch_up_draft import CatchUp
from pipeline.vllm_spec.step_rows import block_ids, step_rows

_sample = GPUModelRunner._sample
_propose = GPUModelRunner.propose_draft_token_ids
_update_from_output = Scheduler.update_from_output
_post_step = EngineCore.post_step


def sample(self: GPUModelRunner, logits: torch.Tensor, spec_decode_metadata: Any):
    sampling_metadata = self.input_batch.sampling_metadata
    if (
        spec_decode_metadata is not None
        and spec_decode_metadata.max_spec_len == 0
        and sampling_metadata.max_num_logprobs is None
        and not self.use_async_scheduling
    ):
        self.input_batch.update_async_output_token_ids()
        return self.sampler(logits=logits, sampling_metadata=sampling_metadata)
    return _sample(self, logits, spec_decode_metadata)


def propose_draft_token_ids(self: GPUModelRunner, scheduler_output: Any, *args: Any, **kw: Any):
    drafter = getattr(self, "drafter", None)
    if (
        scheduler_output.num_spec_tokens_to_schedule == 0
        and isinstance(drafter, CatchUp)
        and not self.use_async_scheduling
    ):
        cad = kw.get("common_attn_metadata", args[6] if len(args) > 6 else None)
        if cad is not None:
            starts, lens = step_rows(cad)
            rows = list(self.input_batch.req_ids[: cad.batch_size()])
            hidden = (
                _target_hidden(self, args, kw, int(lens.sum()))
                if drafter.pass_hidden_states_to_model
                else None
            )
            if drafter.skip_step(rows, starts, lens, hidden, block_ids(cad)):
                self._draft_probs = None
                self._draft_prob_req_ids = None
                return torch.empty(len(rows), 0, dtype=torch.int64, device=self.device)
            drafter._decided_by_runner = True  # a full backlog: the forward runs, at k = 0
    return _propose(self, scheduler_output, *args, **kw)


def _target_hidden(self: GPUModelRunner, args: tuple, kw: dict, n: int) -> torch.Tensor:
    """The target's hidden states of the step's n scheduled tokens as vLLM hands them to an
    EAGLE drafter (the tapped layers side by side for EAGLE-3)."""
    names = ("hidden_states", "sample_hidden_states", "aux_hidden_states")
    given = dict(zip(names, args[2:5], strict=False)) | {k: kw[k] for k in names if k in kw}
    if self.use_aux_hidden_state_outputs:
        return torch.cat([h[:n] for h in given["aux_hidden_states"]], dim=-1)
    return given["hidden_states"][:n]


def update_from_output(self: Scheduler, scheduler_output: Any, model_runner_output: Any):
    self.specbound_drafted = scheduler_output.num_spec_tokens_to_schedule
    return _update_from_output(self, scheduler_output, model_runner_output)


def post_step(self: EngineCore, model_executed: bool) -> None:
    if model_executed and getattr(self.scheduler, "specbound_drafted", None) == 0:
        return  # nothing was drafted: no draft tokens to take from the worker
    _post_step(self, model_executed)


def install() -> None:
    GPUModelRunner._sample = sample
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    Scheduler.update_from_output = update_from_output
    EngineCore.post_step = post_step
