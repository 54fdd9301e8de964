"""Serving sweep: the Ray Serve endpoint under 1, 2, 4, 8, 16 concurrent streaming clients, for
several speculation settings and for batched against one-at-a-time replicas, in one run, over a
conversational workload (ShareGPT: each conversation's first human turn, a seeded sample).

Per (mode, clients, policy) cell every prompt is posted once as a streaming completion; the
table gives requests, errors, completed requests/s, output tokens/s, p50/p99 latency (until
[DONE]) and p50/p99 time to first token (TTFT: until the first text chunk), then batched /
single ratios per (clients, policy). Modes: `single` (max_batch=1: one generation at a time,
round robin) and `batched` (max_batch=--max-batch: continuous batching), each its own app,
started here one after the other in a local Ray cluster on a free loopback port.

    python -m jobs.bench_serve_sweep                 # ShareGPT, 32 prompts x 64 tokens, 30 cells
    python -m jobs.bench_serve_sweep --concurrency 1,4,16 --limit 64 --max-tokens 128 \\
        --policies '[{"policy": "ar"}, {"policy": "fixed", "k": 2}, {"policy": "throughput"}]'
    python -m jobs.bench_serve_sweep --modes batched --source humaneval --out out/sweep

Results go to MLflow (experiment bench_serve_sweep: a metric per cell and ratio, sweep.json as
an artifact) and, with --out, to sweep.csv, ratios.csv and sweep.json there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jobs.cli import SOURCE_HELP, add_model_args, parser, ray_session, run
from pipeline.data.domains import load_prompts
from pipeline.decode.policies.registry import validate_knobs
from pipeline.tracking import tracked_run
from serving.sweep import MODES, SweepSettings, run_sweep
from serving.sweep_report import format_row, format_sweep, write_results

DEFAULT_POLICIES = '[{"policy": "ar"}, {"policy": "fixed", "k": 4}, {"policy": "throughput"}]'


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4: {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1 like 1,2,4: {text!r}")
    return values


def _policies(text: str) -> list[dict]:
    """A JSON list of request speculation fields, each checked against the registry."""
    try:
        specs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(specs, list) or not specs:
        raise argparse.ArgumentTypeError('expected a non-empty JSON list like [{"policy": "ar"}]')
    for spec in specs:
        if not isinstance(spec, dict) or not isinstance(spec.get("policy"), str):
            raise argparse.ArgumentTypeError(f'each item needs a "policy" name: {spec!r}')
        try:
            validate_knobs(spec["policy"], {k: v for k, v in spec.items() if k != "policy"})
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return specs


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) < len(modes):
        raise argparse.ArgumentTypeError(f"expected distinct modes of {', '.join(MODES)}")
    return modes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.bench_serve_sweep", __doc__)
    add_model_args(p)
    p.add_argument("--source", default="sharegpt", help=f"{SOURCE_HELP} (default: sharegpt)")
    p.add_argument(
        "--limit",
        type=int,
        default=32,
        help="prompts, each posted once per cell (at least the most clients)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request")
    p.add_argument(
        "--concurrency",
        type=_ints,
        default=[1, 2, 4, 8, 16],
        help="concurrent streaming clients, a comma list (default 1,2,4,8,16)",
    )
    p.add_argument(
        "--policies",
        type=_policies,
        default=_policies(DEFAULT_POLICIES),
        help=f"speculation settings, a JSON list (default {DEFAULT_POLICIES})",
    )
    p.add_argument(
        "--modes",
        type=_modes,
        default=list(MODES),
        help="replica modes in run order: single (max_batch=1), batched "
        "(max_batch=--max-batch); default single,batched",
    )
    p.add_argument("--max-batch", type=int, default=16, help="the batched mode's max_batch")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds per request, at the client and as the server's deadline",
    )
    p.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs per replica")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray cluster")
    p.add_argument(
        "--out", type=Path, default=None, help="directory for sweep.csv, ratios.csv and sweep.json"
    )
    args = p.parse_args(argv)
    if min(args.limit, args.max_tokens, args.max_batch) < 1 or args.timeout <= 0:
        p.error("--limit, --max-tokens and --max-batch must be >= 1, --timeout > 0")
    if args.limit < max(args.concurrency):
        p.error(
            f"--limit {args.limit} leaves clients idle at {max(args.concurrency)} clients: "
            "give at least as many prompts as the most clients"
        )
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    texts = [p.text for p in load_prompts(args.source, args.limit)]
    if len(texts) < max(args.concurrency):
        raise ValueError(f"{args.source} gave {len(texts)} prompts, fewer than the most clients")
    settings = SweepSettings(
        args.target,
        args.draft,
        args.device,
        args.dtype,
        args.experts_implementation,
        tuple(args.policies),
        tuple(args.concurrency),
        tuple(args.modes),
        args.max_tokens,
        args.temperature,
        args.replica_cpus,
        args.max_batch,
        args.timeout,
    )
    print(f"{len(texts)} {args.source} prompts; cells as they end:", flush=True)
    result = run_sweep(
        texts,
        settings,
        lambda: ray_session(num_cpus=args.num_cpus),
        lambda cell: print(format_row(cell.row()), flush=True),
    )
    print(format_sweep(result, args.source))
    if args.out is not None:
        print("\nwrote " + ", ".join(str(p) for p in write_results(result, args.out)))
    metrics = result.metrics()
    params = {**vars(args), "policies": json.dumps(args.policies)}
    with tracked_run("bench_serve_sweep", params=params) as tracked:
        tracked.log_metrics(metrics)
        tracked.log_dict(result.to_json(), "sweep.json")
    return metrics


if __name__ == "__main__":
    run(main)
