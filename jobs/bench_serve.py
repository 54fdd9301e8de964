"""Serving benchmark: the Ray Serve endpoint with C concurrent clients against the in-process
engine generating the same prompts one after another, in one run: requests/s, generated
tokens/s, p50/p99 request latency, and the endpoint / in-process throughput ratio. Same models,
policy, sampling and token budget on both sides; for greedy decoding it also counts the
prompts whose text is identical on both sides.

The in-process side runs first with as many torch threads as a replica gets CPUs
(--replica-cpus), then the script starts its own local Ray cluster and Serve app on a free port
(or uses a running endpoint given with --url: then the model arguments must match it).

    python -m jobs.bench_serve                                  # 16 HumanEval prompts, 8 clients
    python -m jobs.bench_serve --limit 32 --concurrency 16 --max-tokens 64
    python -m jobs.bench_serve --url http://127.0.0.1:8000 --speculation '{"policy": "tree"}'
"""

from __future__ import annotations

import argparse
import json

from jobs.cli import (
    add_concurrency_arg,
    add_limit_arg,
    add_max_tokens_arg,
    add_model_args,
    add_num_cpus_arg,
    add_source_arg,
    add_temperature_arg,
    parser,
    ray_session,
    run,
)
from pipeline.bench.serve import ServeBenchSettings, format_serve_bench, run_serve_bench
from pipeline.data.domains import load_prompts
from pipeline.tracking import tracked_run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.bench_serve", __doc__)
    add_model_args(p)
    add_source_arg(p)
    add_limit_arg(p, 16)
    add_max_tokens_arg(p, 32)
    add_concurrency_arg(p, 8)
    add_temperature_arg(p)
    p.add_argument(
        "--speculation",
        default='{"policy": "fixed", "k": 4}',
        help="the request's speculation field as JSON: policy and knobs",
    )
    p.add_argument("--url", default=None, help="a running endpoint (else one is started here)")
    p.add_argument(
        "--replica-cpus",
        type=float,
        default=1.0,
        help="CPUs per replica; also the in-process torch threads on CPU",
    )
    add_num_cpus_arg(p)
    p.add_argument(
        "--max-batch",
        type=int,
        default=16,
        help="the replica's max_batch (1: one at a time, round robin)",
    )
    args = p.parse_args(argv)
    if min(args.limit, args.max_tokens, args.concurrency, args.max_batch) < 1:
        p.error("--limit, --max-tokens, --concurrency and --max-batch must be >= 1")
    try:
        spec = json.loads(args.speculation)
    except json.JSONDecodeError as exc:
        p.error(f"--speculation is not JSON: {exc}")
    if not isinstance(spec, dict) or "policy" not in spec:
        p.error('--speculation must be a JSON object with a "policy", e.g. {"policy": "ar"}')
    args.spec = spec
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    texts = [p.text for p in load_prompts(args.source, args.limit)]
    settings = ServeBenchSettings(
        args.target,
        args.draft,
        args.device,
        args.dtype,
        args.experts_implementation,
        args.spec,
        args.max_tokens,
        args.temperature,
        args.concurrency,
        args.replica_cpus,
        args.max_batch,
    )
    result = run_serve_bench(texts, settings, args.url, lambda: ray_session(num_cpus=args.num_cpus))
    print(format_serve_bench(result, args.source))
    metrics = result.metrics()
    with tracked_run(
        "bench_serve", params={k: v for k, v in vars(args).items() if k != "spec"}
    ) as tracked:
        tracked.log_metrics(metrics)
    return metrics


if __name__ == "__main__":
    run(main)
