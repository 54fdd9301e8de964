"""The ``trees`` rows of one reference sequence (schema pipeline.data.schemas.TREES_SCHEMA):
for every state and selection rule, the nodes the rule verifies up to the largest budget,
in selection order, with the target's routing of each node.

A node on the reference path (its path is x_{i+1}..x_{i+depth}) is routed as the teacher-forced
pass routed that token: same token, same context. Every other selected node is routed in
packed tree-masked target forwards against the teacher-forced cache, like the shared junk
tails: the off-path nodes of all states form one forest whose roots hang off the reference
after x_s (they see the cache up to x_s) and whose other nodes see their own ancestors
(pipeline.extract.junk_tails.route_forest). Rules on the same tree share their nodes' forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from pipeline.data.references import ReferenceSequence
from pipeline.data.schemas import TREES_SCHEMA, experts_array
from pipeline.extract.draft_trees import Expansion, TreeRule, expand_states, predict_experts
from pipeline.extract.draft_trees import select as select_nodes
from pipeline.extract.junk_tails import route_forest
from pipeline.extract.teacher_forced import TeacherForced
from pipeline.models.adapters import MoESpec
from pipeline.models.loading import ModelPair
from pipeline.predictor.model import ExpertPredictor, LearnedExpertPredictor


@dataclass
class TreeStats:
    nodes: int = 0  # rows written (over rules)
    draft_token_forwards: int = 0
    target_token_forwards: int = 0  # off-path nodes routed (shared between rules)


def tree_predictor(
    rules: list[TreeRule], path: str | None, spec: MoESpec, device
) -> ExpertPredictor | None:
    """The expert predictor EcoSpec's rule reads (None when no rule needs one), checked against
    the target it is to predict for."""
    if not any(r.selection == "ecospec" for r in rules):
        return None
    if not path:
        raise ValueError("an ecospec tree rule needs an expert predictor (--predictor)")
    predictor = LearnedExpertPredictor.load(path, device)
    shape = (predictor.model.layers, predictor.model.num_experts)
    if shape != (spec.num_moe_layers, spec.num_experts):
        raise ValueError(
            f"the expert predictor {path} predicts {shape[0]} MoE layers x "
            f"{shape[1]} experts, the target has {spec.num_moe_layers} x "
            f"{spec.num_experts}: train one with python -m jobs.train_predictor"
        )
    return predictor


def _on_path(exp: Expansion, reference: np.ndarray, i: int) -> list[bool]:
    """Whether each node's path is the reference's x_{i+1}..x_{i+level+1}."""
    n = len(reference) - 1
    out: list[bool] = []
    for token, parent, level in zip(exp.tokens, exp.parents, exp.level, strict=True):
        t = i + level + 1
        out.append(t <= n and token == reference[t] and (parent < 0 or out[parent]))
    return out


@torch.no_grad()
def tree_rows(
    pair: ModelPair,
    ref: ReferenceSequence,
    forced: TeacherForced,
    rules: list[TreeRule],
    k_max: int,
    predictor: ExpertPredictor | None = None,
    chunk_tokens: int = 2048,
) -> tuple[pa.Table, TreeStats]:
    """Every rule's first ``k_max`` nodes (budget gamma = k_max + 1) at every state of ``ref``,
    built from its teacher-forced passes ``forced`` (whose caches hold the whole reference)."""
    if k_max < 1:
        raise ValueError(f"the largest budget needs at least one draft node, got k_max {k_max}")
    if not any(r.selection == "ecospec" for r in rules):
        predictor = None  # only EcoSpec reads it (and its contexts cost a draft pass)
    elif predictor is None:
        raise ValueError("an ecospec tree rule needs the expert predictor (--predictor)")
    n, p_len = ref.n_tokens, ref.prompt_len
    reference = np.asarray(ref.all_ids[p_len - 1 :])  # x_0 .. x_N
    stats = TreeStats()
    hidden = forced.draft_hidden if predictor is not None else None
    columns: dict[str, list] = {name: [] for name in TREES_SCHEMA.names}
    routing_rows: list[np.ndarray] = []
    for branch in sorted({r.branch for r in rules}):
        group = [r for r in rules if r.branch == branch]
        levels = max(r.levels(k_max) for r in group)
        exps: list[Expansion] = []
        step = max(1, chunk_tokens // (branch * max(1, levels - 1)))  # states per expansion
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            ctx = None if hidden is None else hidden[p_len - 1 + lo : p_len - 1 + hi]
            part, fed = expand_states(
                pair.draft,
                forced.draft_cache,
                torch.softmax(forced.draft_logits[lo:hi].float(), dim=-1),  # after x_lo..
                [p_len + i for i in range(lo, hi)],
                branch,
                levels,
                ctx,
            )
            exps += part
            stats.draft_token_forwards += fed
        predicted = roots = None
        if any(r.selection == "ecospec" for r in group):
            predicted = predict_experts(predictor, exps)
            before = [hidden[p_len - 2 + i] if p_len - 2 + i >= 0 else None for i in range(n)]
            roots = predictor.predict_many(reference[:n].tolist(), before)
        chosen = {
            r.name: [
                select_nodes(
                    r,
                    e,
                    k_max,
                    None if predicted is None else predicted[i],
                    None if roots is None else roots[i],
                )
                for i, e in enumerate(exps)
            ]
            for r in group
        }
        on_path = [_on_path(e, reference, i) for i, e in enumerate(exps)]
        routed = _route_off_path(pair, forced, exps, on_path, chosen, p_len, chunk_tokens)
        stats.target_token_forwards += sum(len(r) for r in routed)
        for rule in group:
            for i, nodes in enumerate(chosen[rule.name]):
                rank = {node: j + 1 for j, node in enumerate(nodes)}
                exp = exps[i]
                for node in nodes:
                    level = exp.level[node]
                    columns["seq_id"].append(ref.seq_id)
                    columns["rule"].append(rule.name)
                    columns["i"].append(i)
                    columns["j"].append(rank[node])
                    columns["parent"].append(rank.get(exp.parents[node], 0))
                    columns["depth"].append(level + 1)
                    columns["token_id"].append(exp.tokens[node])
                    columns["path_prob"].append(exp.path_p[node])
                    columns["on_path"].append(on_path[i][node])
                    routing_rows.append(
                        forced.routing[i + level + 1] if on_path[i][node] else routed[i][node]
                    )
    stats.nodes = len(routing_rows)
    empty = np.zeros((0, pair.spec.num_moe_layers, pair.spec.top_k), np.int16)
    columns["experts"] = experts_array(np.stack(routing_rows) if routing_rows else empty)
    return pa.table(columns, schema=TREES_SCHEMA), stats


def _route_off_path(
    pair: ModelPair,
    forced: TeacherForced,
    exps: list[Expansion],
    on_path: list[list[bool]],
    chosen: dict[str, list[list[int]]],
    p_len: int,
    chunk_tokens: int,
) -> list[dict[int, np.ndarray]]:
    """node -> routing of every off-path node any rule selected, per state; packed forests of
    at most ``chunk_tokens`` nodes (whole states)."""
    wanted = [
        sorted(
            {node for per_rule in chosen.values() for node in per_rule[i] if not on_path[i][node]}
        )
        for i in range(len(exps))
    ]
    out: list[dict[int, np.ndarray]] = [{} for _ in exps]
    start = 0
    while start < len(exps):
        stop, total = start, 0
        while stop < len(exps) and (stop == start or total + len(wanted[stop]) <= chunk_tokens):
            total += len(wanted[stop])
            stop += 1
        tokens, parents, contexts, owners = [], [], [], []
        for i in range(start, stop):
            index: dict[int, int] = {}
            for node in wanted[i]:  # parents come first: node order is level by level
                parent = exps[i].parents[node]
                index[node] = len(tokens)
                tokens.append(exps[i].tokens[node])
                parents.append(index.get(parent, -1))
                # A forest root follows x_0..x_{i+level}: that many prompt + reference positions.
                contexts.append(p_len + i + exps[i].level[node])
                owners.append((i, node))
        if tokens:
            routing = route_forest(
                pair.target, pair.spec, forced.target_cache, np.array(tokens), parents, contexts
            )
            for (i, node), row in zip(owners, routing, strict=True):
                out[i][node] = row
        start = stop
    return out
