"""EAGLE-2 style dynamic tree: the most probable prefix-closed gamma - 1 nodes of the draft
tree, so that the pass verifies gamma positions with the root (the EcoSpec budget contract,
pipeline.decode.policies.tree_builder)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeline.decode.drafter import Drafter
from pipeline.decode.policies.base import Policy
from pipeline.decode.policies.knobs import MAX_STEP_KNOB, Knob, step_knob
from pipeline.decode.policies.labels import peer
from pipeline.decode.policies.tree_builder import build_tree, select_prefix_closed
from pipeline.decode.step_limits import StepWork, tree_work
from pipeline.decode.types import Candidates

TREE_KNOBS = (
    step_knob("depth", None, "levels of the draft tree"),
    step_knob("branch", None, "children expanded per frontier node, frontier nodes per level"),
    Knob(
        "gamma",
        int,
        None,
        2,
        MAX_STEP_KNOB,
        help="positions verified per step, the root "
        "(last committed token) included: at most gamma - 1 draft nodes",
    ),
)


def tree_knobs(depth: int, branch: int, gamma: int):
    """The tree knobs with a policy's own defaults."""
    return tuple(
        replace(k, default=d) for k, d in zip(TREE_KNOBS, (depth, branch, gamma), strict=True)
    )


@dataclass
class TreePolicy(Policy):
    """EAGLE-2 style dynamic tree: at each depth expand the top-``branch`` children of the
    ``branch`` best frontier nodes (by path probability), then keep gamma - 1 nodes: the most
    probable one whose parent is kept (or is the root), one at a time. Path probability never
    grows along a path, so this is the top gamma - 1 by path probability with ties going to
    parents. Nodes are chosen deterministically (top-b), so verification uses the
    multi-candidate rule for deterministic proposals. Draft forwards: ``depth``."""

    depth: int = 4
    branch: int = 2
    gamma: int = 9  # 8 draft nodes + the root (depth 4, branch 2 grows 14)
    name = "tree"
    label = peer("EAGLE-2's dynamic draft tree, Li et al. 2024")
    summary = "EAGLE-2 style dynamic tree: the gamma - 1 draft nodes of highest path probability"
    knobs = tree_knobs(4, 2, 9)

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        tree = build_tree(drafter, committed, self.depth, self.branch)
        keep = select_prefix_closed(tree.parents, self.gamma, tree.path_p.__getitem__)
        return tree.subset(keep)

    def step_work(self) -> StepWork:
        return tree_work(self.depth, self.branch, self.gamma)
