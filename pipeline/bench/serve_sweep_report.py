"""The serving sweep's report (jobs.bench_serve_sweep): the table it prints and the files it
writes, from a SweepResult (pipeline.bench.serve_sweep)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from pipeline.bench.serve_sweep import SweepResult
from pipeline.bench.serve_sweep_compare import comparisons, format_comparisons

HEADER = (
    f"{'source':<10}{'mode':<9}{'clients':>8}  {'policy':<18}{'requests':>9}{'errors':>7}"
    f"{'req/s':>8}{'out tok/s':>10}{'p50 ms':>8}{'p99 ms':>8}{'TTFT p50':>9}{'TTFT p99':>9}"
)


def format_row(r: dict[str, Any]) -> str:
    return (
        f"{r['source']:<10}{r['mode']:<9}{r['concurrency']:>8}  {r['policy']:<18}{r['requests']:>9}"
        f"{r['errors']:>7}{r['req_s']:>8.2f}{r['out_tok_s']:>10.1f}{r['p50_ms']:>8.0f}"
        f"{r['p99_ms']:>8.0f}{r['ttft_p50_ms']:>9.0f}{r['ttft_p99_ms']:>9.0f}"
    )


def format_sweep(result: SweepResult, sources: str) -> str:
    """The table of every cell, batched / single per (source, concurrency, policy), and the vLLM
    app against the endpoint."""
    s = result.settings
    lines = [
        "",
        f"{result.prompts} prompts of each of {sources} x {s.max_tokens} tokens, "
        f"T={s.temperature:g}, streamed, batched max_batch={s.max_batch}; {result.url}",
        "",
        HEADER,
    ]
    lines += [format_row(r) for r in result.rows()]
    ratios = result.ratios()
    if ratios:
        lines += [
            "",
            "batched / single",
            f"{'source':<10}{'clients':>8}  {'policy':<18}{'req/s':>8}"
            f"{'out tok/s':>10}{'p50 lat':>9}{'p50 TTFT':>9}",
        ]
        lines += [
            f"{r['source']:<10}{r['concurrency']:>8}  {r['policy']:<18}{r['req_s_x']:>7.2f}x"
            f"{r['out_tok_s_x']:>9.2f}x{r['p50_ms_x']:>8.2f}x{r['ttft_p50_ms_x']:>8.2f}x"
            for r in ratios
        ]
    lines += format_comparisons(comparisons(result.rows()))
    return "\n".join(lines)


def write_results(result: SweepResult, out: Path) -> list[Path]:
    """``sweep.csv`` (a row per cell), ``ratios.csv``, ``comparisons.csv`` and ``sweep.json``
    (settings included) under ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    tables = (
        ("sweep.csv", result.rows()),
        ("ratios.csv", result.ratios()),
        ("comparisons.csv", comparisons(result.rows())),
    )
    for name, rows in tables:
        if not rows:
            continue
        with open(out / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        paths.append(out / name)
    (out / "sweep.json").write_text(json.dumps(result.to_json(), indent=2))
    return [*paths, out / "sweep.json"]
