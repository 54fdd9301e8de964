"""The online benchmark repeated (jobs.bench_online --runs N), pooled over its runs.

One run's ratio over the best fixed K is noisy twice over: each row's time moves by several
percent from run to run on a shared CPU (and at T > 0 with the seed's draws), and the best
fixed K of one run is the luckiest of several noisy rows, so it is biased upward. Pooled over
the runs (each policy's tokens and seconds summed, the best fixed K picked on those sums) the
noise averages out; each run's own ratio, lowest to highest, is printed beside it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pandas as pd

from pipeline.bench.domains import (
    SUMMED,
    by_cell,
    domain_metrics,
    domain_table,
    format_domain_summary,
    greedy_mark,
    with_ratios,
)
from pipeline.bench.guard import PolicyFailure
from pipeline.bench.rows import BenchRow
from pipeline.bench.scoring import OnlineBenchResult

KEYS = ["domain", "temperature", "policy"]


def runs_table(tables: list[pd.DataFrame]) -> pd.DataFrame:
    """domain_table's columns pooled over ``tables`` (one per run), with ``runs`` (how many
    runs the row was scored in) and ``run_min`` / ``run_max``: the lowest and highest of the
    runs' own ratios over their best fixed K."""
    tables = [t for t in tables if not t.empty]
    if not tables:
        return pd.DataFrame()
    stacked = pd.concat([t.assign(run=i) for i, t in enumerate(tables)], ignore_index=True)
    grouped = stacked.groupby(KEYS, as_index=False, sort=False)
    spread = grouped.agg(
        runs=("run", "nunique"),
        run_min=("over_best_fixed", "min"),
        run_max=("over_best_fixed", "max"),
    )
    return with_ratios(grouped.agg(SUMMED)).merge(spread, on=KEYS, how="left")


def format_runs_summary(df: pd.DataFrame) -> str:
    """Per domain and temperature, pooled over the runs: each policy's speedup over `ar`, its
    ratio over the best fixed K of the pooled figures, the runs' own ratios (lowest-highest),
    its modelled speedup (the cost model's price of its own steps: no timing noise) and the
    greedy-text check over every run."""
    runs = int(df["runs"].max()) if not df.empty else 0
    lines = [
        f"over {runs} runs (each policy's tokens and seconds summed over the runs; x best "
        "fixed: over the best fixed K of those sums; per run: each run's own ratio over its "
        "own best fixed K, lowest-highest; modelled: the cost model's price of the policy's "
        "own steps over the AR price of its text)"
    ]
    for heading, group in by_cell(df, "best fixed over the runs", "no fixed K in these runs"):
        lines.append(heading)
        lines.append(
            f"  {'policy':40s} {'tok/s':>7} {'speedup':>8} {'x best fixed':>13} "
            f"{'per run':>12} {'modelled':>9} {'accepted':>9} {'= greedy':>9}"
        )
        for r in group.itertuples():
            over = "-" if pd.isna(r.over_best_fixed) else f"{r.over_best_fixed:.2f}x"
            per_run = "-" if pd.isna(r.run_min) else f"{r.run_min:.2f}-{r.run_max:.2f}"
            if r.runs < runs:
                per_run += f" ({r.runs} runs)"
            modelled = "-" if pd.isna(r.modelled_speedup) else f"{r.modelled_speedup:.2f}x"
            lines.append(
                f"  {r.policy:40s} {r.tok_s:7.1f} {r.speedup:7.2f}x {over:>13} {per_run:>12} "
                f"{modelled:>9} {r.mean_accepted:9.2f} {greedy_mark(r.greedy_equal):>9}"
            )
    return "\n".join(lines)


@dataclass
class RepeatedBench:
    """Each run's results by source (a domain, or the one --source), and their tables."""

    runs: list[dict[str, OnlineBenchResult]] = field(default_factory=list)
    tables: list[pd.DataFrame] = field(default_factory=list)

    def pooled(self) -> pd.DataFrame | None:
        """Pooled over the runs (runs_table); None after a single run."""
        return runs_table(self.tables) if len(self.runs) > 1 else None

    def run_metrics(self, run: int, by_domain: bool) -> dict[str, float]:
        """One run's MLflow metrics: per domain and pooled over them (``by_domain``), and each
        source's own bench metrics (prefixed with its name when ``by_domain``)."""
        results = self.runs[run]
        metrics = domain_metrics(self.tables[run]) if by_domain else {}
        for name, result in results.items():
            prefix = f"{name}_" if by_domain else ""
            metrics.update({f"{prefix}{k}": v for k, v in result.metrics().items()})
        return metrics

    def failures(self, by_domain: bool) -> list[PolicyFailure]:
        """Every run's failed rows, each saying where (run, domain) it failed."""
        out = []
        for run, results in enumerate(self.runs):
            for name, result in results.items():
                where = [f"run {run + 1}"] if len(self.runs) > 1 else []
                where += [name] if by_domain else []
                out += [replace(f, where=", ".join([*where, f.where])) for f in result.failures]
        return out

    def rows(self) -> list[BenchRow]:
        return [row for results in self.runs for result in results.values() for row in result.rows]


def repeat_bench(
    bench: Callable[[str, int], OnlineBenchResult],
    sources: list[str],
    runs: int,
    show: Callable[[str], None],
    by_domain: bool,
) -> RepeatedBench:
    """``bench(source, run)`` for every source, ``runs`` times over; after each run its summary
    by domain (``by_domain``), after the last the summary pooled over the runs (if several)."""
    out = RepeatedBench()
    for run in range(runs):
        if runs > 1:
            show(f"\n##### run {run + 1}/{runs} #####")
        results = {name: bench(name, run) for name in sources}
        out.runs.append(results)
        out.tables.append(domain_table(results))
        if by_domain:
            show("\n" + format_domain_summary(out.tables[-1]))
    pooled = out.pooled()
    if pooled is not None:
        show("\n" + format_runs_summary(pooled))
    return out
