"""Reproducible sampling that does not depend on batching or on which worker runs it.

Every random draw is a pure function of a 64-bit key (derived from the run seed, the sequence,
the acceptance rule, the draw number and the divergence point) and a step counter, hashed with
splitmix64. The same tail therefore gets the same tokens whether it is sampled alone or packed
with a thousand others, on any node.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def stable_key(*parts: object) -> int:
    """A 63-bit key from any printable parts (stable across processes, unlike ``hash``)."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return z ^ (z >> np.uint64(31))


def uniforms(keys: np.ndarray, step: int) -> np.ndarray:
    """One uniform in [0, 1) per key for draw number ``step``."""
    with np.errstate(over="ignore"):
        step_hash = _splitmix64(np.full_like(keys, step, dtype=np.uint64))
        mixed = _splitmix64(keys.astype(np.uint64) ^ step_hash)
    return (mixed >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def sample_from_probs(probs: torch.Tensor, u: np.ndarray) -> torch.Tensor:
    """Inverse-CDF sampling, one row of ``probs`` per uniform (float64 for exactness)."""
    cdf = probs.detach().to("cpu", torch.float64).cumsum(dim=-1)
    cdf = cdf / cdf[:, -1:]
    draws = torch.from_numpy(u).view(-1, 1)
    idx = torch.searchsorted(cdf, draws, right=True).view(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def exclude_token(probs: torch.Tensor, forbidden: torch.Tensor) -> torch.Tensor:
    """Zero each row's forbidden token and renormalise; a row with no mass left becomes
    uniform over the other tokens (the draft was certain of the token it must not emit)."""
    out = probs.detach().to(torch.float64).clone()
    rows = torch.arange(out.shape[0], device=out.device)
    out[rows, forbidden.to(out.device)] = 0.0
    mass = out.sum(dim=-1, keepdim=True)
    empty = (mass <= 0).view(-1)
    if empty.any():
        out[empty] = 1.0
        out[rows[empty], forbidden.to(out.device)[empty]] = 0.0
        mass = out.sum(dim=-1, keepdim=True)
    return out / mass


def residual_probs(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``norm(max(q - p, 0))`` per row, in float64: where speculative sampling's rejected draft
    proposals fall. A row with no mass (q <= p everywhere) stays all zero for the caller."""
    out = (q.detach().to(torch.float64) - p.detach().to(torch.float64)).clamp_(min=0.0)
    mass = out.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, out / mass.clamp(min=torch.finfo(torch.float64).tiny), out)
