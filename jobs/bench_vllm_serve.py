"""vLLM's own serving benchmark client (`vllm bench serve`, vllm.benchmarks.serve) against a
running vLLM app (make serve-vllm, or python -m vllm_serving.run): the project's prompts
(ShareGPT first human turns, HumanEval ...) written as the client's `custom` JSONL dataset,
then one run of the client per source x temperature x concurrency (its --max-concurrency) x
model id x repeat, the model ids interleaved within each repeat. Needs the vLLM environment
(make vllm-env), where the client runs.

    make serve-vllm                     # in another shell: the app on 127.0.0.1:8000
    python -m jobs.bench_vllm_serve     # every model id it serves, 1,2,4,8,16 clients, T 0,1
    # an app serving model ids ours and none (PYTHONPATH=. .venv-vllm/bin/python -m
    # vllm_serving.run --port 8000 --args '{"models": [{"name": "ours", ...}, ...]}'):
    python -m jobs.bench_vllm_serve --models ours,none --source sharegpt --concurrency 1,8 \\
        --temperatures 0 --repeats 1 --limit 16

Prints one table: per cell and model id, output tok/s (median over repeats, min-max), its
ratio to --baseline paired by repeat, TPOT p50 / p99, TTFT p50, failed requests and the
mean accepted length (from the server's /metrics as vLLM's client reads it, else from
--metrics-url: the app's engine counters are Ray metrics, on the Ray node's Prometheus port,
e.g. python -m vllm_serving.run --metrics-port 8080 ...). vLLM's result JSONs (--save-result)
and each run's log go to OUT/results, the prompt files to OUT/prompts, every run's command
and counters to OUT/runs.jsonl.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from jobs.cli import (
    add_concurrency_arg,
    add_limit_arg,
    add_max_tokens_arg,
    add_out_arg,
    add_repeats_arg,
    add_source_arg,
    add_temperatures_arg,
    parser,
    run,
)
from pipeline.bench.vllm_bench_serve import BenchSettings, run_bench
from pipeline.bench.vllm_bench_serve_table import BASELINE, format_run, format_table, summarize
from pipeline.models.loading import DEFAULT_TARGET


def _ids(text: str) -> tuple[str, ...]:
    ids = tuple(m.strip() for m in text.split(",") if m.strip())
    if not ids or len(set(ids)) < len(ids):
        raise argparse.ArgumentTypeError(f"expected distinct model ids like ours,none: {text!r}")
    return ids


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.bench_vllm_serve", __doc__)
    p.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="the running app (%(default)s)"
    )
    p.add_argument(
        "--models",
        type=_ids,
        default=(),
        help="the app's model ids, comma-separated (default: every id it serves)",
    )
    p.add_argument(
        "--baseline",
        default=BASELINE,
        help="the model id the ratios are to (%(default)s; no ratios when not run)",
    )
    add_source_arg(p, many="sharegpt,humaneval")
    add_limit_arg(p, 32, "every run sends each once (at least the most clients)")
    add_max_tokens_arg(p, 64)
    add_concurrency_arg(p, "1,2,4,8,16")
    add_temperatures_arg(p, "0,1")
    add_repeats_arg(p, 3)
    p.add_argument(
        "--tokenizer",
        default=str(DEFAULT_TARGET),
        help="vLLM's client counts tokens with it: the app's target (the embedded one)",
    )
    p.add_argument(
        "--metrics-url",
        default=None,
        help="a Prometheus endpoint with the app's vLLM counters (the Ray node's, e.g. "
        "http://127.0.0.1:8080/metrics) for the accepted length (default: not read)",
    )
    p.add_argument(
        "--vllm-args",
        type=shlex.split,
        default=[],
        help="more options for vLLM's client, as typed, e.g. --vllm-args='--num-warmups 4 "
        "--ignore-eos'",
    )
    add_out_arg(p, Path("out/bench_vllm_serve"), "prompts/, results/, runs.jsonl")
    args = p.parse_args(argv)
    if min(args.concurrency) < 1 or args.repeats < 1 or args.max_tokens < 1:
        p.error("--concurrency, --repeats and --max-tokens must be >= 1")
    if min(args.temperatures) < 0:
        p.error(f"--temperatures must be >= 0, got {args.temperatures}")
    if args.limit is not None and args.limit < max(args.concurrency):
        p.error(f"--limit {args.limit} leaves clients idle at {max(args.concurrency)} clients")
    return args


def main(argv: list[str] | None = None) -> list:
    args = parse_args(argv)
    settings = BenchSettings(
        args.base_url.rstrip("/"),
        args.models,
        tuple(args.concurrency),
        tuple(args.temperatures),
        args.repeats,
        args.max_tokens,
        args.tokenizer,
        args.out,
        args.metrics_url,
        tuple(args.vllm_args),
    )
    runs = run_bench(settings, args.source, args.limit, lambda r: print(format_run(r), flush=True))
    print("\n" + format_table(summarize(runs, args.baseline), runs, args.baseline))
    return runs


if __name__ == "__main__":
    run(main)
