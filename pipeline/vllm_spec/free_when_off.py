"""A step that drafts nothing runs as a step without speculation (installed by the plugin
over vLLM 0.32's ``GPUModelRunner``, which the CPU runner inherits).

A speculating engine runs every step on its speculative path, also when nothing is drafted
or verified: it builds the rejection sampler's metadata (index arrays copied to the device),
samples through the rejection sampler, prepares the drafter's inputs and runs the draft's
forward, copies the drafted tokens to the host and, after the step, asks the worker for them
(``EngineCore.post_step``: a round trip to the worker process in a multiprocess engine).

- **A plain step.** When the scheduler gives a step 0 draft tokens and no row has a draft to
  verify, the runner runs it as an engine without speculation runs every step (its
  speculative config set aside for that step's ``execute_model`` and ``sample_tokens``); the
  catch-up drafter (pipeline.vllm_spec.catch_up_draft) is told which positions its draft
  missed, and catches them up when the row drafts again. Not where the skip would pass the
  drafter's backlog bound (the step then runs the draft's forward to empty it, on vLLM's
  path), under async scheduling (the committed tokens trail the step on the host), or, with
  prefix caching, in a step that starts or resumes a request (whose cached prefix may hold
  blocks the draft skipped: checked on vLLM's path, which has the block table at hand).
- **On vLLM's path at k = 0** (those steps, and any where vLLM's own batch-size table says
  0): the drafter is asked first and skips its forward and the preparation of its inputs;
  a step with no draft token anywhere is sampled by the plain sampler (the same tokens; a
  request asking for logprobs keeps vLLM's path); no drafted tokens are copied to the host.
- After any step that drafted none the engine core no longer asks for drafted tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from pipeline.vllm_spec.catch_up_draft import CatchUp
from pipeline.vllm_spec.step_rows import block_ids, step_rows

_execute_model = GPUModelRunner.execute_model
_sample_tokens = GPUModelRunner.sample_tokens
_sample = GPUModelRunner._sample
_propose = GPUModelRunner.propose_draft_token_ids
_update_from_output = Scheduler.update_from_output
_post_step = EngineCore.post_step


def _plain_step(self: GPUModelRunner, output: Any) -> bool:
    """Whether this step can run as a step without speculation (see the module's text)."""
    drafter = getattr(self, "drafter", None)
    if (
        not isinstance(drafter, CatchUp)
        or self.use_async_scheduling
        or output.num_spec_tokens_to_schedule
        or output.scheduled_spec_decode_tokens
        or not output.total_num_scheduled_tokens
    ):
        return False
    new, cached = output.scheduled_new_reqs, output.scheduled_cached_reqs
    if drafter._caching and (new or cached.resumed_req_ids):
        return False
    ids = [r.req_id for r in new] + list(cached.req_ids)
    starts = [r.num_computed_tokens for r in new] + list(cached.num_computed_tokens)
    lens = [output.num_scheduled_tokens[r] for r in ids]
    return not drafter.over_backlog(ids, starts, lens)


def execute_model(self: GPUModelRunner, scheduler_output: Any, *args: Any, **kw: Any):
    self._specbound_plain = _plain_step(self, scheduler_output)
    if not self._specbound_plain:
        return _execute_model(self, scheduler_output, *args, **kw)
    spec, self.speculative_config = self.speculative_config, None
    try:
        out = _execute_model(self, scheduler_output, *args, **kw)
    finally:
        self.speculative_config = spec
    state = self.execute_model_state
    if state is None:  # nothing to sample (vLLM returned its output already)
        self._specbound_plain = False
        return out
    drafter = self.drafter
    batch = self.input_batch
    rows = list(batch.req_ids[: batch.num_reqs])
    lens = np.fromiter((scheduler_output.num_scheduled_tokens[r] for r in rows), np.int64)
    starts = batch.num_computed_tokens_cpu[: len(rows)].astype(np.int64)
    hidden = None
    if drafter.pass_hidden_states_to_model:
        hidden = _hidden(self, state.hidden_states, state.aux_hidden_states, int(lens.sum()))
    group = max(getattr(drafter, "kv_cache_gid", 0), 0)
    table = batch.block_table[group].get_numpy_array()[: len(rows)]
    drafter.skipped(rows, starts, lens, hidden, table)
    drafter._count(plain=1)
    return out


def sample_tokens(self: GPUModelRunner, *args: Any, **kw: Any):
    if not getattr(self, "_specbound_plain", False):
        return _sample_tokens(self, *args, **kw)
    self._specbound_plain = False
    spec, self.speculative_config = self.speculative_config, None
    try:
        return _sample_tokens(self, *args, **kw)
    finally:
        self.speculative_config = spec


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
            hidden = None
            if drafter.pass_hidden_states_to_model:
                given = _given(args, kw)
                hidden = _hidden(
                    self, given["hidden_states"], given["aux_hidden_states"], int(lens.sum())
                )
            if drafter.skip_step(rows, starts, lens, hidden, block_ids(cad)):
                self._draft_probs = None
                self._draft_prob_req_ids = None
                # A list, as vLLM's CPU-side drafters return: nothing to copy to the host.
                return [[] for _ in rows]
            drafter._decided_by_runner = True  # a full backlog: the forward runs, at k = 0
    return _propose(self, scheduler_output, *args, **kw)


def _given(args: tuple, kw: dict) -> dict:
    names = ("hidden_states", "sample_hidden_states", "aux_hidden_states")
    return dict(zip(names, args[2:5], strict=False)) | {k: kw[k] for k in names if k in kw}


def _hidden(self: GPUModelRunner, hidden_states, aux_hidden_states, n: int) -> torch.Tensor:
    """The target's hidden states of the step's n scheduled tokens as vLLM hands them to an
    EAGLE drafter (the tapped layers side by side for EAGLE-3)."""
    if self.use_aux_hidden_state_outputs:
        return torch.cat([h[:n] for h in aux_hidden_states], dim=-1)
    return hidden_states[:n]


def update_from_output(self: Scheduler, scheduler_output: Any, model_runner_output: Any):
    self.specbound_drafted = scheduler_output.num_spec_tokens_to_schedule
    return _update_from_output(self, scheduler_output, model_runner_output)


def post_step(self: EngineCore, model_executed: bool) -> None:
    if model_executed and getattr(self.scheduler, "specbound_drafted", None) == 0:
        return  # nothing was drafted: no draft tokens to take from the worker
    _post_step(self, model_executed)


def install() -> None:
    GPUModelRunner.execute_model = execute_model
    GPUModelRunner.sample_tokens = sample_tokens
    GPUModelRunner._sample = sample
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    Scheduler.update_from_output = update_from_output
    EngineCore.post_step = post_step
