"""U(i, k, a) per sequence straight from the extraction tables (tokens, tails)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.data.schemas import experts_to_numpy
from pipeline.models.adapters import MoESpec
from pipeline.oracle.expert_union import bitmasks, union_table_paper, union_table_shared


def tail_draws(tails: pa.Table) -> dict[str, list[int]]:
    """The independent tail draws of each acceptance rule a tails table holds. Tables written
    before tails carried ``acceptance`` / ``draw`` hold one surrogate draw."""
    if "acceptance" not in tails.column_names:
        return {"surrogate": [0]} if tails.num_rows else {}
    out: dict[str, list[int]] = {}
    for row in tails.group_by(["acceptance", "draw"]).aggregate([]).to_pylist():
        out.setdefault(row["acceptance"], []).append(int(row["draw"]))
    return {acc: sorted(d) for acc, d in sorted(out.items())}


def sequence_union_table(
    tokens: pa.Table,
    tails: pa.Table,
    spec: MoESpec,
    lmax: int,
    acceptance: str | None = None,
    draw: int = 0,
) -> np.ndarray:
    """``[N, lmax + 1, lmax + 1]`` U table (k = 0..lmax) of one sequence from its own rows of
    tokens and tails, priced with the tails of ``acceptance`` (tails.acceptance == it) and
    ``draw``. ``acceptance=None`` is allowed when the tails hold a single acceptance rule."""
    tokens = tokens.sort_by("t")
    if "acceptance" in tails.column_names:
        present = sorted(set(tails.column("acceptance").to_pylist()))
        if acceptance is None:
            if len(present) > 1:
                raise ValueError(f"tails hold acceptances {present}: name the one to price")
            acceptance = present[0] if present else None
        if acceptance is not None:
            keep = pc.and_(
                pc.equal(tails.column("acceptance"), acceptance),
                pc.equal(tails.column("draw"), draw),
            )
            tails = tails.filter(keep)
    elif acceptance not in (None, "surrogate") or draw != 0:
        raise ValueError(
            f"these tails predate acceptance rules (one surrogate draw): no "
            f"{acceptance} draw {draw}; re-extract"
        )
    n = tokens.num_rows - 1
    if n > 0 and tails.num_rows == 0:
        raise ValueError(f"no {acceptance} tails of draw {draw} for this sequence")
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
