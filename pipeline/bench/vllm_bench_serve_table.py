"""The table of jobs.bench_vllm_serve, from vLLM's own result JSONs (vllm bench serve
--save-result): per (source, temperature, concurrency) cell and model id, output tokens/s
(median over repeats and its min-max), its ratio to the baseline model id paired by repeat
(pipeline.bench.vllm_tables' pairing: the median of the per-repeat ratios, repeats where one
side failed left out), TPOT p50 (median, min-max) and p99, TTFT p50, failed requests over all
repeats, and the mean accepted length (vLLM's own figure when its client read the server's
/metrics, else the app's counters read at --metrics-url)."""

from __future__ import annotations

import statistics
from collections import defaultdict

from pipeline.bench.vllm_bench_serve import Run
from pipeline.bench.vllm_tables import _ratios

BASELINE = "none"


def accepted_length(run: Run) -> float | None:
    """Tokens per draft-verify step: vLLM's figure, else 1 + accepted / drafts of the counters
    the run moved; None without drafts (no speculation, or not read)."""
    result = run.result or {}
    if result.get("spec_decode_acceptance_length") is not None:
        return float(result["spec_decode_acceptance_length"])
    if run.spec and run.spec.get("drafts", 0) > 0:
        return 1.0 + run.spec["accepted"] / run.spec["drafts"]
    return None


def _spread(values: list) -> tuple[float | None, float | None, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return None, None, None
    return statistics.median(values), min(values), max(values)


def _paired_rates(done: list[Run]) -> dict:
    """tok/s by repeat, in vllm_tables' row shape; a repeat without output is left out."""
    rates = [(r.cell.repeat, r.result.get("output_throughput") or 0.0) for r in done]
    rates = [(i, v) for i, v in rates if v > 0]
    return {"repeats": [i for i, _ in rates], "per_repeat": [v for _, v in rates]}


def summarize(runs: list[Run], baseline: str = BASELINE) -> list[dict]:
    """[{source, temperature, concurrency, rows: {model id: row}}], cells and rows in run
    order; a row's figures come from the repeats whose run produced a result."""
    cells: dict[tuple, dict[str, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        c = run.cell
        cells[(c.source, c.temperature, c.concurrency)][c.model].append(run)
    out = []
    for (source, temperature, concurrency), models in cells.items():
        rows = {}
        for model, model_runs in models.items():
            done = sorted((r for r in model_runs if r.result), key=lambda r: r.cell.repeat)
            res = [r.result for r in done]
            tok_s = _spread([x.get("output_throughput") for x in res])
            tpot = _spread([x.get("median_tpot_ms") for x in res])
            rows[model] = {
                "paired": _paired_rates(done),
                "tok_s": tok_s,
                "tpot_p50_ms": tpot,
                "tpot_p99_ms": _spread([x.get("p99_tpot_ms") for x in res])[0],
                "ttft_p50_ms": _spread([x.get("median_ttft_ms") for x in res])[0],
                "failed": sum(int(x.get("failed", 0)) for x in res),
                "requests": sum(int(x.get("completed", 0)) + int(x.get("failed", 0)) for x in res),
                "runs": len(model_runs),
                "runs_failed": len(model_runs) - len(done),
                "accepted_len": _spread([accepted_length(r) for r in done])[0],
            }
        base = rows.get(baseline)
        for row in rows.values():
            ratios = _ratios(row["paired"], [base["paired"]]) if base else []
            row["vs_base"] = _spread(ratios) if ratios else None
        out.append(
            {
                "source": source,
                "temperature": temperature,
                "concurrency": concurrency,
                "rows": rows,
            }
        )
    return out


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _range(spread: tuple | None, fmt: str) -> str:
    if not spread or spread[0] is None:
        return "-"
    return f"{spread[1]:{fmt}}-{spread[2]:{fmt}}"


def format_table(cells: list[dict], runs: list[Run], baseline: str = BASELINE) -> str:
    repeats = max((r.cell.repeat for r in runs), default=-1) + 1
    lines = [
        f"vLLM's client (vllm bench serve), {repeats} repeat(s): median over repeats [min-max]; "
        f"x {baseline}: paired by repeat; failed: requests over all repeats",
        "",
    ]
    head = (
        f"  {'model':<24}{'tok/s':>8}{'min-max':>14}{'x ' + baseline:>9}{'min-max':>12}"
        f"{'TPOT p50':>9}{'min-max':>14}{'p99':>8}{'TTFT p50':>9}{'failed':>10}{'acc len':>8}"
    )
    for cell in cells:
        lines += [
            f"{cell['source']}  T={cell['temperature']:g}  c={cell['concurrency']}",
            head,
        ]
        for model, r in cell["rows"].items():
            failed = f"{r['failed']}/{r['requests']}"
            if r["runs_failed"]:
                failed += f" +{r['runs_failed']} run"
            vs = r["vs_base"]
            lines.append(
                f"  {model:<24}{_f(r['tok_s'][0], '.1f'):>8}{_range(r['tok_s'], '.1f'):>14}"
                f"{_f(vs and vs[0], '.3f'):>9}{_range(vs, '.2f'):>12}"
                f"{_f(r['tpot_p50_ms'][0], '.1f'):>9}{_range(r['tpot_p50_ms'], '.1f'):>14}"
                f"{_f(r['tpot_p99_ms'], '.1f'):>8}{_f(r['ttft_p50_ms'], '.0f'):>9}"
                f"{failed:>10}{_f(r['accepted_len'], '.2f'):>8}"
            )
        lines.append("")
    errors = {}
    for run in runs:  # the first error of each model id
        if run.error:
            errors.setdefault(run.cell.model, run.error)
    if errors:
        lines.append("runs that failed (first per model id):")
        lines += [f"  {m}: {e[:400]}" for m, e in errors.items()]
    return "\n".join(lines).rstrip()


def format_run(run: Run) -> str:
    """One line as a run ends."""
    c = run.cell
    head = f"{c.source} T={c.temperature:g} c={c.concurrency} r={c.repeat} {c.model}: "
    if run.error:
        return head + "failed: " + run.error[:300]
    x = run.result
    return head + (
        f"{x.get('output_throughput', 0):.1f} tok/s, TPOT p50 {x.get('median_tpot_ms', 0):.1f} "
        f"ms, TTFT p50 {x.get('median_ttft_ms', 0):.0f} ms, failed {x.get('failed', 0)}"
    )
