"""The draft's trees along a text and the target's probability of every node, at the decoding
temperature: what the tree ceiling (pipeline.acceptance.tree_ceiling) is made of.

At state i (x_0 .. x_i committed, x_0 the prompt's last token) the rule's first ``k_max`` nodes
of the draft's EAGLE-2 expansion are selected as the tree bound's are
(pipeline.extract.draft_trees). Each node's probability is the target's for its token after
its ancestors: for a first-level node the teacher-forced pass at x_i, deeper ones read their
parent's row of one packed forest forward over the selected nodes (every state's tree sees the
teacher-forced cache up to x_i, and its own ancestors). At T = 0 a node's probability is 1
when its token is the target's argmax there and 0 otherwise (greedy verification); at T > 0
it is the target's distribution at that temperature and top-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.data.references import ReferenceSequence
from pipeline.decode.types import SamplingConfig
from pipeline.extract.draft_trees import TreeRule, expand_states, select
from pipeline.extract.teacher_forced import TeacherForced, teacher_forced
from pipeline.models.forest import forest_forward
from pipeline.models.loading import ModelPair


@dataclass(frozen=True)
class StateTree:
    """The selected nodes of one state, in selection order (the first k: budget k)."""

    parents: list[int]  # index into these nodes, -1: the root x_i
    depth: list[int]  # 1: a candidate for x_{i+1}
    tokens: list[int]
    p: list[float]  # the target's probability of the node's token after its ancestors


def node_probability(
    logits: torch.Tensor, tokens: list[int], sampling: SamplingConfig
) -> list[float]:
    """Row r's probability of ``tokens[r]`` under the target's ``logits`` [rows, vocab] at the
    decoding temperature (greedy: 1 at the argmax, else 0)."""
    if not len(tokens):
        return []
    index = torch.tensor(tokens, device=logits.device).view(-1, 1)
    if sampling.greedy:
        return (logits.argmax(-1, keepdim=True) == index).view(-1).float().tolist()
    return sampling.probs(logits).gather(-1, index).view(-1).tolist()


@torch.no_grad()
def sampled_trees(
    pair: ModelPair,
    prompt_ids: list[int],
    tokens: list[int],
    sampling: SamplingConfig,
    rule: TreeRule,
    k_max: int,
    chunk_nodes: int = 1024,
    forced: TeacherForced | None = None,
) -> list[StateTree]:
    """Every state's tree of ``rule``'s first ``k_max`` nodes along ``prompt_ids + tokens``
    (states 0 .. len(tokens) - 1), with the target's node probabilities. ``forced``: both
    models' teacher-forced pass over that text, if the caller has it already (forced_along)."""
    if pair.draft_is_head:
        raise ValueError("the tree ceiling builds trees with a draft model; a head takes none")
    if rule.selection != "eagle2":
        raise ValueError(f"tree rule {rule.name}: the tree ceiling takes eagle2 rules")
    if k_max < 1 or not tokens or len(prompt_ids) < 1:
        raise ValueError("the tree ceiling needs k_max >= 1, a prompt and a text")
    if forced is None:
        forced = forced_along(pair, prompt_ids, tokens)
    n, p_len = len(tokens), len(prompt_ids)
    levels = rule.levels(k_max)
    step = max(1, chunk_nodes // (rule.branch * max(1, levels - 1)))
    pending: list[tuple[list[int], list[int], list[int]]] = []  # (parents, depth, tokens)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        exps, _ = expand_states(
            pair.draft,
            forced.draft_cache,
            torch.softmax(forced.draft_logits[lo:hi].float(), dim=-1),
            [p_len + i for i in range(lo, hi)],
            rule.branch,
            levels,
        )
        for exp in exps:
            nodes = select(rule, exp, k_max)
            rank = {node: j for j, node in enumerate(nodes)}
            parents = [rank[exp.parents[node]] if exp.parents[node] >= 0 else -1 for node in nodes]
            depth = [exp.level[node] + 1 for node in nodes]
            pending.append((parents, depth, [exp.tokens[node] for node in nodes]))
    return _with_probabilities(pair, forced, pending, p_len, sampling, chunk_nodes)


def forced_along(pair: ModelPair, prompt_ids: list[int], tokens: list[int]) -> TeacherForced:
    """Both models teacher-forced over ``prompt_ids + tokens``."""
    return teacher_forced(
        pair, ReferenceSequence("text", "", "sampled", tuple(prompt_ids), tuple(tokens))
    )


def _with_probabilities(
    pair: ModelPair,
    forced: TeacherForced,
    pending: list[tuple[list[int], list[int], list[int]]],
    p_len: int,
    sampling: SamplingConfig,
    chunk_nodes: int,
) -> list[StateTree]:
    """Each state's (parents, depth, tokens) with the target's node probabilities."""
    out: list[StateTree] = []
    start = 0
    while start < len(pending):
        stop, total = start, 0
        while stop < len(pending) and (
            stop == start or total + len(pending[stop][2]) <= chunk_nodes
        ):
            total += len(pending[stop][2])
            stop += 1
        # One forest: every selected node of these states, after its ancestors.
        tokens, parents, contexts, offsets = [], [], [], []
        for i in range(start, stop):
            offsets.append(len(tokens))
            for tok, par in zip(pending[i][2], pending[i][0], strict=True):
                parents.append(par + offsets[-1] if par >= 0 else -1)
                tokens.append(tok)
                contexts.append(p_len + i)  # x_0 .. x_i: the prompt and i generated tokens
        logits, _ = forest_forward(pair.target, forced.target_cache, tokens, parents, contexts)
        for i, off in zip(range(start, stop), offsets, strict=True):
            tree_parents, depth, toks = pending[i]
            rows = [
                forced.target_logits[i].float() if par < 0 else logits[off + par].float()
                for par in tree_parents
            ]
            p = node_probability(torch.stack(rows), toks, sampling) if rows else []
            out.append(StateTree(tree_parents, depth, toks, p))
        start = stop
    return out
