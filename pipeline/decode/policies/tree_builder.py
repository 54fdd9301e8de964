"""The draft tree shared by the tree policies (EAGLE-2 style expansion), the budgeted,
prefix-closed selection of its nodes, and the subset a policy selects for verification.

Budget contract (shared by `tree` and the EcoSpec policies): ``gamma`` counts the positions
the verification pass verifies, the root (the last committed token, whose output is the bonus
token) included: at most gamma - 1 draft nodes, so m <= gamma, never more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pipeline.decode.drafter import Drafter
from pipeline.decode.types import Candidates


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]  # -1: child of the last committed token
    path_p: list[float]  # cumulative draft probability from the root
    conf: list[float]  # the draft's probability of the node given its parent
    # The draft hidden state each node was proposed from (its parent's), for expert predictors.
    contexts: list[torch.Tensor | None] = field(default_factory=list)

    def path(self, node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def subset(self, nodes: list[int]) -> Candidates:
        """Candidates made of ``nodes`` and all their ancestors (verification is
        prefix-closed), in tree order. The policies select prefix-closed sets already
        (select_prefix_closed), so no ancestor is added beyond their budget."""
        keep = set()
        for j in nodes:
            keep.update(self.path(j))
        kept = sorted(keep)
        remap = {old: new for new, old in enumerate(kept)}
        return Candidates(
            tokens=[self.tokens[j] for j in kept],
            parents=[remap[self.parents[j]] if self.parents[j] >= 0 else -1 for j in kept],
            q=[None] * len(kept),
            confidences=[self.conf[j] for j in kept],
        )


def select_prefix_closed(
    parents: list[int],
    gamma: int,
    score: Callable[[int], float],
    on_select: Callable[[int], None] | None = None,
) -> list[int]:
    """Up to gamma - 1 nodes, chosen one at a time: the best ``score`` among the eligible
    nodes (those whose parent is the root or already selected; ties go to the lower index,
    i.e. the earlier level), ``on_select`` told of each choice before the next is scored.

    Eligibility makes the set prefix-closed by construction, so verifying it needs no extra
    ancestors: neither ties nor a child that outscores its parent can push the pass past
    gamma positions. In selection order."""
    selected: list[int] = []
    chosen: set[int] = set()
    while len(selected) < gamma - 1:
        eligible = [j for j, p in enumerate(parents) if j not in chosen and (p < 0 or p in chosen)]
        if not eligible:
            break
        best = max(eligible, key=score)  # max keeps the first of equal scores
        selected.append(best)
        chosen.add(best)
        if on_select is not None:
            on_select(best)
    return selected


def build_tree(drafter: Drafter, committed: list[int], depth: int, branch: int) -> DraftTree:
    """EAGLE-2 style expansion: at each depth the top-``branch`` children of the ``branch``
    best nodes so far (by path probability); one packed draft forward per depth."""
    tree = DraftTree([], [], [], [])
    probs = drafter.begin(committed).unsqueeze(0)
    frontier_ctx = drafter.hidden[-1:]
    frontier, frontier_p = [-1], [1.0]
    for level in range(depth):
        new_tokens, new_parents, new_p, new_conf = [], [], [], []
        for row, (node, pp) in enumerate(zip(frontier, frontier_p, strict=True)):
            top = torch.topk(probs[row], branch)
            for value, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                new_tokens.append(token)
                new_parents.append(node)
                new_p.append(pp * value)
                new_conf.append(value)
                tree.contexts.append(frontier_ctx[row])
        start = len(tree.tokens)
        tree.tokens += new_tokens
        tree.parents += new_parents
        tree.path_p += new_p
        tree.conf += new_conf
        order = sorted(range(len(new_tokens)), key=lambda j: -new_p[j])[:branch]
        frontier = [start + j for j in order]
        frontier_p = [new_p[j] for j in order]
        if level == depth - 1:
            break
        # Every node of the level is appended (so candidate and cache indices agree); only
        # the frontier's distributions are used.
        probs = drafter.expand(new_tokens, new_parents)[order]
        frontier_ctx = drafter.hidden[order]
    return tree
