"""Wall time of model calls: CUDA events on GPU, perf_counter around synchronised calls on CPU."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def timed(device: torch.device, fn: Callable[[], T]) -> tuple[T, float]:
    """Run ``fn`` and return (result, milliseconds)."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return result, float(start.elapsed_time(end))
    started = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - started) * 1e3
