"""KV-cache helpers shared by extraction, calibration and the decoding engine."""

from __future__ import annotations

import torch
from transformers import Cache


def crop_to(cache: Cache, length: int) -> None:
    """Keep the first ``length`` positions of ``cache``.

    transformers 5 ``Cache.crop`` takes the (negative) number of tokens to remove, not the length
    to keep; this wrapper says what callers mean.
    """
    excess = cache.get_seq_length() - length
    if excess < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} tokens to {length}")
    if excess:
        cache.crop(-excess)


def keep_positions(cache: Cache, base_len: int, extra: list[int]) -> None:
    """Keep the first ``base_len`` positions plus the positions ``base_len + j`` for j in
    ``extra`` (in that order): the accepted path of a verified tree, which need not be
    contiguous in the cache."""
    if extra == list(range(len(extra))):
        crop_to(cache, base_len + len(extra))
        return
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False) or layer.keys is None:
            continue
        idx = torch.tensor(
            list(range(base_len)) + [base_len + j for j in extra], device=layer.keys.device
        )
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)
