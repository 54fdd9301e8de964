"""Summarise run.sh's outputs: fixed K = 4 accepted length and draft time, and each
cost-aware policy over the best fixed K, per domain and pair (median over the runs)."""

import re
import statistics
import sys
from pathlib import Path

PAIRS = ("draft", "draft-2layer", "eagle3-head")
DOMAINS = ("code", "prose", "math", "all")
POLICIES = ("throughput", "specdec", "heuristic(max_k=12)")


def tables(path: Path) -> dict:
    """{domain: {policy: row}} from one bench_online output's per-domain tables."""
    out: dict = {}
    domain = None
    for line in path.read_text().splitlines():
        m = re.match(r"^(\w+), T=0 \(best fixed: (.+)\)$", line)
        if m:
            domain = m.group(1)
            out[domain] = {"best": m.group(2)}
            continue
        if domain and line.startswith("  ") and not line.strip().startswith("policy"):
            cells = line.split()
            if len(cells) == 8:
                name, tps, sp, xb, _, acc, _, ms = cells
                out[domain][name] = {
                    "speedup": float(sp.rstrip("x")),
                    "xbest": float(xb.rstrip("x")),
                    "accepted": float(acc),
                    "ms": None if ms == "-" else float(ms),
                }
        elif domain and not line.strip():
            domain = None if out.get(domain, {}).get("ar") else domain
    return out


def main(folder: Path) -> None:
    runs = {p: [tables(f) for f in sorted(folder.glob(f"{p}_run*.txt"))] for p in PAIRS}
    runs = {p: r for p, r in runs.items() if r}
    print("fixed(k=4): mean accepted / ms per draft forward, median over runs (min-max)")
    for d in DOMAINS:
        for p, rs in runs.items():
            acc = [r[d]["fixed(k=4)"]["accepted"] for r in rs]
            ms = [r[d]["fixed(k=4)"]["ms"] for r in rs]
            print(
                f"  {d:6s} {p:13s} accepted {statistics.median(acc):.2f} "
                f"({min(acc):.2f}-{max(acc):.2f})  ms/draft fwd {statistics.median(ms):.2f} "
                f"({min(ms):.2f}-{max(ms):.2f})"
            )
    for pol in POLICIES:
        print(f"\n{pol}: x best fixed K per run (speedup over ar)")
        for d in DOMAINS:
            for p, rs in runs.items():
                xb = [r[d][pol]["xbest"] for r in rs]
                best = ", ".join(r[d]["best"] for r in rs)
                sp = [r[d][pol]["speedup"] for r in rs]
                print(
                    f"  {d:6s} {p:13s} {' '.join(f'{x:.2f}x' for x in xb):22s} "
                    f"median {statistics.median(xb):.2f}x  speedup "
                    f"{' '.join(f'{s:.2f}' for s in sp)}  best {best}"
                )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent))
