"""vLLM against itself and against our engine (jobs.bench_vllm): the same token prompts, per
(domain, temperature, concurrency) cell, decoded by vLLM with each speculative method (none,
its draft model at fixed K, n-gram, suffix, a per-batch-size K schedule, our cost-aware
scheduler over vLLM's drafters) and by our own engine (``ar``, fixed K, ``throughput``).

vLLM runs in its own environment (pipeline.vllm_spec.env), so this module writes a spec,
runs ``pipeline.bench.vllm_run_cells`` there as a subprocess and reads its results back; our
engine then decodes the same prompts here (pipeline.bench.vllm_engine) and
pipeline.bench.vllm_tables turns both into the tables.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from pipeline.data.domains import load_prompts
from pipeline.vllm_spec.env import ROOT, engine_env, vllm_python
from pipeline.vllm_spec.methods import Method

DOMAINS = ("code", "prose", "math", "sharegpt")
PROGRESS = "[vllm] "  # vllm_run_cells' progress lines, picked out of vLLM's log
ROOT_CAUSE = re.compile(r" ERROR .*?\] (\w+(?:Error|Exception): .*)")
FAILED = re.compile(r"^repeat \d+/\d+  (.+): FAILED")


def check_domains(text: str) -> list[str]:
    names = [d.strip().lower() for d in text.split(",") if d.strip()]
    bad = [d for d in names if d not in DOMAINS]
    if bad or not names:
        raise ValueError(f"unknown domains {bad or text!r}; choose among {', '.join(DOMAINS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"a domain is given twice: {names}")
    return names


def build_prompts(
    tokenizer, domains: list[str], count: int, prompt_tokens: int | None
) -> dict[str, list[list[int]]]:
    """``count`` prompts per domain, as token ids the way every stage encodes them."""
    from pipeline.data.prompts import encode

    return {
        d: [encode(tokenizer, p.text, keep_last=prompt_tokens) for p in load_prompts(d, count)]
        for d in domains
    }


def build_cells(
    prompts: dict[str, list[list[int]]],
    temperatures: list[float],
    concurrency: list[int],
    limit: int,
    max_tokens: int,
    seed: int = 0,
) -> list[dict]:
    """Every (domain, T, c): the first max(limit, c) prompts (c in flight needs c prompts)."""
    return [
        {
            "domain": d,
            "temperature": t,
            "concurrency": c,
            "max_tokens": max_tokens,
            "seed": seed,
            "prompts": ids[: max(limit, c)],
        }
        for d, ids in prompts.items()
        for t in temperatures
        for c in concurrency
    ]


def max_model_len(cells: list[dict], methods: list[Method]) -> int:
    """Room for the longest prompt, its tokens and the deepest draft (suffix: 24)."""
    longest = max(len(p) for c in cells for p in c["prompts"])
    depth = max([int(m.knobs.get("k") or 24) for m in methods] + [24])
    need = longest + max(c["max_tokens"] for c in cells) + depth + 8
    return -(-need // 64) * 64


def run_vllm(spec: dict, out: Path, progress=print, extra_env: dict | None = None) -> dict:
    """vllm_run_cells in the vLLM environment; its whole log in out/vllm.log, its progress lines
    passed on. The results file it rewrites as it goes is read even after a crash.
    ``extra_env``: set for the engine only (e.g. LD_PRELOAD of Intel OpenMP)."""
    out.mkdir(parents=True, exist_ok=True)
    spec_path, results_path = out / "vllm_spec.json", out / "vllm_results.json"
    spec_path.write_text(json.dumps(spec))
    results_path.unlink(missing_ok=True)
    cmd = [
        str(vllm_python()),
        "-m",
        "pipeline.bench.vllm_run_cells",
        "--spec",
        str(spec_path.resolve()),
        "--out",
        str(results_path.resolve()),
    ]
    env = engine_env({"SPECBOUND_PROGRESS_PREFIX": PROGRESS, **(extra_env or {})})
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with open(out / "vllm.log", "w") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        assert proc.stdout is not None
        cause, causes = None, {}
        for line in proc.stdout:
            log.write(line)
            found = ROOT_CAUSE.search(line)
            if found:  # an engine process's error: the driver only says "see above"
                cause = found.group(1).strip()
            if line.startswith(PROGRESS):
                text = line[len(PROGRESS) :].rstrip()
                failed = FAILED.search(text)
                if failed and cause:
                    causes[failed.group(1)] = cause
                    text += f" (root cause: {cause[:300]})"
                elif "starting vLLM" in text:
                    cause = None
                progress(text)
        code = proc.wait()
    if not results_path.exists():
        raise RuntimeError(f"vLLM run failed (exit {code}) before any result: see {out}/vllm.log")
    results = json.loads(results_path.read_text())
    results["exit_code"] = code
    for run in results["runs"]:
        if run.get("error") and run["method"] in causes:
            run["error"] += f" (root cause: {causes[run['method']]})"
    if code != 0:
        progress(f"vLLM run ended with exit {code}; partial results kept (see {out}/vllm.log)")
    return results


def bench_vllm(
    target: str,
    draft: str,
    domains: list[str],
    temperatures: list[float],
    concurrency: list[int],
    repeats: int,
    limit: int,
    max_tokens: int,
    prompt_tokens: int | None,
    methods: list[Method],
    engine: bool,
    out: Path,
    model_args: tuple = ("cpu", "float32", "eager"),
    progress=print,
    extra_env: dict | None = None,
    interleave: str = "methods",
    floor_ks: dict | None = None,
) -> dict:
    """The whole benchmark: prompts, vLLM's methods (a subprocess), our engine's rows, the
    tables; raw results, summary and tables written under ``out``. ``interleave``: what
    alternates in the vLLM run (pipeline.bench.vllm_run_cells); ``floor_ks``: the fixed K of
    each cell's floor, chosen by another run (pipeline.bench.vllm_tables.held_out_ks)."""
    from pipeline.models.loading import load_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    prompts = build_prompts(
        load_tokenizer(target), domains, max([limit, *concurrency]), prompt_tokens
    )
    cells = build_cells(prompts, temperatures, concurrency, limit, max_tokens)
    progress(
        f"{len(cells)} cells ({', '.join(domains)} x T {temperatures} x c {concurrency}), "
        f"{limit}+ prompts x {max_tokens} tokens, {repeats} interleaved repeats"
    )
    runs: list[dict] = []
    if methods:
        spec = {
            "model": target,
            "max_model_len": max_model_len(cells, methods),
            "repeats": repeats,
            "methods": [m.entry(draft) for m in methods],
            "cells": cells,
            "interleave": interleave,
        }
        progress(f"vLLM: {len(methods)} methods, log in {out / 'vllm.log'}")
        runs += run_vllm(spec, out, progress, extra_env)["runs"]
    if engine:
        from pipeline.bench.vllm_engine import engine_runs
        from pipeline.decode.policies.artifacts import load_artifacts
        from pipeline.models.loading import load_pair

        progress("our engine: ar, fixed K 1..6, throughput")
        pair = load_pair(target, draft, *model_args)  # (device, dtype, experts kernel)
        artifacts = load_artifacts(device=str(pair.device))
        runs += engine_runs(pair, cells, repeats, artifacts, progress=progress)
    header = (
        f"vLLM vs our engine: {', '.join(domains)}; T {temperatures}; c {concurrency}; "
        f"{limit} prompts (c of them at c > limit) x {max_tokens} tokens; "
        f"{repeats} repeats (median, min-max)"
    )
    (out / "raw.json").write_text(json.dumps({"cells": cells, "runs": runs}))
    return {"cells": cells, "runs": runs} | retable(runs, out, header, floor_ks)


def retable(runs: list[dict], out: Path, header: str, floor_ks: dict | None = None) -> dict:
    """The tables of a run's results (its raw.json's runs): summary.json and tables.txt
    under ``out``; ``floor_ks``: each cell's floor K chosen by another run."""
    from pipeline.bench.vllm_tables import format_tables, summarize

    summary = summarize(runs, floor_ks)
    text = format_tables(summary, header)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "tables.txt").write_text(text + "\n")
    return {"summary": summary, "text": text}
