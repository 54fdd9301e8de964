"""vLLM's ``draft_model`` drafter, free when a step drafts nothing (installed by the plugin,
pipeline.vllm_spec.plugin).

vLLM 0.32 runs the draft's first pass at every step, also when the step drafts 0 tokens
(``SpecDecodeBaseProposer.propose``: "the prefill forward pass above already ran to keep the
drafter KV cache in sync"), so k = 0 costs a draft forward. This subclass skips that forward
and remembers, per request, the first position whose draft KV it did not write. When the
request drafts again, its first pass is extended backwards over every token it missed: their
ids are the request's committed tokens (``input_batch.token_ids_cpu``), their positions
precede the step's own, and vLLM's first pass recomputes the slots of all of them from the
request's block table (``compute_new_slot_mapping``), so the missed KV lands in the request's
own slots and the proposals equal those of a draft that never stopped.

Bounded: when skipping a step would leave more than ``backlog_tokens`` missed tokens in the
batch, the step runs its (extended) first pass anyway and proposes nothing, as vLLM does; the
backlog then is empty again. Counters (steps, skipped, caught-up tokens) go to the memory-mapped
file named by ``SPECBOUND_DRAFTER_STATS`` when set.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from pipeline.vllm_spec.stats import DRAFTER_FIELDS, DRAFTER_STATS_ENV, StatsFile


def step_rows(cad) -> tuple[np.ndarray, np.ndarray]:
    """Each row's first position this step (its computed tokens) and its scheduled tokens."""
    batch = cad.batch_size()
    lens = cad.naive_query_lens()[:batch].cpu().numpy().astype(np.int64)
    starts = cad.seq_lens[:batch].cpu().numpy().astype(np.int64) - lens
    return starts, lens


class CatchUpDraftModelProposer(DraftModelProposer):
    # False only in tests: skip without catching up (the stale draft the catch-up prevents).
    catch_up = True
    # Missed tokens a batch may carry before a k = 0 step runs its forward anyway; None: half
    # the drafter's token buffers (max_num_batched_tokens).
    backlog_limit: int | None = None

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        # vLLM passes its model runner but keeps no reference: the committed tokens and the
        # request ids of the batch rows are read from it.
        self.runner = runner
        # request id -> first position whose draft KV is missing
        self.missed_from: dict[str, int] = {}
        # Extended first passes must fit the drafter's buffers (max_num_batched_tokens).
        limit = self.backlog_limit
        self.backlog_tokens = self.max_num_tokens // 2 if limit is None else limit
        path = os.environ.get(DRAFTER_STATS_ENV)
        self.stats = StatsFile(path, DRAFTER_FIELDS, create=False) if path else None
        # Set by the runner's shortcut (pipeline.vllm_spec.free_when_off) when it has already
        # asked skip_step for this k = 0 step and been told to run the forward.
        self._decided_by_runner = False

    def _count(self, **deltas: float) -> None:
        if self.stats is not None:
            self.stats.add(**deltas)

    def skip_step(self, req_ids: list[str], starts: np.ndarray, lens: np.ndarray) -> bool:
        """Skip this k = 0 step's draft forward (True, remembering what each row misses), or
        run it to empty a backlog that would pass ``backlog_tokens`` (False)."""
        ends = starts + lens
        backlog = sum(
            int(end) - self.missed_from.get(r, int(s))
            for r, s, end in zip(req_ids, starts, ends, strict=True)
        )
        self._count(steps=1)
        if backlog > self.backlog_tokens:
            self._count(flushed=1)
            return False
        for req_id, start in zip(req_ids, starts, strict=True):
            self.missed_from[req_id] = min(self.missed_from.get(req_id, int(start)), int(start))
        self._last_draft_probs = None
        self._count(skipped=1)
        return True

    def propose(
        self,
        num_speculative_tokens,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample,
        common_attn_metadata,
        sampling_metadata,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        cad = common_attn_metadata
        batch = cad.batch_size()
        req_ids = list(self.runner.input_batch.req_ids[:batch])
        starts, lens = step_rows(cad)
        if num_speculative_tokens == 0 and not self._decided_by_runner:
            if self.skip_step(req_ids, starts, lens):
                return torch.empty(batch, 0, dtype=torch.int64, device=target_token_ids.device)
        elif num_speculative_tokens > 0:
            self._count(steps=1)
        self._decided_by_runner = False
        started = time.perf_counter()
        if self.catch_up and any(r in self.missed_from for r in req_ids):
            target_token_ids, target_positions, target_hidden_states, cad = self._with_missed(
                req_ids, starts, target_token_ids, target_positions, target_hidden_states, cad
            )
        for req_id in req_ids:
            self.missed_from.pop(req_id, None)
        self._forget_finished()
        out = super().propose(
            num_speculative_tokens,
            target_token_ids,
            target_positions,
            target_hidden_states,
            next_token_ids,
            token_indices_to_sample,
            cad,
            sampling_metadata,
            *args,
            **kwargs,
        )
        self._count(forward_s=time.perf_counter() - started)
        return out

    def _forget_finished(self) -> None:
        if len(self.missed_from) > 4 * max(1, self.max_batch_size):
            alive = set(self.runner.requests)
            for req_id in [r for r in self.missed_from if r not in alive]:
                del self.missed_from[req_id]

    def _with_missed(self, req_ids, starts, token_ids, positions, hidden, cad):
        """The step's inputs with each request's missed tokens put before its own."""
        token_ids_cpu = self.runner.input_batch.token_ids_cpu
        loc = cad.query_start_loc_cpu.to(torch.int64).tolist()
        ids_parts, pos_parts, lens = [], [], []
        caught_up = 0
        for i, req_id in enumerate(req_ids):
            start = int(starts[i])
            first = min(self.missed_from.get(req_id, start), start)
            if first < start:
                ids_parts.append(torch.from_numpy(token_ids_cpu[i, first:start].astype(np.int64)))
                pos_parts.append(torch.arange(first, start, dtype=torch.int64))
                caught_up += start - first
            ids_parts.append(token_ids[loc[i] : loc[i + 1]].cpu().to(torch.int64))
            pos_parts.append(positions[loc[i] : loc[i + 1]].cpu().to(torch.int64))
            lens.append(start - first + loc[i + 1] - loc[i])
        self._count(caught_up=caught_up)
        device = token_ids.device
        new_ids = torch.cat(ids_parts).to(device=device, dtype=token_ids.dtype)
        new_pos = torch.cat(pos_parts).to(device=device, dtype=positions.dtype)
        query_start = torch.zeros(len(lens) + 1, dtype=cad.query_start_loc_cpu.dtype)
        query_start[1:] = torch.cumsum(torch.tensor(lens), 0)
        new_cad = cad.replace(
            query_start_loc=query_start.to(cad.query_start_loc.device),
            query_start_loc_cpu=query_start,
            num_actual_tokens=int(query_start[-1]),
            max_query_len=max(lens),
            positions=None if cad.positions is None else new_pos,
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )
        # A draft model reads no target hidden states (only EAGLE-style drafters do).
        return new_ids, new_pos, hidden, new_cad
