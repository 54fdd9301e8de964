"""The vLLM benchmark's tables (pipeline.bench.vllm): per (domain, T, c) cell every method's
output tokens/s (median over repeats and its min-max), its ratio to vLLM without speculation,
to the best fixed-K draft model of that cell and to the floor ours must not lose to
(max(none, the best fixed K of the same drafter)); the ratios to none and to the floor are
paired: the median over repeats of the ratio within each repeat (the methods of one repeat run
back to back, so a host whose speed drifts slows both sides of a ratio alike), TPOT, mean
accepted length and the share of steps the plugin's drafter skipped; the pooled c = 1, T = 0
figure; T = 0 texts against vLLM's own greedy text and our engine's `ar`."""

from __future__ import annotations

import statistics
from collections import defaultdict

BASE = "none"
ENGINE_AR = "engine ar"


def _key(cell: dict) -> tuple[str, float, int]:
    return cell["domain"], float(cell["temperature"]), int(cell["concurrency"])


def _by_cell(runs: list[dict]) -> dict[tuple, dict[str, list[dict]]]:
    """cell key -> method -> that cell's result in each repeat (repeat order)."""
    out: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for run in sorted(runs, key=lambda r: r["repeat"]):
        for cell in run.get("cells") or []:
            if cell is not None:
                out[_key(cell)][run["method"]].append(cell | {"repeat": run["repeat"]})
    return out


def _med(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def is_fixed_draft(label: str) -> bool:
    return label.startswith(("draft_model:", "eagle3:")) and "schedule" not in label


def summarize(runs: list[dict], floor_ks: dict | None = None) -> dict:
    """{"cells": [{domain, temperature, concurrency, methods: {label: row}, best_draft,
    best_engine_fixed, floor_ks}], "pooled": {label: row}, "texts": {label: counts},
    "errors": {...}}. ``floor_ks`` (held_out_ks of another run): the fixed K each cell's floor
    takes, where this run has it, instead of this run's best."""
    cells = []
    for key, methods in sorted(_by_cell(runs).items()):
        chosen = (floor_ks or {}).get(key, {})
        rows = {}
        for label, results in methods.items():
            tok_s = [r["tok_s"] for r in results]
            rows[label] = {
                "tok_s": _med(tok_s),
                "min": min(tok_s),
                "max": max(tok_s),
                "per_repeat": tok_s,
                "repeats": [r["repeat"] for r in results],
                "tpot_ms": _ms(_med([r.get("tpot_s") for r in results])),
                "ttft_ms": _ms(_med([r.get("ttft_s") for r in results])),
                "accepted_len": _med([r.get("mean_accepted_len") for r in results]),
                "skipped": _skipped(results),
            }
        base = rows.get(BASE, {}).get("tok_s")
        best = _best(rows, is_fixed_draft)
        best_engine = _best(rows, lambda m: m.startswith("engine fixed"))
        for label, row in rows.items():
            row["vs_none"] = _paired(row, [rows[BASE]]) if base else None
            row["vs_best_draft"] = row["tok_s"] / rows[best]["tok_s"] if best else None
            floor = _floor(rows, label, chosen)
            if floor:
                ratios = _ratios(row, floor)
                row["vs_floor"] = statistics.median(ratios)
                row["vs_floor_min"], row["vs_floor_max"] = min(ratios), max(ratios)
            else:
                row["vs_floor"] = None
        cells.append(
            {
                "domain": key[0],
                "temperature": key[1],
                "concurrency": key[2],
                "methods": rows,
                "best_draft": best,
                "best_engine_fixed": best_engine,
                "floor_ks": {p: m for p, m in chosen.items() if m in rows},
            }
        )
    errors: dict[str, str] = {}
    for run in runs:  # the first error of each method (later repeats only say it failed)
        if run.get("error"):
            errors.setdefault(run["method"], run["error"])
    return {"cells": cells, "pooled": pooled(runs), "texts": texts(runs), "errors": errors}


def _skipped(results: list[dict]) -> float | None:
    """Share of engine steps whose draft forward the plugin's drafter skipped (k = 0)."""
    stats = [r["drafter"] for r in results if r.get("drafter")]
    steps = sum(s.get("steps", 0.0) for s in stats)
    return sum(s.get("skipped", 0.0) for s in stats) / steps if steps else None


# ours over a drafter must not lose to no speculation nor to that drafter at its best fixed K.
FLOOR_PEERS = {"ours:": "draft_model:", "ours-eagle3:": "eagle3:"}


def _floor(rows: dict, label: str, chosen: dict | None = None) -> list[dict] | None:
    """The rows of ours' floor: none and the best (by median) fixed K of its drafter, the
    better of them in each repeat; or the one arm (none or a fixed K) ``chosen`` (drafter
    prefix -> label) by another run, where this run has it."""
    prefix = next((p for p in FLOOR_PEERS if label.startswith(p)), None)
    if prefix is None:
        return None
    held_out = (chosen or {}).get(FLOOR_PEERS[prefix])
    if held_out in rows and rows[held_out]["tok_s"]:
        return [rows[held_out]]
    base = [rows[BASE]] if rows.get(BASE, {}).get("tok_s") else []
    fixed = _fixed(rows, FLOOR_PEERS[prefix])
    peers = base + ([rows[max(fixed, key=lambda m: rows[m]["tok_s"])]] if fixed else [])
    return peers or None


def _fixed(rows: dict, prefix: str) -> list[str]:
    return [
        m for m, r in rows.items() if r["tok_s"] and m.startswith(prefix) and "schedule" not in m
    ]


def held_out_ks(summary: dict) -> dict[tuple, dict[str, str]]:
    """Per cell of another run's summary and drafter, the arm of ours' floor that run found
    best by median: its best fixed K, or none where none was faster. Priced in a new run, the
    floor is then one arm chosen on other repeats, not the better of several chosen on this
    run's own noise (which reads above every one of them)."""
    out: dict[tuple, dict[str, str]] = {}
    for cell in summary["cells"]:
        rows = cell["methods"]
        for prefix in FLOOR_PEERS.values():
            fixed = _fixed(rows, prefix)  # (a drafter the run did not fix K for: no choice)
            if fixed:
                arms = fixed + ([BASE] if rows.get(BASE, {}).get("tok_s") else [])
                best = max(arms, key=lambda m: rows[m]["tok_s"])
                out.setdefault(_key(cell), {})[prefix] = best
    return out


def _ratios(row: dict, peers: list[dict]) -> list[float]:
    """Per repeat: the row's tok/s over the best of ``peers`` in that same repeat (repeats
    where one of them has no result, a failed run, are left out)."""
    rates = [dict(zip(r["repeats"], r["per_repeat"], strict=True)) for r in (row, *peers)]
    common = sorted(set(rates[0]).intersection(*rates[1:]))
    return [rates[0][i] / max(p[i] for p in rates[1:]) for i in common]


def _paired(row: dict, peers: list[dict]) -> float:
    return statistics.median(_ratios(row, peers))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _best(rows: dict, which) -> str | None:
    chosen = [m for m in rows if which(m) and rows[m]["tok_s"]]
    return max(chosen, key=lambda m: rows[m]["tok_s"]) if chosen else None


def pooled(runs: list[dict], concurrency: int = 1, temperature: float = 0.0) -> dict:
    """Per method, over every domain at (c, T): sum of tokens / sum of wall time in each
    repeat, the median and range over repeats; vs_none paired within repeats."""
    per: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for run in runs:
        for cell in run.get("cells") or []:
            if cell and _key(cell)[1:] == (temperature, concurrency):
                acc = per[run["method"]][run["repeat"]]
                acc[0] += cell["tokens"]
                acc[1] += cell["wall_s"]
    rate = {m: {r: t / s for r, (t, s) in reps.items() if s > 0} for m, reps in per.items()}
    out = {}
    for label, reps in rate.items():
        rates = list(reps.values())
        out[label] = {"tok_s": _med(rates), "min": min(rates), "max": max(rates)}
        # paired, as in the cells: the ratio within each repeat, its median; each repeat's
        # too, so that any two methods compare repeat by repeat (their ratio of these)
        both = {r: reps[r] / rate[BASE][r] for r in sorted(reps) if r in rate.get(BASE, {})}
        out[label]["vs_none"] = _med(list(both.values()))
        out[label]["vs_none_per_repeat"] = both
    return out


def texts(runs: list[dict]) -> dict:
    """At T = 0, first repeat: each method's tokens against vLLM `none` and our `ar`,
    position by position (equal / total) and whole sequences."""
    first = [r for r in runs if r["repeat"] == 0]
    outputs = {
        r["method"]: {
            _key(c): c["outputs"]
            for c in r.get("cells") or []
            if c and float(c["temperature"]) == 0
        }
        for r in first
    }
    out = {}
    for label, cells in outputs.items():
        if not cells:  # a method that did not run
            continue
        row = {}
        for ref in (BASE, ENGINE_AR):
            if ref not in outputs or ref == label:
                continue
            eq = tot = seq_eq = seqs = 0
            for key, outs in cells.items():
                for a, b in zip(outs, outputs[ref].get(key, []), strict=False):
                    eq += sum(x == y for x, y in zip(a, b, strict=False))
                    tot += max(len(a), len(b))
                    seq_eq += a == b
                    seqs += 1
            row[ref] = {"equal": eq, "total": tot, "seq_equal": seq_eq, "seqs": seqs}
        out[label] = row
    return out


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_tables(summary: dict, header: str) -> str:
    lines = [header, ""]
    head = (
        f"  {'method':<42}{'tok/s':>8} {'min-max':>13}{'x none':>8}{'x best K':>9}"
        f"{'x floor':>8}{'min-max':>12}{'TPOT ms':>9}{'acc len':>8}{'skip':>6}"
    )
    for cell in summary["cells"]:
        lines += [
            f"{cell['domain']}  T={cell['temperature']:g}  c={cell['concurrency']}  "
            f"(best fixed K of vLLM: {cell['best_draft'] or '-'}; best engine fixed K: "
            f"{cell['best_engine_fixed'] or '-'}"
            + "".join(f"; floor from another run: {m}" for m in cell.get("floor_ks", {}).values())
            + ")",
            head,
        ]
        for label, r in cell["methods"].items():
            lines.append(
                f"  {label:<42}{r['tok_s']:>8.1f} {r['min']:>6.1f}-{r['max']:<6.1f}"
                f"{_f(r['vs_none'], '.3f'):>8}{_f(r['vs_best_draft'], '.3f'):>9}"
                f"{_f(r.get('vs_floor'), '.3f'):>8}"
                + (
                    f"{r['vs_floor_min']:>6.2f}-{r['vs_floor_max']:<5.2f}"
                    if r.get("vs_floor") is not None
                    else f"{'':>12}"
                )
                + f"{_f(r['tpot_ms'], '.2f'):>9}{_f(r['accepted_len'], '.2f'):>8}"
                f"{_f(r.get('skipped'), '.0%'):>6}"
            )
        lines.append("")
    lines.append(
        "pooled over domains at c=1, T=0 (sum tokens / sum time, median over repeats; "
        "x none paired within repeats, then per repeat)"
    )
    for label, r in summary["pooled"].items():
        each = " ".join(f"{v:.3f}" for v in r.get("vs_none_per_repeat", {}).values())
        lines.append(
            f"  {label:<42}{r['tok_s']:>8.1f} {r['min']:>6.1f}-{r['max']:<6.1f}"
            f"{_f(r['vs_none'], '.3f'):>8}   {each}".rstrip()
        )
    lines += ["", "T=0 texts, first repeat: tokens equal / total (whole sequences equal)"]
    for label, row in summary["texts"].items():
        parts = [
            f"vs {ref}: {c['equal']}/{c['total']} ({c['seq_equal']}/{c['seqs']} seqs)"
            for ref, c in row.items()
        ]
        lines.append(f"  {label:<42}" + ("   ".join(parts) or "-"))
    if summary["errors"]:
        lines += ["", "methods that failed:"]
        lines += [f"  {m}: {e[:400]}" for m, e in summary["errors"].items()]
    return "\n".join(lines)
