"""vLLM's drafters, free when a step drafts nothing (installed by the plugin,
pipeline.vllm_spec.plugin): ``draft_model`` and ``eagle3``.

vLLM 0.32 runs the draft's first pass at every step, also when the step drafts 0 tokens
(``SpecDecodeBaseProposer.propose``: "the prefill forward pass above already ran to keep the
drafter KV cache in sync"), so k = 0 costs a draft forward. These subclasses skip that forward
and remember, per request, the first position whose draft KV they did not write. When the
request drafts again, its first pass is extended backwards over every position it missed:
their token ids are the request's committed tokens (``input_batch.token_ids_cpu``), their
positions precede the step's own, and their slots are the request's own (its block table), so
the proposals equal those of a draft that never stopped.

An EAGLE-3 head also reads the target's hidden states (its tapped layers) at every position
it processes, which vLLM hands the drafter for the step's own tokens only: the skipped steps'
are kept per request (CPU memory: the tapped width x 4 bytes per missed token, e.g. 1.5 KB for
the embedded target, 48 KB for three taps of a 4096-wide model) until it catches up.

Bounded: when skipping a step would leave a row of the draft model, or the batch of an EAGLE
head (whose kept hidden states are memory), more than ``backlog_tokens`` missed tokens
(default half ``max_num_batched_tokens``, the drafter's buffers), the step runs its
(extended) first pass anyway and proposes nothing, as vLLM does. A pass never outgrows the
buffers: a row whose catch-up does not fit beside the step's tokens is left behind for a later
pass, drafting from its stale KV meanwhile (writing past them corrupted the worker's heap).
Under prefix caching, cached blocks the draft skipped are caught up too (stale_blocks).
Counters go to the memory-mapped file named by ``SPECBOUND_DRAFTER_STATS`` when set.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.spec_decode.eagle import EagleProposer

from pipeline.vllm_spec.catch_up_inputs import with_missed
from pipeline.vllm_spec.stale_blocks import StaleBlocks
from pipeline.vllm_spec.stats import DRAFTER_FIELDS, DRAFTER_STATS_ENV, StatsFile
from pipeline.vllm_spec.step_rows import block_ids, step_rows
from pipeline.vllm_spec.stopping_draft import AcceptanceStopDrafter


class CatchUp:
    """The skip-and-catch-up logic, over any vLLM drafter built on SpecDecodeBaseProposer."""

    # False only in tests: skip without catching up (the stale draft the catch-up prevents).
    catch_up = True
    # False only in tests: take a cached prefix's draft KV as it is, stale or not.
    check_prefix = True
    # Missed tokens a row (a draft model's) or the batch (an EAGLE head's) may carry before a
    # k = 0 step runs its forward anyway; None: half the drafter's token buffers
    # (max_num_batched_tokens).
    backlog_limit: int | None = None

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        # vLLM passes its model runner but keeps no reference: the committed tokens and the
        # request ids of the batch rows are read from it.
        self.runner = runner
        # request id -> first position whose draft KV is missing
        self.missed_from: dict[str, int] = {}
        # request id -> [(first position, the target's hidden states from there)] (EAGLE)
        self.missed_hidden: dict[str, list[tuple[int, torch.Tensor]]] = {}
        limit = self.backlog_limit
        self.backlog_tokens = self.max_num_tokens // 2 if limit is None else limit
        path = os.environ.get(DRAFTER_STATS_ENV)
        self.stats = StatsFile(path, DRAFTER_FIELDS, create=False) if path else None
        self._caching = vllm_config.cache_config.enable_prefix_caching
        # Built at the first step: vLLM sets the drafter's block size after __init__.
        self.stale: StaleBlocks | None = None
        # Set by the runner's shortcut (pipeline.vllm_spec.free_when_off) when it has already
        # asked skip_step for this k = 0 step and been told to run the forward.
        self._decided_by_runner = False

    def _count(self, **deltas: float) -> None:
        if self.stats is not None:
            self.stats.add(**deltas)

    def _note_prefixes(self, req_ids: list[str], starts: np.ndarray, table: np.ndarray) -> None:
        """A row starting on a cached prefix with stale blocks misses their positions (an
        EAGLE head cannot catch up there: the target's hidden states of a cached prefix are
        gone; nor can a row whose catch-up would pass ``backlog_tokens``: both are counted)."""
        if self._caching and self.stale is None:
            self.stale = StaleBlocks(self.block_size)
        if self.stale is None:
            return
        for i, req_id in enumerate(req_ids):
            start = int(starts[i])
            first = self.stale.first_stale(req_id, table[i], start)
            if first is None or not self.check_prefix:
                continue
            if self.pass_hidden_states_to_model or start - first > self.backlog_tokens:
                self._count(stale_prefix=start - first)
                self.stale.leave(req_id, start)
            else:
                self.missed_from[req_id] = min(self.missed_from.get(req_id, first), first)

    def over_backlog(self, req_ids: list[str], starts, lens) -> bool:
        """Whether skipping a step of ``lens`` tokens from ``starts`` would pass the backlog
        bound: an EAGLE head keeps the target's hidden states of what it missed in memory,
        bounded for the batch; a draft model keeps nothing (its KV slots are the request's
        own), so only each row's catch-up must fit one pass. A row's backlog: its tokens
        since the first position it missed."""
        get = self.missed_from.get
        missed = [
            s + n - get(r, s) for r, s, n in zip(req_ids, _ints(starts), _ints(lens), strict=True)
        ]
        worst = sum(missed) if self.pass_hidden_states_to_model else max(missed, default=0)
        return worst > self.backlog_tokens

    def skip_step(
        self,
        req_ids: list[str],
        starts: np.ndarray,
        lens: np.ndarray,
        hidden: torch.Tensor | None,
        table: np.ndarray,
    ) -> bool:
        """Skip this k = 0 step's draft forward (True, remembering what each row misses and,
        for a drafter that reads them, the step's target hidden states), or run it to empty a
        backlog that would pass ``backlog_tokens`` (False). ``table``: the rows' block ids."""
        self._note_prefixes(req_ids, starts, table)
        if self.over_backlog(req_ids, starts, lens):
            self._count(steps=1, flushed=1)
            return False
        self.skipped(req_ids, starts, lens, hidden, table)
        return True

    def skipped(
        self,
        req_ids: list[str],
        starts: np.ndarray,
        lens: np.ndarray,
        hidden: torch.Tensor | None,
        table: np.ndarray,
    ) -> None:
        """Remember a step the draft did not run: each row's first missed position and, for a
        drafter that reads them, the step's target hidden states (batch order)."""
        starts, lens = _ints(starts), _ints(lens)
        missed_from = self.missed_from
        for req_id, start in zip(req_ids, starts, strict=True):
            first = missed_from.get(req_id)
            if first is None or start < first:  # earlier after a preemption's recompute
                missed_from[req_id] = start
        if self.pass_hidden_states_to_model and hidden is not None:
            offset = 0
            for req_id, start, n in zip(req_ids, starts, lens, strict=True):
                chunk = hidden[offset : offset + n].to("cpu", copy=True)
                self.missed_hidden.setdefault(req_id, []).append((start, chunk))
                offset += n
        if self.stale is not None:
            for i, (start, n) in enumerate(zip(starts, lens, strict=True)):
                self.stale.skipped(table[i], start, start + n)
        self._last_draft_probs = None
        self._count(steps=1, skipped=1)

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
        table = block_ids(cad)
        # Under async scheduling the runner's committed tokens on the CPU may trail the step
        # (vLLM keeps the last sampled ones on the device), so the catch-up could not read
        # them: there the drafter runs every step as vLLM does.
        skippable = not getattr(self.runner, "use_async_scheduling", False)
        if num_speculative_tokens == 0 and skippable and not self._decided_by_runner:
            if self.skip_step(req_ids, starts, lens, target_hidden_states, table):
                return torch.empty(batch, 0, dtype=torch.int64, device=target_token_ids.device)
        elif num_speculative_tokens > 0:
            self._count(steps=1)
        self._decided_by_runner = False
        self._note_prefixes(req_ids, starts, table)  # (a second call in a step changes nothing)
        started = time.perf_counter()
        # vLLM's draft model puts one more slot per row after the step's tokens (its
        # next token), all in buffers of max_num_batched_tokens.
        extra = self.net_num_new_slots_per_request * batch
        room = self.max_num_tokens - int(target_token_ids.shape[0]) - extra
        caught = self._fitting(req_ids, starts, room) if self.catch_up else set(req_ids)
        if self.catch_up and any(r in self.missed_from for r in req_ids):
            (
                target_token_ids,
                target_positions,
                target_hidden_states,
                token_indices_to_sample,
                cad,
            ) = with_missed(
                self,
                req_ids,
                starts,
                caught,
                target_token_ids,
                target_positions,
                target_hidden_states,
                token_indices_to_sample,
                cad,
            )
        for i, req_id in enumerate(req_ids):
            if req_id in caught:
                self.missed_from.pop(req_id, None)
                self.missed_hidden.pop(req_id, None)
                if self.stale is not None:
                    self.stale.written(req_id, table[i], int(starts[i] + lens[i]))
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

    def _fitting(self, req_ids: list[str], starts: np.ndarray, room: int) -> set[str]:
        """The rows whose missed tokens fit, in batch order, in ``room`` buffer slots beside the
        step's own tokens; a row that does not fit keeps its missed positions for later."""
        caught = set()
        for req_id, start in zip(req_ids, starts, strict=True):
            missed = int(start) - self.missed_from.get(req_id, int(start))
            if missed <= room:
                caught.add(req_id)
                room -= max(missed, 0)
        if len(caught) < len(req_ids):
            self._count(deferred=len(req_ids) - len(caught))
        return caught

    def _forget_finished(self) -> None:
        known = len(self.missed_from) + (len(self.stale.last_start) if self.stale else 0)
        if known > 4 * max(1, self.max_batch_size):
            alive = set(self.runner.requests)
            for req_id in [r for r in self.missed_from if r not in alive]:
                del self.missed_from[req_id]
                self.missed_hidden.pop(req_id, None)
            if self.stale is not None:
                self.stale.forget(alive)


def _ints(values) -> list[int]:
    return values.tolist() if isinstance(values, np.ndarray) else [int(v) for v in values]


class CatchUpDraftModelProposer(AcceptanceStopDrafter, CatchUp, DraftModelProposer):
    """vLLM's ``draft_model`` drafter, free at k = 0, with the acceptance stop where asked."""


class CatchUpEagleProposer(CatchUp, EagleProposer):
    """vLLM's ``eagle3`` (EAGLE) drafter, free at k = 0: it keeps the skipped steps' hidden
    states of the target's tapped layers until it catches up."""
