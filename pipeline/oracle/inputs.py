"""The oracle's per-sequence inputs, read from the extraction tables: the acceptance r_j of each
verification rule, the routing of the reference, and U(i, k, a) for every (acceptance, draw)
of junk tails the extraction holds.

Acceptance modes (docs/contract.md, "Transition"; each priced with its OWN tails, i.e. the rows
of ``tails`` whose ``acceptance`` equals the mode):
  surrogate  r_j = draft_prob (the paper's)
  greedy     r_j = draft_match (T = 0: exact; greedy tails are deterministic, one draw)
  sampling   r_j = min(1, draft_prob / target_prob) (speculative sampling at the extraction's T)

U tables are ``N (lmax + 1)^2`` floats each, one per (acceptance, draw): jobs build them inside
the worker that solves the sequence (``SequenceRows`` travel, not the tables).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.data.schemas import experts_to_numpy
from pipeline.data.shards import read_table
from pipeline.models.adapters import MoESpec
from pipeline.oracle.expert_union import bitmasks, mean_popcount
from pipeline.oracle.union_from_tables import sequence_union_table, tail_draws

ACCEPTANCE_MODES = ("surrogate", "greedy", "sampling")


def acceptance_probs(
    mode: str, draft_prob: np.ndarray, draft_match: np.ndarray, target_prob: np.ndarray
) -> np.ndarray:
    """r_t, the probability that the verifier accepts reference token x_t drafted after x_<t
    (index 0, x_0, unused)."""
    if mode == "surrogate":
        return draft_prob
    if mode == "greedy":
        return draft_match
    if mode == "sampling":
        if np.isnan(target_prob[1:]).any():
            raise ValueError("sampling acceptance needs the tokens' target_prob: re-extract")
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(target_prob > 0, draft_prob / target_prob, 1.0)
        return np.minimum(1.0, ratio)
    raise ValueError(f"acceptance {mode!r} is not one of {', '.join(ACCEPTANCE_MODES)}")


@dataclass(frozen=True)
class SequenceInput:
    seq_id: str
    category: str
    prompt_len: int
    draft_prob: np.ndarray  # [N + 1], index 0 unused
    draft_match: np.ndarray  # [N + 1] 0/1, index 0 unused
    target_prob: np.ndarray  # [N + 1], index 0 unused; NaN in extractions that lack it
    token_ids: np.ndarray  # [N + 1]
    token_experts: np.ndarray  # [N + 1] mean over layers of |E(t)|
    routing: np.ndarray  # [N + 1, MoE layers, top_k] experts of x_0..x_N
    # (acceptance, draw) -> U table [N, lmax + 1, lmax + 1] priced with that rule's tails
    unions: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.token_ids) - 1

    def acceptance(self, mode: str) -> np.ndarray:
        return acceptance_probs(mode, self.draft_prob, self.draft_match, self.target_prob)

    def acceptances(self) -> list[str]:
        """The modes with tails, in ACCEPTANCE_MODES order."""
        have = {acc for acc, _ in self.unions}
        return [m for m in ACCEPTANCE_MODES if m in have]

    def draws(self, mode: str) -> list[int]:
        return sorted(d for acc, d in self.unions if acc == mode)

    def union(self, mode: str, draw: int = 0) -> np.ndarray:
        if (mode, draw) not in self.unions:
            have = ", ".join(f"{a}/{d}" for a, d in sorted(self.unions)) or "none"
            raise ValueError(f"{self.seq_id}: no {mode} tails of draw {draw} (have {have})")
        return self.unions[(mode, draw)]

    def without_unions(self) -> SequenceInput:
        return replace(self, unions={})


@dataclass(frozen=True)
class SequenceRows:
    """One sequence's rows of the three extraction tables."""

    row: dict[str, Any]
    tokens: pa.Table
    tails: pa.Table


def split_tables(sequences: pa.Table, tokens: pa.Table, tails: pa.Table) -> list[SequenceRows]:
    out = []
    for row in sequences.to_pylist():
        seq_tokens = tokens.filter(pc.equal(tokens.column("seq_id"), row["seq_id"])).sort_by("t")
        seq_tails = tails.filter(pc.equal(tails.column("seq_id"), row["seq_id"]))
        if seq_tokens.num_rows >= 2:
            out.append(SequenceRows(row, seq_tokens, seq_tails))
    return out


def _column(table: pa.Table, name: str, missing: float = np.nan) -> np.ndarray:
    if name not in table.column_names:
        return np.full(table.num_rows, missing)
    values = table.column(name).to_pylist()
    return np.array([missing if v is None else float(v) for v in values])


def build_input(
    rows: SequenceRows, spec: MoESpec, lmax: int, acceptances: list[str] | None = None
) -> SequenceInput:
    """The oracle's input for one sequence, with a U table for every draw of every acceptance
    in ``acceptances`` (default: all the tails hold)."""
    tokens, tails = rows.tokens, rows.tails
    have = tail_draws(tails)
    wanted = list(have) if acceptances is None else acceptances
    missing = [a for a in wanted if a not in have]
    if missing:
        raise ValueError(
            f"{rows.row['seq_id']}: the extraction has no {', '.join(missing)} "
            f"tails (it has {', '.join(have) or 'none'})"
        )
    unions = {
        (acc, d): sequence_union_table(tokens, tails, spec, lmax, acc, d)
        for acc in wanted
        for d in have[acc]
    }
    routing = experts_to_numpy(tokens.column("experts"), spec.num_moe_layers, spec.top_k)
    return SequenceInput(
        seq_id=rows.row["seq_id"],
        category=rows.row["category"],
        prompt_len=rows.row["prompt_len"],
        draft_prob=np.nan_to_num(_column(tokens, "draft_prob"), nan=0.0),
        draft_match=_column(tokens, "draft_match", missing=0.0),
        target_prob=_column(tokens, "target_prob"),
        token_ids=tokens.column("token_id").to_numpy(),
        token_experts=mean_popcount(bitmasks(routing, spec.num_experts)),
        routing=routing,
        unions=unions,
    )


def inputs_from_tables(
    sequences: pa.Table,
    tokens: pa.Table,
    tails: pa.Table,
    spec: MoESpec,
    lmax: int,
    acceptances: list[str] | None = None,
) -> list[SequenceInput]:
    """Every sequence's input, built here (small tables; jobs build them in workers)."""
    return [build_input(r, spec, lmax, acceptances) for r in split_tables(sequences, tokens, tails)]


def load_rows(extract_dir: Path) -> list[SequenceRows]:
    """Per-sequence rows of an extraction directory."""
    return split_tables(
        read_table(extract_dir, "sequences"),
        read_table(extract_dir, "tokens"),
        read_table(extract_dir, "tails"),
    )


def extraction_manifest(extract_dir: Path) -> dict[str, Any]:
    return json.loads((extract_dir / "manifest.json").read_text())


def extraction_lmax(extract_dir: Path) -> int:
    return int(extraction_manifest(extract_dir)["lmax"])
