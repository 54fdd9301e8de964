"""Calibrate the verification cost of a real-shape MoE target with random weights.

Builds the model of a layout (default Qwen3-30B-A3B: 48 layers x 128 experts, top-8, about
30.5e9 parameters) or of a local config.json straight on the device with random weights, so no
checkpoint is downloaded. It then times designed verification passes: the routing is forced to
every union size U (unique experts per MoE layer) at every m (positions per pass), at random
contexts of each length, shuffled. The fit is T_T = beta0(m) + alpha(m) U + c L on the cells'
medians (clustered SEs, GroupKFold out-of-sample R2 / MAPE). Forced routing makes the cost
the model's own whatever its weights are.

Writes designed_rounds.parquet, cells.csv, fit_per_m.csv and target_fit.json under --out, and
compares alpha(m) with the paper's A100 figures (about 0.08 ms/expert for m <= 4, 0.27 for
m >= 5). Only the full layout in bfloat16 on a GPU is comparable with them. Logged to MLflow
(experiment calibrate_random).

The full layout needs about 61 GB of GPU memory in bfloat16:

    python -m jobs.calibrate_random --layout qwen3-30b-a3b --device cuda --dtype bfloat16 \\
        --experts-implementation grouped_mm --ms 1-13 --contexts 128,512,1024 --repeats 5 \\
        --out out/calibrate_random

A CPU run must scale the layout down (the job refuses a model that does not fit in memory):

    python -m jobs.calibrate_random --device cpu --threads 1 --layers 2 --experts 16 \\
        --hidden 256 --heads 4 --kv-heads 2 --head-dim 64 --moe-intermediate 128 \\
        --intermediate 512 --vocab 4096 --ms 1-6 --contexts 64,256 --per-length 3 --repeats 3 \\
        --out out/calibrate_random_cpu
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers import PretrainedConfig

from jobs.cli import (
    add_device_args,
    add_out_arg,
    add_repeats_arg,
    add_seed_arg,
    add_threads_arg,
    parse_ks,
    parser,
    run,
    torch_threads,
)
from pipeline.cost.random_report import fit_metrics, format_report
from pipeline.cost.random_target import run_random_calibration
from pipeline.models.adapters import adapter_for
from pipeline.models.random_moe import LAYOUTS, layout_config
from pipeline.tracking import tracked_run, tracking_uri

# Scale-down flags -> config fields; None: the family's own key (adapters.FamilyAdapter).
SCALE_FLAGS: dict[str, str | None] = {
    "layers": "num_hidden_layers",
    "experts": None,
    "top_k": None,
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "moe_intermediate": "moe_intermediate_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab": "vocab_size",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.calibrate_random", __doc__)
    p.add_argument(
        "--layout",
        default="qwen3-30b-a3b",
        choices=sorted(LAYOUTS),
        help="named model layout (qwen3-30b-a3b)",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="a local config.json (or a directory with one) instead of --layout",
    )
    scale = p.add_argument_group("scale-down overrides (config fields; needed on a CPU)")
    for flag, field in SCALE_FLAGS.items():
        what = field or (
            "routed experts per MoE layer" if flag == "experts" else "experts per token (top-k)"
        )
        scale.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None, help=what)
    scale.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="any other config field (VALUE read as JSON), repeatable",
    )
    add_device_args(p)
    p.add_argument(
        "--ms",
        type=parse_ks,
        default=parse_ks("1-13"),
        help="positions per verification pass m (1-13: K = 0..12)",
    )
    p.add_argument(
        "--contexts",
        default="128,512,1024",
        help="context lengths in tokens, comma-separated (128,512,1024)",
    )
    p.add_argument("--per-length", type=int, default=2, help="random contexts at each length (2)")
    add_repeats_arg(p, 5, "timed passes per (context, m, U) cell, shuffled")
    p.add_argument(
        "--max-levels",
        type=int,
        default=8,
        help="U levels per m, evenly spaced over the feasible range (8)",
    )
    add_threads_arg(p, None, "for the timings; recorded")
    add_seed_arg(p, "of the weights, contexts, designs and order")
    add_out_arg(p, Path("out/calibrate_random"))
    args = p.parse_args(argv)
    if args.ms[0] < 1:
        p.error("--ms must be >= 1 (positions per pass)")
    try:
        args.contexts = sorted({int(x) for x in args.contexts.split(",") if x.strip()})
    except ValueError:
        p.error(f"--contexts: {args.contexts!r} is not comma-separated integers")
    if not args.contexts or args.contexts[0] < 2:
        p.error("--contexts must be lengths >= 2 tokens")
    if args.per_length < 1 or args.repeats < 1:
        p.error("--per-length and --repeats must be >= 1")
    if args.max_levels < 2:
        p.error("--max-levels must be >= 2 (U must vary to identify alpha)")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    for flag in SCALE_FLAGS:
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    args.overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            p.error(f"--set {item!r}: expected FIELD=VALUE")
        try:
            args.overrides[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            args.overrides[key.strip()] = value  # a bare string
    if len(args.contexts) * args.per_length * len(args.ms) < 2:
        p.error("the fit needs >= 2 (context, m) groups: more --contexts, --per-length or --ms")
    return args


def build_config(args: argparse.Namespace) -> tuple[PretrainedConfig, dict[str, object]]:
    """The layout (or --config) with the scale-down flags applied under the family's names."""
    source = args.config if args.config is not None else args.layout
    adapter = adapter_for(layout_config(source))
    overrides = dict(args.overrides)
    for flag, field in SCALE_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            key = field or (adapter.num_experts_key if flag == "experts" else adapter.top_k_key)
            overrides[key] = value
    return layout_config(source, **overrides), overrides


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with torch_threads(args.threads):
        return _calibrate(args)


def _calibrate(args: argparse.Namespace) -> dict:
    config, overrides = build_config(args)
    layout = str(args.config) if args.config is not None else args.layout
    if overrides:
        layout += " (scaled: " + ", ".join(f"{k}={v}" for k, v in overrides.items()) + ")"
    result = run_random_calibration(
        config,
        args.device,
        args.dtype,
        args.experts_implementation,
        args.ms,
        args.contexts,
        args.per_length,
        args.repeats,
        args.max_levels,
        args.out,
        args.seed,
        log=lambda line: print(line, flush=True),
        layout=layout,
    )
    params = {
        **{k: str(v) for k, v in vars(args).items() if k not in ("set", "overrides")},
        "overrides": overrides,
        **result.meta,
    }
    with tracked_run("calibrate_random", params=params) as tracked:
        tracked.log_metrics(fit_metrics(result))
        for path in result.paths:
            tracked.log_artifact(str(path))
        run_id = tracked.run_id

    print()
    print(format_report(result))
    print(
        f"\nwrote {', '.join(p.name for p in result.paths)} under {args.out}; MLflow run "
        f"{run_id} at {tracking_uri()}"
    )
    return {"result": result, "out": str(args.out), "run_id": run_id}


if __name__ == "__main__":
    run(main)
