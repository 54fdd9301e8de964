"""Run a benchmark spec on vLLM (in the vLLM environment):

    python -m pipeline.bench.vllm_run_cells --spec spec.json --out results.json

The spec: {"model", "max_model_len", "repeats", "methods": [{"name", "speculative_config"
(null: no speculation), "env", "engine_kwargs" (e.g. scheduler_cls), each optional}],
"cells": [{"domain", "temperature", "concurrency", "prompts" (token ids),
"max_tokens", "seed"}]}.

Repeats are interleaved (for each repeat, every method: start an engine, run every cell, shut
it down), the method order reversed on odd repeats so drift slows every method alike. The
results file is rewritten after each (repeat, method), so a crash loses only the run in
progress; a method whose engine fails is recorded with its error and not tried again.

With ``"interleave": "cells"`` every method's engine starts once and stays up, and the methods
alternate cell by cell (for each repeat, each cell, every method; the order reversed from one
cell to the next and, for a cell, from one repeat to the next): a drift of the machine shorter
than a repeat then touches every method alike. Engines keep what they learned from one repeat
to the next; each holds its own KV cache.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
from contextlib import ExitStack
from pathlib import Path

from pipeline.bench.vllm_cells import (
    DRAFTER_STATS_ENV,
    PLANNER_LOG_ENV,
    cell_line,
    engine_session,
    environ,
    run_cell,
    run_method,
)


def _write(path: Path, results: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results))
    os.replace(tmp, path)  # a reader never sees half a file


def _error(exc: BaseException) -> str:
    """The exception and, for a failed engine start, the root cause vLLM wraps it around."""
    causes = [exc]
    while causes[-1].__cause__ is not None and len(causes) < 5:
        causes.append(causes[-1].__cause__)
    return " <- ".join(f"{type(e).__name__}: {e}" for e in causes)[:2000]


def _method_env(method: dict, out: Path, tag: str) -> dict[str, str]:
    """The method's env, with the files its drafter's counters and its scheduler's report go
    to (``tag``: which run of it)."""
    env = {k: str(v) for k, v in (method.get("env") or {}).items()}
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", method["name"])
    if method.get("speculative_config"):
        drafter = out.with_name(f"{out.stem}.{slug}.{tag}.drafter")
        drafter.unlink(missing_ok=True)
        env[DRAFTER_STATS_ENV] = str(drafter.resolve())
    if "scheduler_cls" in (method.get("engine_kwargs") or {}):
        planner = out.with_name(f"{out.stem}.{slug}.{tag}.planner")
        planner.unlink(missing_ok=True)
        env[PLANNER_LOG_ENV] = str(planner.resolve())
    return env


def run_spec(spec: dict, out: Path, progress=print) -> dict:
    if spec.get("interleave", "methods") == "cells":
        return run_spec_by_cells(spec, out, progress)
    methods, cells = spec["methods"], spec["cells"]
    repeats = int(spec.get("repeats", 1))
    results: dict = {
        "model": spec["model"],
        "repeats": repeats,
        "methods": [m["name"] for m in methods],
        "runs": [],
    }
    failed: dict[str, str] = {}
    for rep in range(repeats):
        order = methods if rep % 2 == 0 else methods[::-1]
        for method in order:
            name = method["name"]
            run: dict = {"repeat": rep, "method": name, "error": None, "cells": []}
            if name in failed:
                run["error"] = f"not run: failed in an earlier repeat ({failed[name]})"
                results["runs"].append(run)
                continue
            env = _method_env(method, out, f"r{rep}")
            progress(f"repeat {rep + 1}/{repeats}  {name}: starting vLLM")
            t0 = time.perf_counter()
            try:
                res = run_method(
                    spec["model"],
                    int(spec["max_model_len"]),
                    method.get("speculative_config"),
                    cells,
                    env,
                    progress,
                    method.get("engine_kwargs"),
                )
                run.update(res)
            except Exception as exc:  # a method that cannot run is a result, not the end
                run["error"] = _error(exc)
                failed[name] = run["error"][:300]
                traceback.print_exc()
                progress(f"repeat {rep + 1}/{repeats}  {name}: FAILED {run['error'][:300]}")
            run["total_s"] = time.perf_counter() - t0
            if PLANNER_LOG_ENV in env and Path(env[PLANNER_LOG_ENV]).exists():
                run["planner"] = Path(env[PLANNER_LOG_ENV]).read_text().splitlines()[-1:]
                for line in run["planner"]:
                    progress(f"    {line}")
            results["runs"].append(run)
            _write(out, results)
            progress(f"repeat {rep + 1}/{repeats}  {name}: done in {run['total_s']:.0f} s")
    _write(out, results)
    return results


def run_spec_by_cells(spec: dict, out: Path, progress=print) -> dict:
    """``"interleave": "cells"``: every engine up at once, the methods alternating cell by cell;
    the results as run_spec's, one run per (repeat, method)."""
    methods, cells = spec["methods"], spec["cells"]
    repeats = int(spec.get("repeats", 1))
    results: dict = {
        "model": spec["model"],
        "repeats": repeats,
        "methods": [m["name"] for m in methods],
        "interleave": "cells",
        "runs": [],
    }
    runs = {
        (rep, m["name"]): {"repeat": rep, "method": m["name"], "error": None, "cells": []}
        for rep in range(repeats)
        for m in methods
    }
    results["runs"] = list(runs.values())
    envs = {m["name"]: _method_env(m, out, "all") for m in methods}
    engines: dict[str, object] = {}
    with ExitStack() as stack:
        for method in methods:
            name = method["name"]
            progress(f"{name}: starting vLLM")
            try:
                llm, start_s = stack.enter_context(
                    engine_session(
                        spec["model"],
                        int(spec["max_model_len"]),
                        method.get("speculative_config"),
                        cells,
                        envs[name],
                        method.get("engine_kwargs"),
                    )
                )
            except Exception as exc:  # a method that cannot run is a result, not the end
                traceback.print_exc()
                progress(f"{name}: FAILED {_error(exc)[:300]}")
                for rep in range(repeats):
                    runs[(rep, name)]["error"] = _error(exc)
                continue
            engines[name] = llm
            for rep in range(repeats):
                runs[(rep, name)]["start_s"] = start_s
        for rep in range(repeats):
            for j, cell in enumerate(cells):
                # Flipped cell by cell and repeat by repeat: a cell's first method changes
                # between repeats whatever the number of cells.
                order = methods if (rep + j) % 2 == 0 else methods[::-1]
                for method in order:
                    name = method["name"]
                    if name not in engines:
                        continue
                    with environ(envs[name]):
                        res = run_cell(engines[name], cell, f"r{rep}c{j}")
                    progress(f"repeat {rep + 1}/{repeats}  {name}:" + cell_line(cell, res)[3:])
                    runs[(rep, name)]["cells"].append(res)
            _write(out, results)
    for name, env in envs.items():  # each scheduler reports when its engine stops
        planner = Path(env.get(PLANNER_LOG_ENV, ""))
        if name in engines and PLANNER_LOG_ENV in env and planner.exists():
            runs[(repeats - 1, name)]["planner"] = planner.read_text().splitlines()[-1:]
    _write(out, results)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.bench.vllm_run_cells",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--spec", required=True, type=Path, help="the spec JSON (see above)")
    p.add_argument("--out", required=True, type=Path, help="the results JSON to write")
    args = p.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    prefix = os.environ.get("SPECBOUND_PROGRESS_PREFIX", "")  # the caller's filter for its log
    run_spec(spec, args.out, lambda line: print(prefix + line, flush=True))
    return 0


if __name__ == "__main__":  # vLLM spawns its engine in new processes: the guard is required
    sys.exit(main())
