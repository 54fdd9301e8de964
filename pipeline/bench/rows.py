"""A row of the online benchmark: one policy's decoding at one temperature, measured and (once
scored) priced. Below both the bench that fills the rows (pipeline.bench.online) and the
scoring that reads them (pipeline.bench.scoring), so neither imports the other."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.bench.online_bound import BoundResult
from pipeline.decode.types import StepRecord

TREE_POLICIES = frozenset({"tree", "ecospec", "ecospec-global"})


@dataclass
class BenchRow:
    label: str
    temperature: float
    tokens: int
    seconds: float  # decoding steps only: the prompt's prefill is left out
    mean_accepted: float
    mean_unique_experts: float
    verify_share: float
    tree: bool = False
    outputs: list[list[int]] = field(default_factory=list)
    steps: list[list[StepRecord]] = field(default_factory=list)
    policy_ms: float | None = None  # the cost model's price of every step
    ar_ms: float | None = None  # the AR price of the same text
    bound: BoundResult | None = None  # the oracle on the same text (chain policies)
    # Per side, the steps' measured ms and their price in the row's decoding mode: draft
    # measured, draft priced, target measured, target priced (pipeline.bench.price_drift).
    side_ms: tuple[float, float, float, float] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def modelled_speedup(self) -> float | None:
        return None if self.policy_ms is None else self.ar_ms / self.policy_ms

    def record(self, **extra: Any) -> dict[str, Any]:
        """The row's figures as JSON-ready values (what a bench writes as each row is done);
        ``extra`` adds context, e.g. the prompt domain."""

        def num(x: float | None) -> float | None:
            return None if x is None or not math.isfinite(x) else float(x)

        return {
            **extra,
            "policy": self.label,
            "temperature": self.temperature,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tok_s": num(self.tokens_per_s),
            "mean_accepted": num(self.mean_accepted),
            "mean_unique_experts": num(self.mean_unique_experts),
            "verify_share": num(self.verify_share),
            "steps": sum(len(s) for s in self.steps),
            "policy_ms": num(self.policy_ms),
            "ar_ms": num(self.ar_ms),
            "modelled_speedup": num(self.modelled_speedup),
            "bound": None if self.bound is None else num(self.bound.speedup),
        }


def label(name: str, knobs: dict) -> str:
    """``fixed(k=2)``: a policy and its knobs as the bench tables name them."""
    return name + ("(" + ",".join(f"{k}={v}" for k, v in knobs.items()) + ")" if knobs else "")


def make_row(
    name: str | Callable,
    knobs: dict,
    row_label: str | None,
    temperature: float,
    seconds: float,
    outputs: list[list[int]],
    steps: list[list[StepRecord]],
) -> BenchRow:
    """The row of a policy's decoding: its totals and per-step means."""
    flat = [s for run in steps for s in run]
    named = name if isinstance(name, str) else getattr(name, "__name__", "policy")
    return BenchRow(
        label=row_label or label(named, knobs),
        temperature=temperature,
        tokens=sum(len(o) for o in outputs),
        seconds=seconds,
        mean_accepted=float(np.mean([s.accepted for s in flat])),
        mean_unique_experts=float(np.mean([s.u_bar for s in flat])),
        verify_share=sum(s.t_verify_ms for s in flat) / 1e3 / seconds,
        tree=not callable(name) and name in TREE_POLICIES,
        outputs=outputs,
        steps=steps,
    )
