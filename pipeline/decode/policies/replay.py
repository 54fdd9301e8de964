"""The oracle's own schedule as a policy: a greedy chain of k*(i) tokens at state i, or a plain
step where k*(i) = 0 (the oracle-replay check of pipeline.bench.online_bound). Not in the
registry: it needs a k* per state of one text, which no request can give."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.decode.policies.base import Policy, draft_chain
from pipeline.decode.types import Candidates


@dataclass
class ReplayPolicy(Policy):
    """Drafts a greedy chain of k*(i) tokens at state i = committed length - prompt length;
    k*(i) = 0 is a plain step that runs no draft forward (as the oracle prices it)."""

    k_star: np.ndarray
    prompt_len: int
    name = "oracle-replay"

    def propose(self, drafter, committed: list[int]) -> Candidates:
        i = len(committed) - self.prompt_len
        if i >= len(self.k_star) or int(self.k_star[i]) == 0:
            return Candidates()
        return draft_chain(drafter, committed, int(self.k_star[i]))
