"""The draft's trees at every state of a reference sequence, and the nodes a selection rule
verifies from them: what the tree bound (pipeline.oracle.tree_bound) is made of.

At state i (x_0..x_i committed) a tree policy builds the EAGLE-2 expansion
(pipeline.decode.policies.tree_builder.build_tree: the top-``branch`` children of the
``branch`` most probable nodes of each level) and a selection rule keeps the gamma - 1 nodes
the pass verifies. Here the expansions of all states are built together: one packed draft
forward per level, each state's frontier nodes attending to the teacher-forced cache up to x_i
and to their own ancestors. A node's distribution depends on nothing else, so feeding only the
frontier gives build_tree's values (build_tree also feeds the level's other nodes, whose
outputs it never reads).

Both rules pick nodes one at a time, so the first k nodes of the order chosen for the largest
budget are exactly what budget gamma = k + 1 selects: one order per state serves every budget.
A rule with a depth cap builds at most that many levels (the `tree` policy's ``depth``); with
none, budget k builds k levels (no prefix-closed set of k nodes reaches deeper).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import Cache, PreTrainedModel

from pipeline.decode.policies.ecospec import footprints_of, select_nodes
from pipeline.decode.policies.tree_builder import select_prefix_closed
from pipeline.models.kvcache import crop_to
from pipeline.predictor.model import ExpertPredictor

SELECTIONS = ("eagle2", "ecospec")  # EAGLE-2's top path probability; EcoSpec's Algorithm 1
_SPEC = re.compile(r"^(?P<sel>[a-z0-9]+)(?:[:-](?P<knobs>.*))?$")


@dataclass(frozen=True)
class TreeRule:
    """A selection rule R and the tree it selects from: the tree bound's action is a budget
    for R (beyond the papers, docs/contract.md)."""

    selection: str
    branch: int = 2
    depth: int | None = None  # levels built at most; None: as deep as the budget reaches

    def __post_init__(self) -> None:
        if self.selection not in SELECTIONS:
            raise ValueError(
                f"tree rule {self.selection!r}: the selection must be one of "
                f"{', '.join(SELECTIONS)}"
            )
        if self.branch < 1 or (self.depth is not None and self.depth < 1):
            raise ValueError(f"tree rule {self.name}: branch and depth must be >= 1")

    @property
    def name(self) -> str:
        return f"{self.selection}-b{self.branch}" + (f"-d{self.depth}" if self.depth else "")

    @classmethod
    def parse(cls, text: str) -> TreeRule:
        """``eagle2``, ``ecospec:b=2,d=3`` or a rule's name (``ecospec-b2-d3``)."""
        match = _SPEC.match(text.strip())
        if not match:
            raise ValueError(f"tree rule {text!r}: write SELECTION[:b=BRANCH,d=DEPTH]")
        knobs: dict[str, int] = {}
        for part in filter(None, re.split(r"[,-]", match["knobs"] or "")):
            key, value = part.split("=", 1) if "=" in part else (part[:1], part[1:])
            if key not in ("b", "d") or not value.isdigit():
                raise ValueError(f"tree rule {text!r}: unknown knob {part!r} (b=BRANCH, d=DEPTH)")
            knobs["branch" if key == "b" else "depth"] = int(value)
        return cls(match["sel"], **knobs)

    def levels(self, k: int) -> int:
        """Levels (draft forwards) the rule builds for a budget of k draft nodes."""
        return k if self.depth is None else min(self.depth, k)


@dataclass
class Expansion:
    """One state's EAGLE-2 expansion, in build_tree's node order (level by level)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1: the root x_i
    path_p: list[float] = field(default_factory=list)
    level: list[int] = field(default_factory=list)  # 0-based: level l is a candidate for x_{i+l+1}
    contexts: list[torch.Tensor | None] = field(default_factory=list)  # the parent's hidden state

    def add(self, token: int, parent: int, p: float, level: int, ctx) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.path_p.append(p)
        self.level.append(level)
        self.contexts.append(ctx)
        return len(self.tokens) - 1

    def up_to(self, levels: int) -> int:
        """How many nodes the first ``levels`` levels hold (a prefix of the node order)."""
        return sum(1 for lv in self.level if lv < levels)


def _children(
    exp: Expansion, parents: list[int], probs: torch.Tensor, level: int, branch: int, contexts
) -> list[int]:
    """Add the top-``branch`` children of each parent (rows of ``probs``); the new frontier:
    the ``branch`` most probable of them (build_tree's stable order)."""
    top = torch.topk(probs, min(branch, probs.shape[-1]), dim=-1)
    new = []
    for row, parent in enumerate(parents):
        pp = 1.0 if parent < 0 else exp.path_p[parent]
        ctx = None if contexts is None else contexts[row]
        for value, token in zip(top.values[row].tolist(), top.indices[row].tolist(), strict=True):
            new.append(exp.add(token, parent, pp * value, level, ctx))
    return sorted(new, key=lambda j: -exp.path_p[j])[:branch]


@torch.no_grad()
def expand_states(
    draft: PreTrainedModel,
    cache: Cache,
    root_probs: torch.Tensor,
    ctx_lens: list[int],
    branch: int,
    levels: int,
    root_hidden: torch.Tensor | None = None,
) -> tuple[list[Expansion], int]:
    """The expansions of several states: ``root_probs[s]`` is the draft's distribution after
    state s's root, which sees the cache's first ``ctx_lens[s]`` positions; ``root_hidden[s]``
    (EcoSpec's predictor context of level 0) its hidden state. The cache is returned to its
    length. Also returns the draft token-forwards spent."""
    device = draft.device
    base_len = cache.get_seq_length()
    exps = [Expansion() for _ in ctx_lens]
    frontier = [
        _children(
            e,
            [-1],
            root_probs[s : s + 1],
            0,
            branch,
            None if root_hidden is None else root_hidden[s : s + 1],
        )
        for s, e in enumerate(exps)
    ]
    slots: dict[tuple[int, int], list[int]] = {}  # (state, node) -> cache slots of its path
    appended, fed = 0, 0
    try:
        for level in range(1, levels):
            rows = [(s, node) for s, nodes in enumerate(frontier) for node in nodes]
            n = len(rows)
            visible = torch.zeros(n, base_len + appended + n, dtype=torch.bool)
            positions = torch.zeros(n, dtype=torch.long)
            for r, (s, node) in enumerate(rows):
                parent = exps[s].parents[node]
                path = [*(slots[(s, parent)] if parent >= 0 else []), appended + r]
                slots[(s, node)] = path
                visible[r, : ctx_lens[s]] = True
                visible[r, [base_len + slot for slot in path]] = True
                positions[r] = ctx_lens[s] + level - 1
            mask = torch.zeros(visible.shape, dtype=draft.dtype)
            mask.masked_fill_(~visible, torch.finfo(draft.dtype).min)
            ids = torch.tensor([[exps[s].tokens[node] for s, node in rows]], device=device)
            out = draft(
                ids,
                attention_mask=mask.view(1, 1, *mask.shape).to(device),
                position_ids=positions.view(1, -1).to(device),
                past_key_values=cache,
                use_cache=True,
                output_hidden_states=root_hidden is not None,
            )
            probs = torch.softmax(out.logits[0].float(), dim=-1)
            hidden = out.hidden_states[-1][0] if root_hidden is not None else None
            appended += n
            fed += n
            start = 0
            for s, nodes in enumerate(frontier):
                part = slice(start, start + len(nodes))
                frontier[s] = _children(
                    exps[s],
                    nodes,
                    probs[part],
                    level,
                    branch,
                    None if hidden is None else hidden[part],
                )
                start += len(nodes)
    finally:
        crop_to(cache, base_len)
    return exps, fed


def select(
    rule: TreeRule,
    exp: Expansion,
    k_max: int,
    predicted: np.ndarray | None = None,
    root_predicted: np.ndarray | None = None,
) -> list[int]:
    """The rule's first ``k_max`` nodes, in selection order (the first k: budget k + 1).
    EcoSpec needs each node's ``predicted`` experts ``[nodes, layers, top_k]`` and the root's
    (the buffer the pass loads anyway), as `ecospec` predicts them online."""
    count = exp.up_to(rule.levels(k_max))
    parents = exp.parents[:count]
    if rule.selection == "eagle2":
        return select_prefix_closed(parents, k_max + 1, exp.path_p.__getitem__)
    if predicted is None or root_predicted is None:
        raise ValueError("the ecospec rule needs the expert predictor's predictions")
    buffer = [set(row.tolist()) for row in root_predicted]
    return select_nodes(
        exp.path_p[:count], footprints_of(predicted[:count], parents), parents, k_max + 1, buffer
    )


def predict_experts(predictor: ExpertPredictor, exps: list[Expansion]) -> list[np.ndarray]:
    """Every node's predicted experts, one predictor call for all states."""
    tokens = [t for e in exps for t in e.tokens]
    contexts = [c for e in exps for c in e.contexts]
    if not tokens:
        return [np.zeros((0,)) for _ in exps]
    flat = predictor.predict_many(tokens, contexts)
    bounds = np.cumsum([0, *(len(e.tokens) for e in exps)])
    return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
