"""A vLLM step's rows as its attention metadata (``CommonAttentionMetadata``) describes them,
for the catch-up drafter and the runner's shortcut (pipeline.vllm_spec.catch_up_draft,
pipeline.vllm_spec.free_when_off)."""

from __future__ import annotations

import numpy as np


def step_rows(cad) -> tuple[np.ndarray, np.ndarray]:
    """Each row's first position this step (its computed tokens) and its scheduled tokens."""
    batch = cad.batch_size()
    # One copy of each to host arrays, then numpy: torch's per-op overhead at every step
    # was a visible part of what a step at k = 0 cost over no speculation.
    lens = np.diff(cad.query_start_loc[: batch + 1].cpu().numpy()).astype(np.int64)
    starts = cad.seq_lens[:batch].cpu().numpy().astype(np.int64) - lens
    return starts, lens


def block_ids(cad) -> np.ndarray:
    """The block table of the step's rows (physical block ids, one row per request)."""
    return cad.block_table_tensor[: cad.batch_size()].cpu().numpy()
