"""Where a verification pass's time goes on the device: wall time per pass against the
device's own kernel time in it (torch.profiler), for a real-shape layout with fewer layers (the
per-layer work is the full layout's), random weights, natural routing, a fixed context.

    python -m tools.where_pass_time_goes --layers 8          # cuda when present, bfloat16

On a CPU the layout is also scaled down in width (hidden 256, 16 experts, vocab 4096) and the
kernel column reads nan: only the wall time and the call counts mean anything there.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from jobs.cli import add_device_args, add_repeats_arg, parse_ks, parser, run
from pipeline.models.kvcache import crop_to
from pipeline.models.loading import EXPERTS_IMPLEMENTATIONS, pick_device, pick_dtype
from pipeline.models.random_moe import LAYOUTS, build_random_moe, layout_config

# A CPU cannot hold the full width: the same layout, narrower.
CPU_SCALE = {
    "hidden_size": 256,
    "num_experts": 16,
    "vocab_size": 4096,
    "moe_intermediate_size": 128,
    "intermediate_size": 512,
}


def one_pass(model, ids: torch.Tensor, cache: DynamicCache, context: int) -> None:
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    crop_to(cache, context)


def profile_passes(
    config,
    device: torch.device,
    dtype: torch.dtype,
    impl: str,
    context: int,
    ms: list[int],
    warmup: int,
    repeats: int,
) -> list[dict]:
    """For each m: the mean wall ms of ``repeats`` passes after ``warmup``, then one pass
    profiled: its device kernel ms (nan off a GPU) and kernel launches."""
    cuda = device.type == "cuda"
    model = build_random_moe(config, device, dtype, impl)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ctx = torch.randint(0, config.vocab_size, (1, context), generator=gen).to(device)
    rows = []
    with torch.no_grad():
        cache = DynamicCache()
        model(input_ids=ctx, past_key_values=cache, use_cache=True)
        for m in ms:
            ids = torch.randint(0, config.vocab_size, (1, m), generator=gen).to(device)
            for _ in range(warmup):
                one_pass(model, ids, cache, context)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(repeats):
                one_pass(model, ids, cache, context)
            if cuda:
                torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / repeats * 1e3
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                one_pass(model, ids, cache, context)
                if cuda:
                    torch.cuda.synchronize()
            events = prof.key_averages()
            kernels = sum(e.self_device_time_total for e in events) / 1e3 if cuda else float("nan")
            launches = sum(e.count for e in events if e.key.startswith("cudaLaunchKernel"))
            rows.append(
                {"impl": impl, "m": m, "wall_ms": wall, "kernel_ms": kernels, "launches": launches}
            )
    del model, cache
    if cuda:
        torch.cuda.empty_cache()
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("tools.where_pass_time_goes", __doc__)
    p.add_argument(
        "--layout", default="qwen3-30b-a3b", choices=sorted(LAYOUTS), help="(qwen3-30b-a3b)"
    )
    p.add_argument("--layers", type=int, default=8, help="decoder layers kept (8)")
    add_device_args(p)  # --dtype auto: bfloat16 on a GPU, float32 on a CPU
    p.add_argument(
        "--impls",
        default="grouped_mm,eager",
        help="experts implementations, comma-separated, each profiled in turn (grouped_mm,eager)",
    )
    p.add_argument("--context", type=int, default=512, help="context tokens before each pass (512)")
    p.add_argument("--ms", type=parse_ks, default="1,4,13", help="positions per pass m (1,4,13)")
    p.add_argument("--warmup", type=int, default=3, help="untimed passes per m first (3)")
    add_repeats_arg(p, 10, "timed passes per m")
    args = p.parse_args(argv)
    args.impls = [x.strip() for x in args.impls.split(",") if x.strip()]
    if not args.impls or set(args.impls) - set(EXPERTS_IMPLEMENTATIONS):
        p.error(f"--impls: names among {', '.join(EXPERTS_IMPLEMENTATIONS)}")
    if min(args.layers, args.context, args.repeats, args.ms[0]) < 1 or args.warmup < 0:
        p.error("--layers, --context, --repeats and --ms must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = pick_device(args.device)
    dtype = pick_dtype(device, args.dtype)
    small = {} if device.type == "cuda" else CPU_SCALE
    config = layout_config(args.layout, num_hidden_layers=args.layers, **small)
    for impl in args.impls:
        rows = profile_passes(
            config, device, dtype, impl, args.context, args.ms, args.warmup, args.repeats
        )
        for r in rows:
            print(
                f"{impl:10s} layers {args.layers} m {r['m']:2d}: wall {r['wall_ms']:7.2f} "
                f"ms/pass, GPU kernels {r['kernel_ms']:6.2f} ms, kernel launches "
                f"{r['launches']}, per layer wall {r['wall_ms'] / args.layers:.2f} ms",
                flush=True,
            )


if __name__ == "__main__":
    run(main)
