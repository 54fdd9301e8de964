"""Every table the stages exchange (docs/contract.md), in one place: the Parquet schemas and
the codec of the ``experts`` column (``list<list<int16>>``: MoE layers x top-k expert ids).
docs/contract.md states every column."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

EXPERTS_TYPE = pa.list_(pa.list_(pa.int16()))

# extraction (pipeline.extract)
SEQUENCES_SCHEMA = pa.schema(
    [
        ("seq_id", pa.string()),
        ("category", pa.string()),
        ("prompt_len", pa.int32()),
        ("n_tokens", pa.int32()),
        ("source", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
    ]
)
TOKENS_SCHEMA = pa.schema(
    [
        ("seq_id", pa.string()),
        ("t", pa.int32()),
        ("token_id", pa.int32()),
        # P_draft(x_t | x_<t) at the extraction's temperature; null at t = 0 (x_0: the prompt's)
        ("draft_prob", pa.float32()),
        ("draft_match", pa.bool_()),  # argmax of the draft at x_<t equals x_t; null at t = 0
        # P_target(x_t | x_<t) at the same temperature; null at t = 0
        ("target_prob", pa.float32()),
        ("experts", EXPERTS_TYPE),  # [MoE layers][top-k] experts the target selected for x_t
    ]
)
TAILS_SCHEMA = pa.schema(
    [
        ("seq_id", pa.string()),
        ("mode", pa.string()),
        ("acceptance", pa.string()),  # surrogate | greedy | sampling: the rule y_1 follows
        ("draw", pa.int32()),  # independent tail draw, 0-based (greedy: 0 only)
        ("s", pa.int32()),  # divergence point: the tail follows x_0..x_s
        ("r", pa.int32()),  # 1-based position in the tail
        ("token_id", pa.int32()),
        ("experts", EXPERTS_TYPE),
        ("i", pa.int32()),  # paper mode: the (i, k, a) cell the tail belongs to; null if shared
        ("k", pa.int32()),
        ("a", pa.int32()),
    ]
)
# Draft trees for the tree bound (pipeline.extract.draft_trees): one row per node
# a selection rule verifies at state i, in selection order (any first k rows are the tree of
# budget gamma = k + 1), with the target's routing of the node (teacher-forced on the path).
TREES_SCHEMA = pa.schema(
    [
        ("seq_id", pa.string()),
        ("rule", pa.string()),  # selection rule and its tree: eagle2-b2, ecospec-b2-d3, ...
        ("i", pa.int32()),  # the state: x_0..x_i committed, x_i the root
        ("j", pa.int32()),  # 1-based selection rank
        ("parent", pa.int32()),  # the parent's rank, 0: the root x_i
        ("depth", pa.int32()),  # 1-based: the node is a candidate for x_{i + depth}
        ("token_id", pa.int32()),
        ("path_prob", pa.float32()),  # the draft's probability of the node's path from the root
        ("on_path", pa.bool_()),  # the node's path is x_{i+1}..x_{i+depth} (greedy: accepted)
        ("experts", EXPERTS_TYPE),
    ]
)

# calibration (pipeline.cost)
ROUNDS_SCHEMA = pa.schema(
    [
        ("gen_id", pa.string()),
        ("category", pa.string()),
        ("k", pa.int32()),
        ("m", pa.int32()),
        ("t_target_ms", pa.float64()),
        ("t_draft_ms", pa.float64()),
        # Draft forward passes of the round, what T_D prices: k for a fixed chain, k + 1 for a
        # look round (k tokens, then one more distribution looked at; k = 0: one look), 0 at AR.
        ("draft_forwards", pa.int32()),
        ("u_bar", pa.float64()),
        ("ctx_len", pa.int32()),  # L = L_prompt + i: committed tokens before the round
        ("kv_tokens", pa.int32()),  # target KV-cache length before the pass
        ("kv_occupancy", pa.float64()),  # kv_tokens / max positions
        ("accepted", pa.int32()),
        ("round", pa.int32()),  # index of the round within its generation
        ("temperature", pa.float64()),  # the round's decoding mode: 0 greedy, > 0 sampled
        ("t_accept_ms", pa.float64()),  # the target's distributions and the acceptance walk
    ]
)

# oracle (pipeline.oracle)
DECISIONS_SCHEMA = pa.schema(
    [
        ("seq_id", pa.string()),
        ("lmax", pa.int32()),
        ("acceptance", pa.string()),  # surrogate | greedy | sampling: the P(a|k) the DP used
        ("plain_step", pa.bool_()),  # k = 0 (a plain step) was an available action
        ("i", pa.int32()),
        ("k", pa.int32()),  # 0..lmax; 0 = a plain step (m = 1, no draft)
        ("e_accept", pa.float64()),
        ("e_cost_ms", pa.float64()),
        ("e_experts", pa.float64()),
        ("q_value", pa.float64()),
        ("chosen", pa.bool_()),
        ("visit", pa.float64()),
    ]
)
SUMMARY_SCHEMA = pa.schema(
    [
        ("seq_id", pa.string()),
        ("category", pa.string()),
        ("lmax", pa.int64()),
        ("acceptance", pa.string()),  # surrogate | greedy | sampling, priced with its own tails
        ("plain_step", pa.bool_()),  # k = 0 available (True: the bound is >= 1)
        ("draws", pa.int32()),  # independent tail draws of this acceptance
        ("n_tokens", pa.int64()),
        # In-sample: each draw's own optimum, averaged over draws (the bound).
        ("dp0_ms", pa.float64()),
        # Cross-fitted: k* chosen on one draw, priced on another, both directions averaged (the
        # achievable estimate); = dp0_ms for greedy (deterministic tails), null with one draw.
        ("dp0_crossfit_ms", pa.float64()),
        ("ar_ms", pa.float64()),
        ("speedup", pa.float64()),
        ("speedup_crossfit", pa.float64()),
        ("mean_k", pa.float64()),
        ("mean_accept", pa.float64()),
        # Visit-weighted sums, so totals over sequences can be pooled in SQL.
        ("visit_sum", pa.float64()),
        ("visit_k_sum", pa.float64()),
        ("visit_accept_sum", pa.float64()),
    ]
)


def experts_array(routing: np.ndarray) -> pa.Array:
    """``[rows, layers, top_k]`` ints as ``list<list<int16>>`` without a Python loop."""
    rows, layers, top_k = routing.shape
    flat = pa.array(routing.astype(np.int16).reshape(-1), type=pa.int16())
    inner = pa.ListArray.from_arrays(
        pa.array(np.arange(0, rows * layers * top_k + 1, top_k, dtype=np.int32)), flat
    )
    return pa.ListArray.from_arrays(
        pa.array(np.arange(0, rows * layers + 1, layers, dtype=np.int32)), inner
    )


def experts_to_numpy(column: pa.ChunkedArray | pa.Array, layers: int, top_k: int) -> np.ndarray:
    """A ``list<list<int16>>`` column as ``[rows, layers, top_k]`` int16."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    flat = arr.flatten().flatten().to_numpy(zero_copy_only=False)
    return flat.reshape(-1, layers, top_k)
