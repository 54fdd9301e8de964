"""Attention inputs for verifying a token tree (or several packed chains) in one forward.

A tree is given by ``parents``: ``parents[j]`` is the index of node ``j``'s parent among the
tree's nodes, or -1 when node ``j`` hangs directly off the cached context. Parents come before
children. Each node sees the whole cached context, its ancestors and itself, and sits at position
``past_len + depth``: exactly what it would see as the last token of a plain chain.
"""

from __future__ import annotations

import torch


def validate_parents(parents: list[int]) -> None:
    for j, p in enumerate(parents):
        if not -1 <= p < j:
            raise ValueError(
                f"parents[{j}] = {p}: a parent must be -1 (the context) or an earlier node"
            )


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """``[n, n]`` bool, ``[j, i]`` true when node ``i`` is node ``j`` or one of its ancestors."""
    validate_parents(parents)
    n = len(parents)
    sees = torch.eye(n, dtype=torch.bool)
    for j, p in enumerate(parents):
        if p >= 0:
            sees[j] |= sees[p]
    return sees


def depths(parents: list[int]) -> list[int]:
    validate_parents(parents)
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def tree_attention_inputs(
    parents: list[int],
    past_len: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    root_context: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive 4D mask ``[1, 1, n, past_len + n]`` and ``position_ids`` ``[1, n]``.

    ``root_context[j]``, for a root ``j``, is how many cached positions that root's subtree
    sees (default: all ``past_len``); a junk tail that diverges after ``x_s`` sees only the
    prefix up to ``x_s`` of a cache that holds the whole reference. transformers 5 passes a 4D
    mask through unchanged; an additive float mask (0 visible, dtype-min hidden) is what both
    eager and SDPA attention accept.
    """
    n = len(parents)
    sees = ancestor_matrix(parents)
    context = torch.full((n,), past_len, dtype=torch.long)
    if root_context is not None:
        if len(root_context) != n:
            raise ValueError("root_context needs one entry per node")
        for j, p in enumerate(parents):
            context[j] = context[p] if p >= 0 else root_context[j]
        if int(context.max()) > past_len or int(context.min()) < 0:
            raise ValueError(f"root context lengths must lie in 0..{past_len}")
    visible = torch.zeros(n, past_len + n, dtype=torch.bool)
    visible[:, :past_len] = torch.arange(past_len).view(1, -1) < context.view(-1, 1)
    visible[:, past_len:] = sees
    mask = torch.zeros(n, past_len + n, dtype=dtype)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    positions = context + torch.tensor(depths(parents), dtype=torch.long)
    return mask.view(1, 1, n, past_len + n).to(device), positions.view(1, n).to(device)


def chains_as_tree(lengths: list[int]) -> list[int]:
    """Parents of several independent chains packed into one forward, each starting at the
    context (used to verify many junk tails against one cached prefix)."""
    parents: list[int] = []
    for length in lengths:
        start = len(parents)
        parents.extend([-1] + [start + r for r in range(length - 1)] if length else [])
    return parents
