"""KV-cache helpers shared by extraction, calibration and the decoding engine."""

from __future__ import annotations

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
