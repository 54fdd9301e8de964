"""A vLLM step's rows as its attention metadata (``CommonAttentionMetadata``) describes them,
for the catch-up drafter and the runner's shortcut (pipeline.vllm_spec.catch_up_draft,
pipeline.vllm_spec.free_when_off)."""

from __future__ import annotations

import numpy as np


def step_rows(cad) -> tuple[np.ndarray, np.ndarray]:
    """Each row's first position this step (its computed tokens) and its scheduled tokens."""
    batch = cad.batch_size()
    lens = cad.naive_query_lens()[:batch].cpu().numpy().astype(np.int64)
    starts = cad.seq_lens[:batch].cpu().numpy().astype(np.int64) - lens
    return starts, lens


def block_ids(cad) -> np.ndarray:
    """The block table of the step's rows (physical block ids, one row per request)."""
    return cad.block_table_tensor[: cad.batch_size()].cpu().numpy()
