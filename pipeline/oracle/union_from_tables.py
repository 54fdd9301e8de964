"""U(i, k, a) per sequence straight from the extraction tables (tokens, tails)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.data.schemas import experts_to_numpy
from pipeline.models.adapters import MoESpec
from pipeline.oracle.expert_union import bitmasks, union_table_paper, union_table_shared


def sequence_union_table(tokens: pa.Table, tails: pa.Table, spec: MoESpec, lmax: int) -> np.ndarray:
    """``[N, lmax, lmax + 1]`` U table of one sequence (its own rows of tokens and tails)."""
    tokens = tokens.sort_by("t")
    # An extraction for a larger Lmax holds longer tails (and, in paper mode, cells with k >
    # lmax) than this Lmax uses: keep only what the cells up to lmax read.
    if tails.num_rows:
        paper_cells = pc.fill_null(pc.less_equal(tails.column("k"), lmax), True)
        tails = tails.filter(pc.and_(pc.less_equal(tails.column("r"), lmax), paper_cells))
    shape = (spec.num_moe_layers, spec.top_k)
    token_masks = bitmasks(experts_to_numpy(tokens.column("experts"), *shape), spec.num_experts)
    tail_masks = bitmasks(experts_to_numpy(tails.column("experts"), *shape), spec.num_experts)
    modes = set(tails.column("mode").to_pylist())
    if modes - {"shared", "paper"} or len(modes) > 1:
        raise ValueError(f"tails of one sequence must come from one mode, got {sorted(modes)}")
    col = lambda name: tails.column(name).to_numpy().astype(np.int64)  # noqa: E731
    if modes == {"paper"}:
        return union_table_paper(token_masks, tail_masks, col("i"), col("k"), col("a"), lmax)
    return union_table_shared(token_masks, tail_masks, col("s"), col("r"), lmax)
