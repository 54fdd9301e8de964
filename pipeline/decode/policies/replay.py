"""The oracle's own schedule as a policy: a greedy chain of k*(i) tokens at state i, or a plain
step where k*(i) = 0 (the oracle-replay check of pipeline.bench.online_bound). Not in the
registry: it needs a k* per state of one text, which no request can give."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.decode.policies.base import Policy, draft_chain
from pipeline.decode.step_limits import StepWork
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

    def step_work(self) -> StepWork:
        """Plain steps feed the draft nothing, so a drafting step first catches up on every
        token since the draft was last fed (at state j; j = -1: only the prompt's prefill):
        i - j tokens at state i, then k*(i) - 1 extends. j is at worst the earliest drafting
        state whose chain can land on the run of plain states that leads to i."""
        k = [int(x) for x in self.k_star]
        drafted = [i for i, x in enumerate(k) if x > 0]
        if not drafted:
            return StepWork(0, 0, 1, "k* 0")
        tokens = 0
        for i in drafted:
            start = i  # first state of the run of plain states ending at i - 1
            while start > 0 and k[start - 1] == 0:
                start -= 1
            feeders = [j for j in drafted if j < start and j + k[j] + 1 >= start]
            if start > 0 and not feeders:
                continue  # no step lands on the run: state i is never reached
            last_fed = -1 if start == 0 else min(feeders)
            tokens = max(tokens, i - last_fed + k[i] - 1)
        top = max(k)
        return StepWork(top, tokens, top + 1, f"k* up to {top}")
