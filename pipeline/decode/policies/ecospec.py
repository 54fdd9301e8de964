"""EcoSpec's cost-aware selection of draft-tree nodes (arXiv 2607.12696, section 4 and
Algorithm 1), and the policies that use it.

Each node's predicted expert footprint is the union of the experts predicted for the tokens
on its path (E_traj). Starting from a buffer B of experts the verification pass loads anyway
(the last committed token's), the selection repeatedly takes the unselected node with the best
score P(path) / (|E_traj \\ B| + eps), where |.| sums over MoE layers, adds it to the selected
set and its footprint to B, until gamma nodes are selected. `ecospec-global` is the paper's
static ablation: score P / (|E_traj| + eps), no buffer. Verification is unchanged (lossless).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.decode.drafter import Drafter
from pipeline.decode.policies.artifacts import PolicyArtifacts
from pipeline.decode.policies.base import Policy
from pipeline.decode.policies.knobs import Knob
from pipeline.decode.policies.tree import tree_knobs
from pipeline.decode.policies.tree_builder import build_tree
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
    gamma: int,
    buffer: Footprint,
    eps: float = 1e-6,
    use_buffer: bool = True,
) -> list[int]:
    """Algorithm 1: indices of the selected nodes, in selection order. ``footprints[j]`` is
    node j's path footprint E_traj. With ``use_buffer=False`` the score is the static
    P / (|E_traj| + eps) (the global-cost ablation)."""
    buf = [set(layer) for layer in buffer]
    selected: list[int] = []
    remaining = set(range(len(path_p)))
    while len(selected) < gamma and remaining:
        scores = {}
        for j in sorted(remaining):
            cost = _size(_minus(footprints[j], buf)) if use_buffer else _size(footprints[j])
            scores[j] = path_p[j] / (cost + eps)
        best = max(scores, key=scores.__getitem__)
        selected.append(best)
        remaining.discard(best)
        if use_buffer:
            buf = [a | b for a, b in zip(buf, footprints[best], strict=True)]
    return selected


def path_footprints(
    tokens: list[int], parents: list[int], predictor: ExpertPredictor, contexts=None
) -> list[Footprint]:
    """E_traj of every node: its parent's footprint plus its own token's predicted experts
    (one batched predictor call for the whole tree)."""
    predicted = predictor.predict_many(tokens, contexts) if tokens else []
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
        chosen = select_nodes(tree.path_p, footprints, self.gamma, buffer, self.eps,
                              self.use_buffer)  # fmt: skip
        return tree.subset(chosen)


@dataclass
class EcoSpecGlobalPolicy(EcoSpecPolicy):
    use_buffer: bool = False
    name = "ecospec-global"
    summary = "EcoSpec's static ablation: P(path) / (|E_traj| + eps), no buffer"
    knobs = tuple(k for k in EcoSpecPolicy.knobs if k.name != "use_buffer")  # no buffer here
