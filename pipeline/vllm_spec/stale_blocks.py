"""Which KV blocks hold a stale draft KV, for the catch-up drafter
(pipeline.vllm_spec.catch_up_draft) under vLLM's prefix caching.

With prefix caching vLLM keeps a request's full blocks for later requests that share the
prefix, the draft's KV with the target's (one block table for both). A block written in steps
whose draft forward was skipped holds the target's KV but not yet the draft's; if its request
finishes before catching up (or a later request hits the block before it does), the cached
block would hand that later request a stale draft KV: its proposals would differ from a draft
that never skipped (still verified, but accepted less). So the drafter records such blocks
(by physical block id, cleared when a forward writes them) and, when a request starts on a
cached prefix or resumes after preemption, catches the draft up from the prefix's first stale
block.
"""

from __future__ import annotations

import numpy as np


class StaleBlocks:
    """Physical KV blocks with target KV but no draft KV for some of their positions."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.stale: set[int] = set()
        # request id -> first position of its last step (a start not past it: resumed)
        self.last_start: dict[str, int] = {}
        # request id -> where its own writes begin, for a row left on a stale cached prefix
        self.left_stale: dict[str, int] = {}

    def _ids(self, table_row: np.ndarray, lo: int, hi: int) -> list[int]:
        """The block ids holding positions [lo, hi) of a row."""
        if hi <= lo:
            return []
        return [int(b) for b in table_row[lo // self.block_size : (hi - 1) // self.block_size + 1]]

    def skipped(self, table_row: np.ndarray, start: int, end: int) -> None:
        """A step skipped the draft's forward over positions [start, end)."""
        self.stale.update(self._ids(table_row, start, end))

    def written(self, req_id: str, table_row: np.ndarray, end: int) -> None:
        """A forward left the row's draft KV complete up to ``end`` (from where its own
        writes begin, for a row left on a stale prefix)."""
        self.stale.difference_update(self._ids(table_row, self.left_stale.get(req_id, 0), end))

    def leave(self, req_id: str, start: int) -> None:
        """The row drafts on over its stale cached prefix (before ``start``), not caught up."""
        self.left_stale[req_id] = start

    def first_stale(self, req_id: str, table_row: np.ndarray, start: int) -> int | None:
        """For a row that starts on positions it did not compute itself (first seen with a
        cached prefix, or back behind its last start: resumed after preemption), the first
        position of the first stale block before ``start``; else None. Safe to call twice in
        a step (the same start is neither new nor behind)."""
        before = self.last_start.get(req_id)
        self.last_start[req_id] = start
        if start == 0 or (before is not None and start >= before):
            return None
        self.left_stale.pop(req_id, None)
        for j, block in enumerate(self._ids(table_row, 0, start)):
            if block in self.stale:
                return j * self.block_size
        return None

    def forget(self, alive: set[str]) -> None:
        for req_id in [r for r in self.last_start if r not in alive]:
            del self.last_start[req_id]
            self.left_stale.pop(req_id, None)
