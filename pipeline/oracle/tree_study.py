"""The tree bound beside the chain bound, per budget: for every largest budget K
(draft nodes; gamma <= K + 1 verified positions), the chain bound under greedy acceptance and
each selection rule's tree bound (pipeline.oracle.tree_bound) on the same reference text, the
same cost model and AR price, pooled over sequences (S = total AR cost / total optimal cost),
with the best fixed budget of each (a static policy priced alike) and the optimum's mean
gamma and accepted length. ``chain-or-R`` is the bound when each state may take either a chain or
R's tree (of any budget up to K): what adding R's trees to chains can buy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from pipeline.cost.model import CostModel
from pipeline.data.shards import read_table
from pipeline.extract.draft_trees import TreeRule
from pipeline.models.adapters import MoESpec
from pipeline.oracle.bellman import (
    OracleSolution,
    acceptance_table,
    ar_cost,
    cost_table,
    solve_many,
)
from pipeline.oracle.inputs import SequenceInput, build_input, extraction_manifest, load_rows
from pipeline.oracle.tree_bound import (
    TreeInput,
    fixed_budgets_ms,
    solve_either,
    solve_tree,
    tree_input,
    tree_tables,
)

DEFAULT_BUDGETS = (1, 2, 3, 4, 6, 8, 12)
CHAIN = "chain"


@dataclass(frozen=True)
class BoundStats:
    """One bound on one sequence at one budget cap."""

    dp0_ms: float
    mean_gamma: float  # visit-weighted k* + 1 (1: a plain step)
    mean_accepted: float


def _stats(sol: OracleSolution) -> BoundStats:
    return BoundStats(float(sol.dp[0]), sol.mean_draft_length() + 1, sol.mean_accepted())


def chain_tables(seq: SequenceInput, model: CostModel, lmax: int) -> tuple[np.ndarray, ...]:
    """The chain bound's greedy arrays (exact-greedy acceptance, greedy tails)."""
    probs = acceptance_table(seq.acceptance("greedy"), lmax)
    union = seq.union("greedy", 0)[:, : lmax + 1, : lmax + 1]
    return probs, cost_table(model, union, seq.prompt_len), union


def sequence_rows(
    seq: SequenceInput,
    trees: list[TreeInput],
    model: CostModel,
    budgets: list[int],
    chain_lmax: int,
) -> list[dict]:
    """Long-form rows (budget, bound, ms figures) for one sequence."""
    ar = ar_cost(model, seq.token_experts, seq.prompt_len)
    rows = []
    chain_caps = [k for k in budgets if k <= chain_lmax]
    if chain_caps:
        probs, cost, union = chain_tables(seq, model, max(chain_caps))
        ks = list(range(1, max(chain_caps) + 1))
        fixed = dict(zip(ks, fixed_budgets_ms(probs, cost, ks), strict=True))
        for k, sol in zip(chain_caps, solve_many(probs, cost, chain_caps, union), strict=True):
            rows.append(
                {
                    "budget": k,
                    "bound": CHAIN,
                    "ar_ms": ar,
                    **_stats(sol).__dict__,
                    **{f"fixed_{j}": fixed[j] for j in range(1, k + 1)},
                }
            )
    for tin in trees:
        caps = [k for k in budgets if k <= tin.k_max]
        tables = tree_tables(model, tin)
        ks = list(range(1, max(caps) + 1))
        fixed = dict(zip(ks, fixed_budgets_ms(*tables, ks), strict=True))
        for k, sol in zip(caps, solve_tree(model, tin, caps, tables), strict=True):
            rows.append(
                {
                    "budget": k,
                    "bound": tin.rule.name,
                    "ar_ms": ar,
                    **_stats(sol).__dict__,
                    **{f"fixed_{j}": fixed[j] for j in range(1, k + 1)},
                }
            )
        if not chain_caps:
            continue
        both = [(probs, cost), tables]
        for k in [c for c in caps if c in chain_caps]:
            dp0, path = solve_either(both, k)
            rows.append(
                {
                    "budget": k,
                    "bound": f"{CHAIN}-or-{tin.rule.name}",
                    "ar_ms": ar,
                    "dp0_ms": dp0,
                    "mean_gamma": float(np.mean([g for g, _ in path])),
                    "mean_accepted": float(np.mean([a for _, a in path])),
                }
            )
    return rows


def pool(rows: list[dict]) -> pd.DataFrame:
    """Per (budget, bound): pooled S, the best fixed budget's S and gamma, mean gamma and
    accepted length weighted by each sequence's AR cost."""
    df = pd.DataFrame(rows)
    out = []
    for (budget, bound), g in df.groupby(["budget", "bound"], sort=False):
        fixed = {
            int(c.split("_")[1]): g["ar_ms"].sum() / g[c].sum()
            for c in g.columns
            if c.startswith("fixed_") and g[c].notna().all()
        }
        best = max(fixed, key=fixed.get) if fixed else None
        w = g["ar_ms"] / g["ar_ms"].sum()
        out.append(
            {
                "budget": int(budget),
                "bound": bound,
                "speedup": g["ar_ms"].sum() / g["dp0_ms"].sum(),
                "best_fixed_speedup": fixed[best] if fixed else np.nan,
                "best_fixed_gamma": best + 1 if fixed else np.nan,
                "mean_gamma": float((w * g["mean_gamma"]).sum()),
                "mean_accepted": float((w * g["mean_accepted"]).sum()),
                "sequences": len(g),
            }
        )
    out.sort(key=lambda r: (r["budget"], _kind(r["bound"]), r["bound"]))
    return pd.DataFrame(out)


def _kind(bound: str) -> int:
    """Table order: the chain, the rules' trees, then either-or."""
    return 0 if bound == CHAIN else 2 if bound.startswith(f"{CHAIN}-or-") else 1


def study_from_extraction(
    extract_dir: Path, model: CostModel, spec: MoESpec, budgets: list[int] | None = None
) -> pd.DataFrame:
    """The per-budget table of an extraction made with --trees (and greedy tails)."""
    manifest = extraction_manifest(extract_dir)
    rules = [TreeRule.parse(r) for r in manifest.get("trees") or []]
    if not rules:
        raise ValueError(f"{extract_dir} has no draft trees: extract with --trees")
    if "greedy" not in manifest.get("acceptances", []):
        raise ValueError(f"{extract_dir} has no greedy tails, which the chain bound needs")
    lmax, k_max = int(manifest["lmax"]), int(manifest["tree_budget"])
    budgets = [k for k in (budgets or DEFAULT_BUDGETS) if k <= max(lmax, k_max)]
    model.require_m(range(1, max(lmax, k_max) + 2), "the tree study")
    trees: pa.Table = read_table(extract_dir, "trees")
    rows = []
    for part in load_rows(extract_dir):
        seq = build_input(part, spec, lmax, ["greedy"])
        tins = [
            tree_input(seq.seq_id, seq.prompt_len, seq.routing, trees, r, k_max, spec)
            for r in rules
        ]
        rows += sequence_rows(seq, tins, model, budgets, lmax)
    return pool(rows)


def format_tree_study(df: pd.DataFrame) -> str:
    """One line per budget: each bound's S, then its best fixed gamma's S."""
    bounds = list(dict.fromkeys(df["bound"]))
    head = f"{'K (gamma <= K+1)':>16} " + " ".join(f"{b:>22}" for b in bounds)
    lines = [
        "tree bound beside the chain bound (T = 0, greedy acceptance): S = AR / optimal cost;",
        "  in brackets the best fixed budget's S @ its gamma",
        head,
    ]
    for budget, g in df.groupby("budget"):
        cells = []
        for b in bounds:
            r = g[g["bound"] == b]
            if r.empty:
                cells.append(f"{'-':>22}")
                continue
            r = r.iloc[0]
            if r["best_fixed_speedup"] != r["best_fixed_speedup"]:  # either-or: no fixed rule
                cells.append(f"  {r['speedup']:>7.3f}".ljust(22))
                continue
            cells.append(
                f"{r['speedup']:>7.3f} [{r['best_fixed_speedup']:.3f} @ "
                f"{int(r['best_fixed_gamma']):>2}]".rjust(22)
            )
        lines.append((f"{budget:>16} " + " ".join(cells)).rstrip())
    return "\n".join(lines)
