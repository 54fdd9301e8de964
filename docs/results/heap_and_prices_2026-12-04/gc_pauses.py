"""Every full collection of Python's garbage collector during a `jobs.bench_online` run, with
its duration: the bench's own arguments follow the script's name. Run from the repository
root:

    PYTHONPATH=. python docs/results/heap_and_prices_2026-12-04/gc_pauses.py --domains all \\
        --limit 8 --max-new-tokens 64 --temperatures 0 --policies ar,fixed:k=5,throughput \\
        --no-bound --no-assisted --draft models/eagle3-head --artifacts models/eagle3-head

A "[gc]" line on stderr per collection of the oldest generation, between the bench's progress
lines, shows which prompt (and so which policy's timed decode) it landed in. Since the benches
decode against a frozen heap (pipeline.decode.heap) the collections left are frozen_heap's
own, outside the timed decodes.
"""

import gc
import runpy
import sys
import time

started: dict[str, float] = {}


def report(phase: str, info: dict) -> None:
    if info["generation"] != 2:
        return
    if phase == "start":
        started["t"] = time.perf_counter()
        return
    ms = 1e3 * (time.perf_counter() - started["t"])
    print(f"[gc] full collection {ms:.0f} ms, collected {info['collected']}", file=sys.stderr)


if __name__ == "__main__":
    gc.callbacks.append(report)
    sys.argv = ["jobs.bench_online", *sys.argv[1:]]
    runpy.run_module("jobs.bench_online", run_name="__main__")
