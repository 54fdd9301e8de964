"""Scoring the online benchmark like for like, and its table and metric names.

Two fractions, never mixed:

* measured / measured: a policy's measured speedup over `ar` (decoding time, prefill left
  out) divided by the oracle replay's measured speedup (its k* decoded online, T = 0 only);
* modelled / modelled: a policy's modelled speedup (its own steps priced with the cost model,
  against the AR price of its own text) divided by the oracle's bound on that same text with
  the same cost model. Chain policies only: a tree verifies several candidates per depth, an
  action the chain bound does not have, so trees get no fraction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pipeline.bench.guard import PolicyFailure, failure_lines
from pipeline.bench.rows import BenchRow
from pipeline.cost.model import CostModel

REPLAY_LABEL = "oracle-replay (k*)"


def _metric_key(label: str, temperature: float) -> str:
    """An MLflow metric name (alphanumerics, _ - . only) for a row label."""
    key = re.sub(r"[^0-9A-Za-z.\-]+", "_", f"{label}_T{temperature:g}")
    return key.strip("_")


def cost_mape_pct(cost: CostModel) -> float | None:
    """The calibration's out-of-sample MAPE pooled over draft lengths, weighted by rounds."""
    per_m = cost.meta.get("fit", {}).get("per_m", {})
    if not per_m:
        return None
    n = sum(f["n"] for f in per_m.values())
    return sum(f["n"] * f["oos_mape_pct"] for f in per_m.values()) / n


@dataclass(frozen=True)
class OnlineBenchResult:
    rows: list[BenchRow]
    replay_lines: list[str]  # per replayed prompt at T=0: steps, agreement, measured vs model
    n_prompts: int
    max_new_tokens: int
    device: str
    lam: float  # ms/token, from the oracle's policy.json
    lmax: int
    cost: CostModel
    failures: list[PolicyFailure] = field(default_factory=list)  # rows left out: why

    def row(self, label: str, temperature: float) -> BenchRow | None:
        return next(
            (r for r in self.rows if r.label == label and r.temperature == temperature), None
        )

    def speedup(self, row: BenchRow) -> float:
        """Measured: tokens/s over `ar`'s at the same temperature (prefill left out of both)."""
        return row.tokens_per_s / self.row("ar", row.temperature).tokens_per_s

    def of_replay(self, row: BenchRow) -> float | None:
        """Measured / measured: the share of the oracle replay's measured speedup (T = 0)."""
        replay = self.row(REPLAY_LABEL, row.temperature)
        return None if replay is None else self.speedup(row) / self.speedup(replay)

    @staticmethod
    def of_bound(row: BenchRow) -> float | None:
        """Modelled / modelled: the modelled speedup over the bound on the same text."""
        if row.bound is None or row.modelled_speedup is None:
            return None
        return row.modelled_speedup / row.bound.speedup

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for r in self.rows:
            key = _metric_key(r.label, r.temperature)
            values = {
                "tok_s": r.tokens_per_s,
                "speedup": self.speedup(r),
                "of_replay": self.of_replay(r),
                "modelled_speedup": r.modelled_speedup,
                "bound": r.bound.speedup if r.bound else None,
                "of_bound": self.of_bound(r),
            }
            out.update({f"{key}_{k}": v for k, v in values.items() if v is not None})
        return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def format_online_bench(result: OnlineBenchResult) -> str:
    """One row per policy and temperature: measured and modelled speedups and fractions."""
    head = (
        f"{result.n_prompts} prompts x {result.max_new_tokens} tokens on {result.device}; "
        f"lambda {result.lam:.3f} ms/token; bounds at Lmax {result.lmax} with k = 0"
    )
    lines = ["", head, ""]
    lines.append(
        f"{'policy':<40}{'T':>3}{'tok/s':>8}{'speedup':>9}{'of replay':>10}"
        f"{'modelled':>10}{'bound':>8}{'of bound':>9}{'accepted':>9}{'U/verify':>9}"
        f"{'T_verify':>9}"
    )
    for r in result.rows:
        bound = r.bound.speedup if r.bound else None
        tree = r.tree and "tree"
        lines.append(
            f"{r.label:<40}{r.temperature:>3g}{r.tokens_per_s:>8.1f}"
            f"{_x(result.speedup(r)):>9}{_pct(result.of_replay(r)):>10}"
            f"{_x(r.modelled_speedup):>10}{tree or _x(bound):>8}"
            f"{tree or _pct(result.of_bound(r)):>9}{r.mean_accepted:>9.2f}"
            f"{r.mean_unique_experts:>9.2f}{r.verify_share:>8.0%}"
        )
    lines += [
        "",
        "speedup / of replay: measured (decoding time, prefill left out) over `ar`, and over the",
        "  oracle replay's measured speedup (T=0). modelled / bound / of bound: the cost model's",
        "  price of the policy's own steps vs the AR price of its own text, the oracle's bound on",
        "  that same text (greedy acceptance at T=0, speculative sampling at T>0, k = 0 allowed),",
        "  and their ratio. Trees are not scored against the chain bound.",
    ]
    lines += [f"oracle replay, {line}" for line in result.replay_lines]
    mape = cost_mape_pct(result.cost)
    if mape is not None:
        lines.append(
            f"cost model error: out-of-sample MAPE {mape:.1f}% over the calibration's rounds"
        )
    lines += failure_lines(result.failures)
    return "\n".join(lines)
