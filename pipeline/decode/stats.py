"""Speculation statistics of one generation from the engine's step records (what a response
reports)."""

from __future__ import annotations

import numpy as np

from pipeline.decode.types import StepRecord


def speculation_stats(policy: str, knobs: dict, steps: list[StepRecord]) -> dict:
    """Per-response statistics: means per step, total draft and verification times."""

    def mean(values) -> float:
        return round(float(np.mean(values)), 4) if steps else 0.0

    return {
        "policy": policy,
        "knobs": knobs,
        "steps": len(steps),
        "drafted_per_step": mean([s.drafted for s in steps]),
        "accepted_per_step": mean([s.accepted for s in steps]),
        "tokens_per_step": mean([s.new_tokens for s in steps]),
        "unique_experts_per_step": mean([s.u_bar for s in steps]),
        "draft_ms": round(sum(s.t_draft_ms for s in steps), 3),
        "verify_ms": round(sum(s.t_verify_ms for s in steps), 3),
    }
