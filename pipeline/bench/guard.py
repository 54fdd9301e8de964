"""What every bench does so that one policy cannot sink a run (jobs.bench_online, bench_tree,
bench_batch).

* Before decoding, ``require_priced``: the cost model prices every step each policy may take.
  A step verifies at most ``step_work().verified`` = m positions (its chain length + 1, or a
  tree's budget + 1, from its knobs), and T_T(m, ...) exists only for calibrated m; a policy
  the model cannot price fails the run at once, naming the policy, its m and the model's
  largest, not after every policy has decoded.
* ``ResultLog``: each policy's result appended to a JSON-lines file the moment it is done.
* A policy that fails while it is scored (or decoded, where a bench decodes policy by policy)
  is recorded (``PolicyFailure``) and the others go on; at the end ``BenchFailures`` names
  every failed one (a ValueError: the job ends with that line and a non-zero exit).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.bench.rows import label
from pipeline.cost.model import CostModel
from pipeline.decode.policies.artifacts import PolicyArtifacts
from pipeline.decode.policies.registry import make_policy


def max_m(name: str, knobs: dict, artifacts: PolicyArtifacts | None) -> tuple[int, str]:
    """The most positions one step of the policy verifies (the m the cost model prices the
    step at), and the knobs that set it."""
    work = make_policy(name, artifacts, **knobs).step_work()
    return work.verified, work.why_verified or work.why


def require_priced(
    bench: str,
    cost: CostModel,
    specs: Iterable[tuple[str, dict]],
    artifacts: PolicyArtifacts | None,
) -> None:
    """A ValueError naming every policy of ``specs`` (name, knobs) one of whose steps the cost
    model could not price: its largest m and the model's."""
    problems, need = [], 0
    for name, knobs in specs:
        m, why = max_m(name, knobs, artifacts)
        lacking = cost.missing_m(range(1, m + 1))
        if lacking:
            gap = (
                f" and lacks m = {', '.join(map(str, lacking))}" if lacking[0] < cost.max_m else ""
            )
            problems.append(
                f"{label(name, knobs)} may verify m = {m} positions in a step ({why}), but the "
                f"cost model prices m up to {cost.max_m}{gap}"
            )
            need = max(need, m)
    if problems:
        raise ValueError(
            f"{bench}: before decoding, not every step can be priced with "
            f"{cost.source or 'the cost model'}: " + "; ".join(problems) + ". Lower those "
            f"knobs, or calibrate K up to {need - 1} (python -m jobs.calibrate --ks 0-{need - 1})"
        )


@dataclass(frozen=True)
class PolicyFailure:
    policy: str
    where: str  # what it was doing: "T=0 scoring", "batch 8, repeat 1"
    error: str

    @classmethod
    def of(cls, policy: str, where: str, exc: BaseException) -> PolicyFailure:
        return cls(policy, where, f"{type(exc).__name__}: {exc}")

    def line(self) -> str:
        return f"{self.policy} ({self.where}) FAILED: {self.error}"

    def record(self, **extra: Any) -> dict[str, Any]:
        return {**extra, "policy": self.policy, "where": self.where, "failed": self.error}


class BenchFailures(ValueError):
    """Policies that failed while the others' results were reported and written."""

    def __init__(self, bench: str, failures: list[PolicyFailure]) -> None:
        self.failures = failures
        many = "policy" if len(failures) == 1 else "policies"
        super().__init__(
            f"{bench}: {len(failures)} {many} failed (every other result is reported and "
            "written): " + "; ".join(f.line() for f in failures)
        )


def raise_failures(bench: str, failures: list[PolicyFailure]) -> None:
    if failures:
        raise BenchFailures(bench, failures)


def failure_lines(failures: list[PolicyFailure]) -> list[str]:
    """The lines a bench's table ends with when policies failed."""
    return ["", *[f.line() for f in failures]] if failures else []


class ResultLog:
    """Results as JSON lines, each appended (and flushed) as it is done: a later failure, or
    a killed run, keeps every earlier one. ``path`` None: nothing is written."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record, default=str) + "\n")
