"""jobs.calibrate_random's measurement without its MLflow logging (the device machine has no
mlflow): the Qwen3-30B-A3B layout with random weights, forced routing, fitted per m.

    PYTHONPATH=. python docs/results/gpu_h200_2026-12-04/real_shape_on_device.py OUT \
        [experts_implementation] [repeats] [scale-down JSON, for a CPU smoke run]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from pipeline.cost.random_report import format_report
from pipeline.cost.random_target import run_random_calibration
from pipeline.models.random_moe import layout_config


def main(out: str, experts: str = "grouped_mm", repeats: str = "5", scale: str = "{}") -> None:
    overrides = json.loads(scale)
    config = layout_config("qwen3-30b-a3b", **overrides)
    on_gpu = not overrides
    started = time.perf_counter()
    result = run_random_calibration(
        config,
        "cuda" if on_gpu else "cpu",
        "bfloat16" if on_gpu else "float32",
        experts,
        range(1, 14) if on_gpu else range(1, 5),
        [128, 512, 1024] if on_gpu else [64, 128],
        2,
        int(repeats),
        8,
        Path(out),
        0,
        log=lambda line: print(line, flush=True),
        layout="qwen3-30b-a3b" + (f" (scaled: {overrides})" if overrides else ""),
    )
    print()
    print(format_report(result))
    print(f"\n{time.perf_counter() - started:.0f} s; wrote {[p.name for p in result.paths]}")


if __name__ == "__main__":
    main(*sys.argv[1:])
