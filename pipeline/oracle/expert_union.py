"""U(i, k, a): the mean over MoE layers of the unique experts a verification pass loads
(docs/contract.md, "Expert union"), for every cell at once with bitmask unions.

Expert sets are bitmasks (``ceil(E / 64)`` uint64 words per layer), unions are ORs, sizes are
popcounts. Windows of reference tokens and prefixes of tails are cumulative ORs along a
sliding-window view, so there is no Python loop over k or a.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def bitmasks(routing: np.ndarray, num_experts: int) -> np.ndarray:
    """``[rows, layers, top_k]`` expert ids -> ``[rows, layers, words]`` uint64 bitmasks."""
    rows, layers, _ = routing.shape
    words = (num_experts + 63) // 64
    out = np.zeros((rows, layers, words), dtype=np.uint64)
    ids = routing.astype(np.int64)
    bits = np.left_shift(np.uint64(1), (ids % 64).astype(np.uint64))
    r, lay, _ = np.indices(routing.shape)
    np.bitwise_or.at(out, (r, lay, ids // 64), bits)
    return out


def mean_popcount(masks: np.ndarray) -> np.ndarray:
    """Mean over layers of the set sizes: ``[..., layers, words]`` -> ``[...]``."""
    return np.bitwise_count(masks).sum(axis=-1).mean(axis=-1)


def reference_unions(token_masks: np.ndarray, lmax: int) -> np.ndarray:
    """``R[i, a]`` = union of the experts of x_i .. x_{i+a}, a = 0..lmax, zero-padded past x_N.

    ``token_masks`` is ``[N + 1, layers, words]`` for x_0..x_N; returns
    ``[N, lmax + 1, layers, words]`` for states i = 0..N-1.
    """
    n_plus_1, layers, words = token_masks.shape
    padded = np.concatenate([token_masks, np.zeros((lmax, layers, words), dtype=np.uint64)], axis=0)
    windows = sliding_window_view(padded, lmax + 1, axis=0)[: n_plus_1 - 1]
    return np.moveaxis(np.bitwise_or.accumulate(windows, axis=-1), -1, 1)


def union_table_shared(
    token_masks: np.ndarray,
    tail_masks: np.ndarray,
    tail_s: np.ndarray,
    tail_r: np.ndarray,
    lmax: int,
) -> np.ndarray:
    """U for every cell from shared tails: ``[N, lmax + 1, lmax + 1]`` indexed ``[i, k, a]``,
    k = 0..lmax (k = 0: the plain step, U(i, 0, 0) = mean_l |E_l(i)|), NaN where the cell does
    not exist (k > N - i or a > k).

    ``tail_masks[j]`` is tail token j at divergence point ``tail_s[j]``, position ``tail_r[j]``.
    """
    n = token_masks.shape[0] - 1
    layers, words = token_masks.shape[1:]
    ref = reference_unions(token_masks, lmax)
    # Cumulative union of each divergence point's tail, J[s, r - 1] = J(s, 1..r).
    tails = np.zeros((n, lmax, layers, words), dtype=np.uint64)
    tails[tail_s, tail_r - 1] = tail_masks
    tails = np.bitwise_or.accumulate(tails, axis=1)
    i, k, a = _cells(n, lmax)
    union = ref[i, a]
    partial = a < k
    union[partial] |= tails[(i + a)[partial], (k - a)[partial] - 1]
    return _scatter(n, lmax, i, k, a, mean_popcount(union))


def union_table_paper(
    token_masks: np.ndarray,
    tail_masks: np.ndarray,
    tail_i: np.ndarray,
    tail_k: np.ndarray,
    tail_a: np.ndarray,
    lmax: int,
) -> np.ndarray:
    """U for every cell from independent (paper-mode) tails, one tail per cell with a < k;
    shaped and indexed as union_table_shared's."""
    n = token_masks.shape[0] - 1
    ref = reference_unions(token_masks, lmax)
    i, k, a = _cells(n, lmax)
    union = ref[i, a]
    if len(tail_masks) and (tail_k.max() > lmax or tail_a.max() >= lmax):
        raise ValueError(f"paper-mode tails include cells beyond Lmax {lmax}: filter them first")
    if len(tail_masks):
        # Reduce each cell's tail tokens to one mask: sort rows by cell, OR within runs.
        cell_id = (tail_i * (lmax + 1) + tail_k) * (lmax + 1) + tail_a
        order = np.argsort(cell_id, kind="stable")
        sorted_ids = cell_id[order]
        starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
        reduced = np.bitwise_or.reduceat(tail_masks[order], starts, axis=0)
        partial = np.flatnonzero(a < k)
        want = (i[partial] * (lmax + 1) + k[partial]) * (lmax + 1) + a[partial]
        idx = np.searchsorted(sorted_ids[starts], want)
        if not np.array_equal(sorted_ids[starts][np.minimum(idx, len(starts) - 1)], want):
            raise ValueError("paper-mode tails are missing for some (i, k, a) cells")
        union[partial] |= reduced[idx]
    return _scatter(n, lmax, i, k, a, mean_popcount(union))


def _cells(n: int, lmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every valid (i, k, a): 0 <= i < N, 0 <= k <= min(lmax, N - i), 0 <= a <= k."""
    i, k, a = np.meshgrid(np.arange(n), np.arange(lmax + 1), np.arange(lmax + 1), indexing="ij")
    valid = (k <= n - i) & (a <= k)
    return i[valid], k[valid], a[valid]


def _scatter(n: int, lmax: int, i, k, a, values: np.ndarray) -> np.ndarray:
    out = np.full((n, lmax + 1, lmax + 1), np.nan)
    out[i, k, a] = values
    return out
