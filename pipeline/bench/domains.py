"""The online benchmark across prompt domains (the Spec-Bench way): one bench run per domain
(code, prose, math), then per domain and temperature, and pooled over the domains ("all"):
every policy's measured speedup over `ar`, its ratio over the best fixed draft length *of that
domain and temperature in the same run* (the figure the dynamic-length literature reports),
its modelled share of the oracle's bound, and whether its greedy text equals `ar`'s (lossless
at T = 0)."""

from __future__ import annotations

from collections.abc import Iterator

import pandas as pd

from pipeline.bench.scoring import OnlineBenchResult

ALL = "all"
FIXED_PREFIX = "fixed("
# The measured and modelled totals a row of the table is made of: pooling (over domains, or over
# repeated runs in pipeline.bench.runs) sums these and derives every ratio again.
SUMS = [
    "tokens",
    "seconds",
    "ar_tokens",
    "ar_seconds",
    "policy_ms",
    "ar_ms",
    "bound_ms",
    "steps",
    "accepted",
    "draft_ms",
    "draft_forwards",
]
SUMMED = {
    **{c: (lambda x: x.sum(min_count=len(x))) for c in SUMS},
    "greedy_equal": lambda v: _all_or_none(v),
}


def domain_table(results: dict[str, OnlineBenchResult]) -> pd.DataFrame:
    """A row per (domain, temperature, policy), the pooled ``all`` domain included: tokens,
    seconds, tok/s, speedup over `ar`, ratio over the best fixed K, modelled share of the bound,
    greedy text equal to `ar`'s (T = 0 only; None otherwise)."""
    rows = []
    for domain, result in results.items():
        for r in result.rows:
            ar = result.row("ar", r.temperature)
            rows.append(
                {
                    "domain": domain,
                    "temperature": r.temperature,
                    "policy": r.label,
                    "tokens": r.tokens,
                    "seconds": r.seconds,
                    "ar_tokens": ar.tokens,
                    "ar_seconds": ar.seconds,
                    "policy_ms": r.policy_ms,
                    "ar_ms": r.ar_ms,
                    "bound_ms": _bound_ms(r),
                    "steps": sum(len(s) for s in r.steps),
                    "accepted": r.mean_accepted * sum(len(s) for s in r.steps),
                    "draft_ms": sum(x.t_draft_ms for run in r.steps for x in run),
                    "draft_forwards": sum(x.draft_forwards for run in r.steps for x in run),
                    "greedy_equal": (
                        _same_text(r.outputs, ar.outputs)
                        if r.temperature == 0 and r.outputs
                        else None
                    ),
                }
            )
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    if len(results) > 1:  # pooled: total tokens over total time, per policy and temperature
        pooled = df.groupby(["temperature", "policy"], as_index=False, sort=False).agg(SUMMED)
        df = pd.concat([df, pooled.assign(domain=ALL)], ignore_index=True)
    return with_ratios(df)


def with_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` (SUMS per domain, temperature and policy) with its ratios: speedup, modelled
    share of the bound, and the ratio over the best fixed K of the same domain and
    temperature."""
    df = df.copy()
    df["mean_accepted"] = df["accepted"] / df["steps"]  # per step, pooled over the steps
    # Drafting's cost per draft forward (the policy's own work included), measured.
    df["draft_ms_per_forward"] = df["draft_ms"] / df["draft_forwards"].where(
        df["draft_forwards"] > 0
    )
    df["tok_s"] = df["tokens"] / df["seconds"]
    df["speedup"] = df["tok_s"] / (df["ar_tokens"] / df["ar_seconds"])
    df["modelled_speedup"] = df["ar_ms"] / df["policy_ms"]
    df["of_bound"] = df["modelled_speedup"] / (df["ar_ms"] / df["bound_ms"])
    best = (
        df[df["policy"].str.startswith(FIXED_PREFIX)]
        .sort_values("speedup", ascending=False)
        .groupby(["domain", "temperature"], as_index=False)
        .first()[["domain", "temperature", "policy", "speedup"]]
        .rename(columns={"policy": "best_fixed", "speedup": "best_fixed_speedup"})
    )
    df = df.merge(best, on=["domain", "temperature"], how="left")
    df["over_best_fixed"] = df["speedup"] / df["best_fixed_speedup"]
    return df


def _bound_ms(row) -> float | None:
    """The bound's cost of the policy's own text (the AR price over the bound's speedup)."""
    if row.bound is None or row.ar_ms is None:
        return None
    return row.ar_ms / row.bound.speedup


def _same_text(outputs: list[list[int]], reference: list[list[int]]) -> bool:
    """Every prompt's text equals the reference's up to the shorter one (a last step may
    overshoot max_new_tokens by its accepted tokens)."""
    return len(outputs) == len(reference) and all(
        a[: min(len(a), len(b))] == b[: min(len(a), len(b))]
        for a, b in zip(outputs, reference, strict=True)
    )


def _ms(value) -> str:
    return "-" if value is None or pd.isna(value) else f"{value:.2f}"


def _all_or_none(values: pd.Series):
    values = values.dropna()
    return None if values.empty else bool(values.all())


def by_cell(df: pd.DataFrame, best_is: str, none: str) -> Iterator[tuple[str, pd.DataFrame]]:
    """Each (domain, temperature)'s rows under a heading naming its best fixed K."""
    for (domain, temp), group in df.groupby(["domain", "temperature"], sort=False):
        best = group["best_fixed"].iloc[0]
        yield f"\n{domain}, T={temp:g} ({best_is}: {none if pd.isna(best) else best})", group


def greedy_mark(equal) -> str:
    """The greedy-text check as printed: yes, NO, or - (T > 0: no check)."""
    return "-" if equal is None or pd.isna(equal) else ("yes" if equal else "NO")


def format_domain_summary(df: pd.DataFrame) -> str:
    """Per domain and temperature: each policy's speedup, its ratio over that domain's best
    fixed K in this run, its modelled share of the bound and the greedy-text check."""
    lines = [
        "per domain (speedup: measured over `ar`; x best fixed: over the best fixed K of "
        "that domain and temperature in this run; of bound: modelled / modelled; "
        "= greedy: the T=0 text equals `ar`'s)"
    ]
    for heading, group in by_cell(df, "best fixed", "no fixed K in this run"):
        lines.append(heading)
        lines.append(
            f"  {'policy':40s} {'tok/s':>7} {'speedup':>8} {'x best fixed':>13} "
            f"{'of bound':>9} {'accepted':>9} {'= greedy':>9} "
            f"{'ms/draft fwd':>13}"
        )
        for r in group.itertuples():
            of_bound = "-" if pd.isna(r.of_bound) else f"{100 * r.of_bound:.0f}%"
            equal = greedy_mark(r.greedy_equal)
            over = "-" if pd.isna(r.over_best_fixed) else f"{r.over_best_fixed:.2f}x"
            lines.append(
                f"  {r.policy:40s} {r.tok_s:7.1f} {r.speedup:7.2f}x "
                f"{over:>13} {of_bound:>9} {r.mean_accepted:9.2f} "
                f"{equal:>9} {_ms(r.draft_ms_per_forward):>13}"
            )
    return "\n".join(lines)


def domain_metrics(df: pd.DataFrame) -> dict[str, float]:
    """MLflow metrics: speedup and ratio over the best fixed K per domain, temperature and
    policy."""
    out = {}
    for r in df.itertuples():
        key = f"{r.domain}_T{r.temperature:g}_{r.policy}".replace("(", "_").replace(")", "")
        key = "".join(c if c.isalnum() or c in "_-." else "_" for c in key)
        out[f"{key}_speedup"] = float(r.speedup)
        if not pd.isna(r.over_best_fixed):  # a run without fixed K has no ratio
            out[f"{key}_over_best_fixed"] = float(r.over_best_fixed)
    return out
