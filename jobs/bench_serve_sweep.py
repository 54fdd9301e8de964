"""Serving sweep: the research endpoint (serving.app) and the vLLM app (vllm_serving: vLLM's
engine with ours (the cost-aware scheduler), with vLLM's draft_model at fixed K, with no
speculation) under 1, 2, 4, 8, 16 concurrent streaming clients, over ShareGPT (each
conversation's first human turn, a seeded sample) and HumanEval, in one run, interleaved (per
source and concurrency every system's cell before the next concurrency).

Per (source, system, clients) cell every prompt is posted once as a streaming completion; the
table gives requests, errors, completed requests/s, output tokens/s, p50/p99 latency (until
[DONE]) and p50/p99 time to first token (TTFT: until the first text chunk); then batched /
single ratios where both endpoint modes ran, and the vLLM app with ours against the
endpoint's best cell, vLLM's best fixed K and no speculation. Endpoint modes: `single`
(max_batch=1, round robin) and `batched` (max_batch=--max-batch: continuous batching), side by
side in a local Ray cluster; the vLLM app runs in the vLLM environment (`make vllm-env`) in a
Ray cluster of its own, one engine replica per --vllm setting. Both listen on the loopback.

    python -m jobs.bench_serve_sweep                      # 2 sources x 5 concurrencies x 6
    python -m jobs.bench_serve_sweep --source sharegpt --concurrency 8,16 --limit 64
    python -m jobs.bench_serve_sweep --no-vllm --modes single,batched \\
        --policies '[{"policy": "ar"}, {"policy": "fixed", "k": 2}, {"policy": "throughput"}]'

Results go to MLflow (experiment bench_serve_sweep: a metric per cell and ratio, sweep.json as
an artifact) and, with --out, to sweep.csv, ratios.csv, comparisons.csv and sweep.json there.
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
    add_out_arg,
    add_source_arg,
    add_temperature_arg,
    parser,
    ray_session,
    run,
)
from pipeline.bench.serve_sweep import MODES, SweepSettings, run_sweep
from pipeline.bench.serve_sweep_report import format_row, format_sweep, write_results
from pipeline.data.domains import load_prompts
from pipeline.decode.policies.registry import validate_knobs
from pipeline.tracking import tracked_run

DEFAULT_POLICIES = '[{"policy": "throughput"}]'  # the endpoint's default
DEFAULT_VLLM = "ours:k=4,draft_model:k=1..3,none"
VLLM_METHODS = ("ours", "draft_model", "ngram", "none")


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
    # None at all ('') measures the vLLM app alone.
    if any(m not in MODES for m in modes) or len(set(modes)) < len(modes):
        raise argparse.ArgumentTypeError(f"expected distinct modes of {', '.join(MODES)}")
    return modes


def _vllm_models(text: str) -> list[dict]:
    """'ours:k=4,draft_model:k=1..3,none' -> the vLLM app's model ids (ServedModel fields):
    k=A..B gives one per K; any other knob of ours is a scheduler setting."""
    from pipeline.vllm_spec.methods import _value

    models = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        name, *pairs = item.split(":")
        if name not in VLLM_METHODS:
            raise argparse.ArgumentTypeError(
                f"{item}: the vLLM app serves {', '.join(VLLM_METHODS)}"
            )
        knobs = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not key or key in knobs:
                raise argparse.ArgumentTypeError(f"{item}: knobs are distinct name=value")
            knobs[key] = value
        lo, sep, hi = knobs.pop("k", "").partition("..")
        try:
            ks = list(range(int(lo), int(hi) + 1)) if sep else [int(lo)] if lo else [None]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item}: k is an int or A..B") from None
        if (name == "none") != (ks == [None]) or (knobs and name != "ours"):
            raise argparse.ArgumentTypeError(
                f"{item}: none takes no knobs, the others k=K or k=A..B (and ours its "
                "scheduler settings)"
            )
        for k in ks:
            label = name + (f"-k{k}" if k is not None else "")
            label += "".join(f"-{key}{v}" for key, v in knobs.items())
            model = {"name": label, "speculation": name} | ({"k": k} if k is not None else {})
            models.append(
                model | ({"policy": {key: _value(v) for key, v in knobs.items()}} if knobs else {})
            )
    if not models:
        raise argparse.ArgumentTypeError("no vLLM settings given (--no-vllm skips the app)")
    if len({m["name"] for m in models}) < len(models):
        raise argparse.ArgumentTypeError(f"a setting is given twice: {text}")
    return models


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.bench_serve_sweep", __doc__)
    add_model_args(p)
    add_source_arg(p, many="sharegpt,humaneval")
    add_limit_arg(p, 32, "each posted once per cell (at least the most clients)")
    add_max_tokens_arg(p, 64)
    add_concurrency_arg(p, "1,2,4,8,16")
    p.add_argument(
        "--policies",
        type=_policies,
        default=_policies(DEFAULT_POLICIES),
        help=f"speculation settings, a JSON list (default {DEFAULT_POLICIES})",
    )
    p.add_argument(
        "--modes",
        type=_modes,
        default=["batched"],
        help="the endpoint's replica modes: single (max_batch=1), batched "
        "(max_batch=--max-batch); default batched",
    )
    p.add_argument(
        "--vllm",
        type=_vllm_models,
        default=_vllm_models(DEFAULT_VLLM),
        help="the vLLM app's speculation settings, each its own engine replica: ours (the "
        "cost-aware scheduler over vLLM's draft_model; other knobs are its settings, e.g. "
        "ours:k=4:design=fixed), draft_model, ngram, each with k=K or k=A..B, and none "
        f"(default {DEFAULT_VLLM})",
    )
    p.add_argument("--no-vllm", action="store_true", help="the endpoint only")
    p.add_argument("--max-batch", type=int, default=16, help="the batched mode's max_batch")
    add_temperature_arg(p)
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds per request, at the client and as the server's deadline",
    )
    p.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs per replica")
    add_num_cpus_arg(p)
    add_out_arg(p, None, "sweep.csv, ratios.csv and sweep.json (default: not written)")
    args = p.parse_args(argv)
    if args.no_vllm:
        args.vllm = []
    if not args.modes and not args.vllm:
        p.error("nothing to measure: give --modes or --vllm")
    if min(args.limit, args.max_tokens, args.max_batch) < 1 or args.timeout <= 0:
        p.error("--limit, --max-tokens and --max-batch must be >= 1, --timeout > 0")
    if min(args.concurrency) < 1:
        p.error(f"--concurrency: integers >= 1 like 1,2,4, got {args.concurrency}")
    if args.limit < max(args.concurrency):
        p.error(
            f"--limit {args.limit} leaves clients idle at {max(args.concurrency)} clients: "
            "give at least as many prompts as the most clients"
        )
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    sources = {s: [p.text for p in load_prompts(s, args.limit)] for s in args.source}
    for source, texts in sources.items():
        if len(texts) < max(args.concurrency):
            raise ValueError(f"{source} gave {len(texts)} prompts, fewer than the most clients")
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
        tuple(args.vllm),
    )
    print(f"{args.limit} prompts of {', '.join(sources)}; cells as they end:", flush=True)
    result = run_sweep(
        sources,
        settings,
        lambda: ray_session(num_cpus=args.num_cpus),
        lambda cell: print(format_row(cell.row()), flush=True),
    )
    print(format_sweep(result, ", ".join(sources)))
    if args.out is not None:
        print("\nwrote " + ", ".join(str(p) for p in write_results(result, args.out)))
    metrics = result.metrics()
    params = {
        **vars(args),
        "policies": json.dumps(args.policies),
        "vllm": json.dumps(args.vllm),
        "source": ",".join(args.source),
    }
    with tracked_run("bench_serve_sweep", params=params) as tracked:
        tracked.log_metrics(metrics)
        tracked.log_dict(result.to_json(), "sweep.json")
    return metrics


if __name__ == "__main__":
    run(main)
