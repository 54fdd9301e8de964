"""The one source of randomness of decoding: every draw a generation makes (the draft's
samples, the acceptance coins, the residual and bonus draws) goes through a RandomSource.

The default draws from a seeded torch.Generator (the same seed gives the same generation). A
test can pass its own source, e.g. one that replays scripted outcomes so that every branch of
a generation can be enumerated exactly (tests/test_lossless_sampling.py).
"""

from __future__ import annotations

from typing import Protocol

import torch


class RandomSource(Protocol):
    def categorical(self, probs: torch.Tensor) -> int:
        """An index drawn with probability proportional to ``probs`` (1-D, >= 0)."""
        ...

    def bernoulli(self, p: float) -> bool:
        """True with probability ``p`` (clipped to [0, 1])."""
        ...


class TorchRandom:
    """Draws from a seeded torch.Generator on the host."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def categorical(self, probs: torch.Tensor) -> int:
        # Moved and cast only when they must be: this runs once per drafted token, right after
        # a forward, where even a call that does nothing costs microseconds.
        if probs.requires_grad or not probs.is_cpu or probs.dtype != torch.float32:
            probs = probs.detach().cpu().float()
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def bernoulli(self, p: float) -> bool:
        # rand is in [0, 1): p >= 1 is always True, p <= 0 never.
        return float(torch.rand((), generator=self.generator)) < p
