"""Simulated decode steps for the step planner's tests (no vLLM)."""

from __future__ import annotations

import numpy as np

from pipeline.vllm_spec.online_step_cost import features
from pipeline.vllm_spec.planner_config import PlannerConfig
from pipeline.vllm_spec.priors import Priors
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


# A replica's true step cost (online_step_cost.TERMS: c0, c_pos, c_union, c_row, d0, d_row,
# s0, s_row), ms.
TRUTH = np.array([7.0, 0.085, 0.0, 0.1, 0.9, 0.05, 0.25, 0.1])


def with_prompts(
    config: PlannerConfig,
    prompt: int,
    steps: int = 3000,
    rate: float = 0.55,
    max_tokens: int = 128,
    draft_prefill: float = 0.02,
    seed: int = 2,
) -> tuple[float, float, StepPlanner]:
    """16 rows at acceptance ``rate`` (0.55: on steady decode steps k = 1 makes 4% more
    tokens per ms than k = 0), each a request of ``prompt`` prompt tokens making
    ``max_tokens``; an ended request's row takes a new one the next step (its prompt costs the
    target 0.005 ms a token). The draft processes every token it has not seen, prompts
    included, at ``draft_prefill`` ms a token: in the step a prompt arrives if that step
    drafts, else in the next drafted step (a catch-up), as the plugin's drafter does. Steps
    with an arrival are not fitted; the planner is told what the scheduler tells it. Returns
    the run's ms per token, the share of steps drafted and the planner."""
    rng = np.random.default_rng(seed)
    planner = StepPlanner(4, config, Priors(rates={"greedy": rate}))
    planner.cost.anchor(TRUTH)
    serial = iter(range(10**9))
    ids = [f"r{next(serial)}" for _ in range(16)]
    made = [i * max_tokens // 16 for i in range(16)]  # staggered: arrivals spread out
    backlog, new = [0] * 16, [False] * 16
    for request in ids:
        planner.prefill.set_shape(request, prompt, max_tokens)
    last, total_ms, total, drafted = 0, 0.0, 0, 0
    for step in range(steps):
        k = planner.choose(ids)
        positions = 16 * (1 + last)  # every row verifies the last step's drafts
        ms = float(features(positions, k, 16) @ TRUTH) + 0.005 * prompt * sum(new)
        behind = sum(b for b, n in zip(backlog, new, strict=True) if not n)
        for i in range(16):
            backlog[i] += prompt if new[i] else 1 + last
        if k:
            ms += draft_prefill * (sum(backlog) - 16 * (1 + last))  # the steady part is T's
            backlog = [0] * 16
        tokens = 0
        for i, request in enumerate(ids):
            accepted = int(np.argmin(np.append(rng.random(last) < rate, False)))
            if last:
                planner.observe_chain(request, last, accepted)
            made[i] += accepted + 1
            tokens += accepted + 1
        decode = not any(new)
        switch = ("on" if k and behind else None) if k else ("off" if last else None)
        planner.observe_step(
            positions, k, 16, ms, tokens, decode, switch if decode else None, behind if k else 0
        )
        new = [False] * 16
        for i, request in enumerate(ids):
            if made[i] >= max_tokens:
                planner.prefill.ended(request, made[i])
                # its backlog ends with it: the draft never catches up a request that ended
                ids[i], made[i], new[i], backlog[i] = f"r{next(serial)}", 0, True, 0
                planner.prefill.set_shape(ids[i], prompt, max_tokens)
        if step % 64 == 0:
            planner.forget_requests(set(ids))
        total_ms, total, last, drafted = total_ms + ms, total + tokens, k, drafted + (k > 0)
    return total_ms / total, drafted / steps, planner
