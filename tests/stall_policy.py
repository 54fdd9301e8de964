"""A policy whose proposal never returns (a stuck decode loop), registered when this module is
imported: the endpoint's `policy_modules=["tests.stall_policy"]` loads it on the replica, and
the health test sees Serve replace the replica whose decoding thread it pins."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pipeline.decode.policies.base import Policy
from pipeline.decode.policies.labels import EXPERIMENTAL
from pipeline.decode.policies.registry import register_policy
from pipeline.decode.step_limits import StepWork

STALL = threading.Event()  # never set: the wait ends only with the process


@dataclass
class StallPolicy(Policy):
    name = "stall"
    label = EXPERIMENTAL
    summary = "test only: a proposal that never returns"

    def step_work(self) -> StepWork:
        return StepWork(draft_forwards=0, draft_tokens=0, verified=1, why="nothing")

    def propose(self, drafter, committed):
        STALL.wait()
        raise AssertionError("unreachable")


register_policy(StallPolicy)
