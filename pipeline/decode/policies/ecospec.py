"""EcoSpec's cost-aware selection of draft-tree nodes (arXiv 2607.12696, section 4 and
Algorithm 1), and the policies that use it.

Each node's predicted expert footprint is the union of the experts predicted for the tokens
on its path (E_traj). Starting from a buffer B of experts the verification pass loads anyway
(the last committed token's), the selection repeatedly takes the unselected node with the best
score P(path) / (|E_traj \\ B| + eps), where |.| sums over MoE layers, adds it to the selected
set and its footprint to B. `ecospec-global` is the paper's static ablation: score
P / (|E_traj| + eps), no buffer. Verification is unchanged (lossless).

The budget: the paper's section 5.1 defines gamma as "the total number of tokens verified per
speculative step, including the bonus token" (gamma = 4 in its experiments), so here the pass
verifies gamma positions, the root (the last committed token) included: gamma - 1 draft nodes
(Figure 3's "gamma = 2 draft tokens" is gamma = 3 here). Algorithm 1 scores every unselected
node; here only nodes whose parent is selected (or is the root) are eligible, so the selected
set is prefix-closed and verifies without extra ancestors. Since E_traj grows and P(path)
shrinks along a path, a child never outscores its parent, so this changes only ties (which now
go to the parent) and cannot let the pass exceed gamma positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.decode.drafter import Drafter
from pipeline.decode.policies.artifacts import PolicyArtifacts
from pipeline.decode.policies.base import Policy
from pipeline.decode.policies.knobs import Knob
from pipeline.decode.policies.labels import peer
from pipeline.decode.policies.tree import tree_knobs
from pipeline.decode.policies.tree_builder import build_tree, select_prefix_closed
from pipeline.decode.step_limits import StepWork, tree_work
from pipeline.decode.types import Candidates
from pipeline.predictor.model import ExpertPredictor

Footprint = list[set[int]]  # experts per MoE layer


def _size(footprint: Footprint) -> int:
    return sum(len(layer) for layer in footprint)


def _minus(footprint: Footprint, buffer: Footprint) -> Footprint:
    return [a - b for a, b in zip(footprint, buffer, strict=True)]


def select_nodes(
    path_p: list[float],
    footprints: list[Footprint],
    parents: list[int],
    gamma: int,
    buffer: Footprint,
    eps: float = 1e-6,
    use_buffer: bool = True,
) -> list[int]:
    """Algorithm 1 over the eligible nodes: gamma - 1 node indices (gamma verified positions
    with the root), in selection order. ``footprints[j]`` is node j's path footprint E_traj,
    ``parents[j]`` its parent (-1: the root). With ``use_buffer=False`` the score is the static
    P / (|E_traj| + eps) (the global-cost ablation)."""
    buf = [set(layer) for layer in buffer]

    def score(j: int) -> float:
        cost = _size(_minus(footprints[j], buf)) if use_buffer else _size(footprints[j])
        return path_p[j] / (cost + eps)

    def take(j: int) -> None:
        nonlocal buf
        if use_buffer:
            buf = [a | b for a, b in zip(buf, footprints[j], strict=True)]

    return select_prefix_closed(parents, gamma, score, take)


def path_footprints(
    tokens: list[int], parents: list[int], predictor: ExpertPredictor, contexts=None
) -> list[Footprint]:
    """E_traj of every node: its parent's footprint plus its own token's predicted experts
    (one batched predictor call for the whole tree)."""
    predicted = predictor.predict_many(tokens, contexts) if tokens else []
    return footprints_of(predicted, parents)


def footprints_of(predicted, parents: list[int]) -> list[Footprint]:
    """E_traj of every node from each node's own predicted experts ``[layers, top_k]``."""
    out: list[Footprint] = []
    for token_experts, parent in zip(predicted, parents, strict=True):
        own = [set(row.tolist()) for row in token_experts]
        out.append([a | b for a, b in zip(out[parent], own, strict=True)] if parent >= 0 else own)
    return out


@dataclass
class EcoSpecPolicy(Policy):
    predictor: ExpertPredictor
    depth: int = 3
    branch: int = 2
    gamma: int = 4
    eps: float = 1e-6
    use_buffer: bool = True
    name = "ecospec"
    label = peer("EcoSpec (arXiv 2607.12696), Algorithm 1")
    summary = "EcoSpec: draft-tree nodes by P(path) / (new experts + eps) against a buffer"
    needs_artifacts = True
    knobs = (
        *tree_knobs(3, 2, 4),
        Knob("eps", float, 1e-6, 0.0, 1.0, low_open=True, help="score denominator's floor"),
        Knob("use_buffer", bool, True, help="false: the static P / (|E_traj| + eps) score"),
    )

    @classmethod
    def from_knobs(cls, artifacts: PolicyArtifacts | None, **knobs: Any) -> Policy:
        assert artifacts is not None
        return cls(artifacts.predictor, **knobs)

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        tree = build_tree(drafter, committed, self.depth, self.branch)
        footprints = path_footprints(tree.tokens, tree.parents, self.predictor, tree.contexts)
        root = self.predictor.predict(committed[-1], drafter.root_context)
        buffer = [set(row.tolist()) for row in root]
        chosen = select_nodes(
            tree.path_p, footprints, tree.parents, self.gamma, buffer, self.eps, self.use_buffer
        )
        return tree.subset(chosen)

    def step_work(self) -> StepWork:
        # The tree policy's drafting and budget; the predictor's calls are no model forwards.
        return tree_work(self.depth, self.branch, self.gamma)


@dataclass
class EcoSpecGlobalPolicy(EcoSpecPolicy):
    use_buffer: bool = False
    name = "ecospec-global"
    label = peer("EcoSpec (arXiv 2607.12696), its static global-cost ablation")
    summary = "EcoSpec's static ablation: P(path) / (|E_traj| + eps), no buffer"
    knobs = tuple(k for k in EcoSpecPolicy.knobs if k.name != "use_buffer")  # no buffer here
