"""Running the oracle over an extraction: per sequence, U(i, k, a) once, then the DP for every
Lmax of the sweep, the alpha = 0 ablation, and the rows of the `decisions` and `summary` tables.
Sequences are solved in parallel as Ray tasks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray

from pipeline.cost.model import CostModel
from pipeline.data.schemas import DECISIONS_SCHEMA, experts_to_numpy
from pipeline.data.shards import read_table
from pipeline.models.adapters import MoESpec
from pipeline.oracle.bellman import acceptance_table, ar_cost, cost_table, evaluate_policy, solve
from pipeline.oracle.expert_union import bitmasks, mean_popcount
from pipeline.oracle.union_from_tables import sequence_union_table

ACCEPTANCE_MODES = ("surrogate", "greedy")


@dataclass(frozen=True)
class SequenceInput:
    seq_id: str
    category: str
    prompt_len: int
    draft_prob: np.ndarray  # [N + 1], index 0 unused
    draft_match: np.ndarray  # [N + 1] 0/1, index 0 unused
    token_ids: np.ndarray  # [N + 1]
    token_experts: np.ndarray  # [N + 1] mean over layers of |E(t)|
    routing: np.ndarray  # [N + 1, MoE layers, top_k] experts of x_0..x_N
    union: np.ndarray  # [N, lmax, lmax + 1]


def load_inputs(extract_dir: Path, spec: MoESpec, lmax: int) -> list[SequenceInput]:
    """Per-sequence oracle inputs from the extraction tables (Lmax at most the extraction's)."""
    return inputs_from_tables(read_table(extract_dir, "sequences"),
                              read_table(extract_dir, "tokens"), read_table(extract_dir, "tails"),
                              spec, lmax)  # fmt: skip


def inputs_from_tables(
    sequences: pa.Table, tokens: pa.Table, tails: pa.Table, spec: MoESpec, lmax: int
) -> list[SequenceInput]:
    out = []
    for row in sequences.to_pylist():
        seq_tokens = tokens.filter(pc.equal(tokens.column("seq_id"), row["seq_id"])).sort_by("t")
        seq_tails = tails.filter(pc.equal(tails.column("seq_id"), row["seq_id"]))
        if seq_tokens.num_rows < 2:
            continue
        union = sequence_union_table(seq_tokens, seq_tails, spec, lmax)
        routing = experts_to_numpy(seq_tokens.column("experts"), spec.num_moe_layers, spec.top_k)
        probs = seq_tokens.column("draft_prob").to_numpy(zero_copy_only=False)
        match = seq_tokens.column("draft_match").to_numpy(zero_copy_only=False)
        out.append(
            SequenceInput(
                seq_id=row["seq_id"],
                category=row["category"],
                prompt_len=row["prompt_len"],
                draft_prob=np.nan_to_num(probs.astype(float), nan=0.0),
                draft_match=np.array([0.0 if m is None else float(m) for m in match]),
                token_ids=seq_tokens.column("token_id").to_numpy(),
                token_experts=mean_popcount(bitmasks(routing, spec.num_experts)),
                routing=routing,
                union=union,
            )
        )
    return out


def extraction_lmax(extract_dir: Path) -> int:
    import json

    manifest = json.loads((extract_dir / "manifest.json").read_text())
    return int(manifest["lmax"])


def solve_sequence(
    seq: SequenceInput,
    model: CostModel,
    lmaxes: list[int],
    decisions_lmax: int,
    acceptance: str,
) -> dict[str, Any]:
    """Summary rows for every Lmax, decision rows for ``decisions_lmax``, and the alpha = 0
    ablation at ``decisions_lmax``."""
    p = seq.draft_prob if acceptance == "surrogate" else seq.draft_match
    full_lmax = seq.union.shape[1]
    probs_all = acceptance_table(p, full_lmax)
    cost_all = cost_table(model, seq.union, seq.prompt_len)
    ar = ar_cost(model, seq.token_experts, seq.prompt_len)
    n = len(seq.draft_prob) - 1
    summary: list[dict[str, Any]] = []
    decisions: pa.Table | None = None
    ablation: dict[str, Any] = {}
    for lmax in lmaxes:
        sol = solve(
            probs_all[:, :lmax, : lmax + 1],
            cost_all[:, :lmax, : lmax + 1],
            seq.union[:, :lmax, : lmax + 1],
        )
        v = sol.visit[:-1]
        chosen_accept = sol.e_accept[np.arange(n), sol.k_star - 1]
        summary.append(
            {
                "seq_id": seq.seq_id,
                "category": seq.category,
                "lmax": lmax,
                "acceptance": acceptance,
                "n_tokens": n,
                "dp0_ms": float(sol.dp[0]),
                "ar_ms": ar,
                "speedup": ar / float(sol.dp[0]),
                "mean_k": sol.mean_draft_length(),
                "mean_accept": sol.mean_accepted(),
                # Visit-weighted sums, so totals over sequences can be pooled in SQL.
                "visit_sum": float(v.sum()),
                "visit_k_sum": float((v * sol.k_star).sum()),
                "visit_accept_sum": float((v * chosen_accept).sum()),
            }
        )
        if lmax == decisions_lmax:
            decisions = _decision_rows(seq, lmax, sol, acceptance)
            probs_l = probs_all[:, :lmax, : lmax + 1]
            blind = cost_table(model, seq.union, seq.prompt_len, alpha_scale=0.0)
            ablated = solve(probs_l, blind[:, :lmax, : lmax + 1])
            # The expert-blind policy priced with the true costs: what ignoring experts loses.
            blind_value = evaluate_policy(probs_l, cost_all[:, :lmax, : lmax + 1], ablated.k_star)
            ablation = {
                "seq_id": seq.seq_id,
                "k_star": sol.k_star,
                "k_star_alpha0": ablated.k_star,
                "visit": sol.visit[:-1],
                "speedup": ar / float(sol.dp[0]),
                "speedup_alpha0_policy": ar / float(blind_value[0]),
                "speedup_alpha0_model": ar / float(ablated.dp[0]),
            }
    return {"summary": summary, "decisions": decisions, "ablation": ablation}


def _decision_rows(seq: SequenceInput, lmax: int, sol, acceptance: str) -> pa.Table:
    n = len(sol.k_star)
    i = np.repeat(np.arange(n), lmax)
    k = np.tile(np.arange(1, lmax + 1), n)
    valid = k <= (n - i)
    q = sol.q.reshape(-1)
    return pa.table(
        {
            "seq_id": pa.array([seq.seq_id] * int(valid.sum()), pa.string()),
            "lmax": pa.array(np.full(valid.sum(), lmax), pa.int32()),
            "acceptance": pa.array([acceptance] * int(valid.sum()), pa.string()),
            "i": pa.array(i[valid], pa.int32()),
            "k": pa.array(k[valid], pa.int32()),
            "e_accept": pa.array(sol.e_accept.reshape(-1)[valid]),
            "e_cost_ms": pa.array(sol.e_cost.reshape(-1)[valid]),
            "e_experts": pa.array(sol.e_experts.reshape(-1)[valid]),
            "q_value": pa.array(q[valid]),
            "chosen": pa.array((sol.k_star[i] == k)[valid]),
            "visit": pa.array(sol.visit[i][valid]),
        },
        schema=DECISIONS_SCHEMA,
    )


@ray.remote(num_cpus=1)
def _solve_batch(batch, model_json, lmaxes, decisions_lmax, acceptance):
    model = CostModel.from_json(model_json)
    return [solve_sequence(s, model, lmaxes, decisions_lmax, acceptance) for s in batch]


def solve_all(
    inputs: list[SequenceInput],
    model: CostModel,
    lmaxes: list[int],
    decisions_lmax: int,
    acceptance: str = "surrogate",
    batches: int = 4,
) -> list[dict[str, Any]]:
    """Solve every sequence; in parallel Ray tasks when Ray is up, else in this process."""
    if acceptance not in ACCEPTANCE_MODES:
        raise ValueError(f"acceptance {acceptance!r} is not one of {', '.join(ACCEPTANCE_MODES)}")
    if decisions_lmax not in lmaxes:
        raise ValueError(f"the decisions Lmax {decisions_lmax} is not in the sweep {lmaxes}")
    model.require_m(range(1, max(lmaxes) + 2), f"the oracle at Lmax {max(lmaxes)}")
    if not ray.is_initialized():
        return [solve_sequence(s, model, lmaxes, decisions_lmax, acceptance) for s in inputs]
    chunks = [inputs[j::batches] for j in range(batches) if inputs[j::batches]]
    model_json = model.to_json()
    refs = [_solve_batch.remote(c, model_json, lmaxes, decisions_lmax, acceptance) for c in chunks]
    results: dict[str, dict] = {}
    for chunk, res in zip(chunks, ray.get(refs), strict=True):
        for seq, r in zip(chunk, res, strict=True):
            results[seq.seq_id] = r
    return [results[s.seq_id] for s in inputs]
