"""EAGLE-2 style dynamic tree: the top-gamma nodes of the draft tree by path probability."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeline.decode.drafter import Drafter
from pipeline.decode.policies.base import Policy
from pipeline.decode.policies.knobs import step_knob
from pipeline.decode.policies.tree_builder import build_tree
from pipeline.decode.types import Candidates

TREE_KNOBS = (
    step_knob("depth", None, "levels of the draft tree"),
    step_knob("branch", None, "children expanded per frontier node, frontier nodes per level"),
    step_knob("gamma", None, "draft nodes kept for verification"),
)


def tree_knobs(depth: int, branch: int, gamma: int):
    """The tree knobs with a policy's own defaults."""
    return tuple(replace(k, default=d) for k, d in zip(TREE_KNOBS, (depth, branch, gamma),
                                                       strict=True))  # fmt: skip


@dataclass
class TreePolicy(Policy):
    """EAGLE-2 style dynamic tree: at each depth expand the top-``branch`` children of the
    ``branch`` best frontier nodes (by path probability), then keep the ``gamma`` best nodes
    overall. Nodes are chosen deterministically (top-b), so verification uses the
    multi-candidate rule for deterministic proposals."""

    depth: int = 4
    branch: int = 2
    gamma: int = 8
    name = "tree"
    summary = "EAGLE-2 style dynamic tree: the gamma draft nodes of highest path probability"
    knobs = tree_knobs(4, 2, 8)

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        tree = build_tree(drafter, committed, self.depth, self.branch)
        keep = sorted(range(len(tree.tokens)), key=lambda j: -tree.path_p[j])[: self.gamma]
        return tree.subset(keep)
