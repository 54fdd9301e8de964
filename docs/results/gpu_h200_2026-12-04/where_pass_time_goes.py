"""Where a verification pass's time goes on the device: wall time per pass against the GPU's
own kernel time in it (torch.profiler), for the Qwen3-30B-A3B layout with fewer layers (the
per-layer work is the full layout's), random weights, natural routing, 512-token context.

    PYTHONPATH=. python docs/results/gpu_h200_2026-12-04/where_pass_time_goes.py [layers]
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from pipeline.models.kvcache import crop_to
from pipeline.models.random_moe import build_random_moe, layout_config


def one_pass(model, ids: torch.Tensor, cache: DynamicCache) -> None:
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    crop_to(cache, 512)


def main(layers: int = 8) -> None:
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    small = (
        {}
        if cuda
        else {
            "hidden_size": 256,
            "num_experts": 16,
            "vocab_size": 4096,
            "moe_intermediate_size": 128,
            "intermediate_size": 512,
        }
    )
    config = layout_config("qwen3-30b-a3b", num_hidden_layers=layers, **small)
    for impl in ("grouped_mm", "eager"):
        model = build_random_moe(config, dev, torch.bfloat16 if cuda else torch.float32, impl)
        gen = torch.Generator(device="cpu").manual_seed(0)
        ctx = torch.randint(0, config.vocab_size, (1, 512), generator=gen).to(dev)
        with torch.no_grad():
            cache = DynamicCache()
            model(input_ids=ctx, past_key_values=cache, use_cache=True)
            for m in (1, 4, 13):
                ids = torch.randint(0, config.vocab_size, (1, m), generator=gen).to(dev)

                for _ in range(3):
                    one_pass(model, ids, cache)
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(10):
                    one_pass(model, ids, cache)
                if cuda:
                    torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) / 10 * 1e3
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with profile(activities=acts) as prof:
                    one_pass(model, ids, cache)
                    if cuda:
                        torch.cuda.synchronize()
                events = prof.key_averages()
                gpu = sum(e.self_device_time_total for e in events) / 1e3 if cuda else float("nan")
                launches = sum(e.count for e in events if e.key.startswith("cudaLaunchKernel"))
                print(
                    f"{impl:10s} layers {layers} m {m:2d}: wall {wall:7.2f} ms/pass, GPU "
                    f"kernels {gpu:6.2f} ms, kernel launches {launches}, per layer wall "
                    f"{wall / layers:.2f} ms",
                    flush=True,
                )
        del model, cache
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
