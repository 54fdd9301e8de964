"""The serving sweep's comparison of the vLLM app with the research endpoint, per (source,
concurrency): the cell of ``ours`` (the cost-aware scheduler) against the endpoint's best
cell, against vLLM's best fixed draft length (the best ``draft_model`` model id of the same
run) and against no speculation."""

from __future__ import annotations

from typing import Any


def _best(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    return max(rows, key=lambda r: r["out_tok_s"]) if rows else None


def _ratio(a: dict | None, b: dict | None) -> float:
    if a is None or b is None or not b["out_tok_s"]:
        return float("nan")
    return a["out_tok_s"] / b["out_tok_s"]


def comparisons(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    keys = sorted({(r["source"], r["concurrency"]) for r in rows}, key=lambda k: (k[0], k[1]))
    for source, c in keys:
        here = [r for r in rows if (r["source"], r["concurrency"]) == (source, c)]
        vllm = [r for r in here if r["mode"] == "vllm"]
        ours = _best([r for r in vllm if r["policy"].startswith("ours")])
        if ours is None:
            continue
        endpoint = _best([r for r in here if r["mode"] != "vllm"])
        fixed = _best([r for r in vllm if r["policy"].startswith("draft_model")])
        none = _best([r for r in vllm if r["policy"] == "none"])
        out.append(
            {
                "source": source,
                "concurrency": c,
                "ours": ours["policy"],
                "ours_tok_s": ours["out_tok_s"],
                "ours_p99_ms": ours["p99_ms"],
                "endpoint": endpoint and f"{endpoint['mode']} {endpoint['policy']}",
                "endpoint_tok_s": endpoint and endpoint["out_tok_s"],
                "endpoint_p50_ms": endpoint and endpoint["p50_ms"],
                "best_k": fixed and fixed["policy"],
                "best_k_tok_s": fixed and fixed["out_tok_s"],
                "none_tok_s": none and none["out_tok_s"],
                "ours_vs_endpoint_x": _ratio(ours, endpoint),
                "ours_vs_best_k_x": _ratio(ours, fixed),
                "ours_vs_none_x": _ratio(ours, none),
                "p99_vs_endpoint_p50_x": (
                    ours["p99_ms"] / endpoint["p50_ms"] if endpoint else float("nan")
                ),
                "errors": sum(r["errors"] for r in here),
            }
        )
    return out


def format_comparisons(items: list[dict[str, Any]]) -> list[str]:
    if not items:
        return []
    lines = [
        "",
        "vLLM app with ours (the cost-aware scheduler) against the endpoint's best cell, "
        "vLLM's best fixed K and none",
        f"{'source':<10}{'clients':>8}  {'ours tok/s':>10}{'endpoint':>10}{'x':>7}"
        f"  {'best K':<16}{'tok/s':>8}{'x':>7}{'none':>8}{'x':>7}{'p99/ep p50':>11}{'errors':>7}",
    ]
    for r in items:
        lines.append(
            f"{r['source']:<10}{r['concurrency']:>8}  {r['ours_tok_s']:>10.1f}"
            f"{(r['endpoint_tok_s'] or float('nan')):>10.1f}{r['ours_vs_endpoint_x']:>6.2f}x"
            f"  {(r['best_k'] or '-'):<16}{(r['best_k_tok_s'] or float('nan')):>8.1f}"
            f"{r['ours_vs_best_k_x']:>6.2f}x{(r['none_tok_s'] or float('nan')):>8.1f}"
            f"{r['ours_vs_none_x']:>6.2f}x{r['p99_vs_endpoint_p50_x']:>10.2f}x{r['errors']:>7}"
        )
    return lines
