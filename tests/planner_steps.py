"""Simulated decode steps for the step planner's tests (no vLLM)."""

from __future__ import annotations

import numpy as np

from pipeline.vllm_spec.step_planner import StepPlanner


def judge_chains(
    planner: StepPlanner, ids: list[str], drafted: int, rate: float, rng: np.random.Generator
) -> int:
    """Each row's chain of ``drafted`` drafts judged, every draft accepted at ``rate`` up to
    the first rejection, and told to the planner; returns the tokens the step made."""
    tokens = 0
    for request in ids:
        accepted = int(np.argmin(np.append(rng.random(drafted) < rate, False)))
        if drafted:
            planner.observe_chain(request, drafted, accepted)
        tokens += accepted + 1
    return tokens
