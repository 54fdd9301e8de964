"""How much several candidates for one position can be accepted at T > 0: the first level of a
multi-draft tree, against one drafted token. What bounds sampled-candidate trees before any
engine verifies them (docs/online.md, "Sampled candidates at T = 1").

* Sampled candidates: x_1 .. x_k drawn independently from the draft's q and verified by
  recursive rejection sampling (SpecInfer's multi-round speculative sampling): x_i is accepted
  with probability min(1, r_{i-1}(x_i) / q(x_i)), r_0 = p; a rejection leaves
  r_i = norm(max(r_{i-1} - q, 0)), and when all k are rejected the token is drawn from r_k.
  The output follows p whatever k is, and x_i is reached and accepted with probability
  sum_x min(r_{i-1}(x), q(x)).
* Deterministic candidates: the draft's top-k tokens, tried in order by the multi-candidate
  rule the engine runs (pipeline.decode.acceptance): one of them is accepted with the target's
  probability of the set, sum_i p(top_i).

Both act row by row on [rows, vocab] distributions (p the target's, q the draft's, at the
decoding temperature) and return P(one of the first i candidates is accepted), i = 1 .. k.

The cheapest multi-draft tree costs no draft forward: beside each token of a sampled chain,
w - 1 more tokens drawn from the distribution that token was drawn from, as leaves. The chain
token is tried first, so the chain goes on with its own acceptance a_j, and the step ends on a
leaf at position j with probability prod_{i<j} a_i * (A_w(j) - a_j), A_w the acceptance of w
candidates. ``leaf_trees`` writes these trees in the tree ceiling's form
(pipeline.acceptance.tree_ceiling: a node's p multiplies its parent's reach), one leaf
carrying the siblings' whole chance and w - 2 more priced but worth nothing, so that the
ceiling prices the pass at its real size; the chain ceiling's approximation holds as well:
position j of a step's chain is accepted as the text's position t + j is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.acceptance.tree_ceiling import TreeCeiling, TreeStepCost, text_costs, tree_ceiling
from pipeline.decode.types import SamplingConfig
from pipeline.extract.sampled_trees import forced_along
from pipeline.extract.teacher_forced import TeacherForced
from pipeline.models.loading import ModelPair


def sampled_acceptance(p: torch.Tensor, q: torch.Tensor, k: int) -> torch.Tensor:
    """[rows, k]: P(one of x_1 .. x_i ~ q is accepted) under recursive rejection sampling."""
    _check(p, q, k)
    r = p.double()
    q = q.double()
    miss = torch.ones(p.shape[0], dtype=torch.float64, device=p.device)
    out = []
    for _ in range(k):
        overlap = torch.minimum(r, q).sum(-1)  # P(x_i accepted | x_1 .. x_{i-1} rejected)
        miss = miss * (1.0 - overlap)
        out.append(1.0 - miss)
        left = (r - q).clamp_min(0.0)
        total = left.sum(-1, keepdim=True)
        # Where r is inside q nothing is left: every later candidate is then accepted with
        # probability 0 (that row's miss is already 0 from overlap = 1).
        r = torch.where(total > 0, left / total.clamp_min(1e-300), r)
    return torch.stack(out, dim=-1)


def top_k_acceptance(p: torch.Tensor, q: torch.Tensor, k: int) -> torch.Tensor:
    """[rows, k]: P(one of the draft's top-i tokens is accepted) under the multi-candidate
    rule: the target's probability of those i tokens."""
    _check(p, q, k)
    top = torch.topk(q, k, dim=-1).indices
    return p.double().gather(-1, top).cumsum(-1)


def _check(p: torch.Tensor, q: torch.Tensor, k: int) -> None:
    if p.shape != q.shape or p.dim() != 2:
        raise ValueError(
            f"p and q must both be [rows, vocab], got {tuple(p.shape)}, {tuple(q.shape)}"
        )
    if not 1 <= k <= p.shape[-1]:
        raise ValueError(f"k must be in 1 .. vocab ({p.shape[-1]}), got {k}")


@torch.no_grad()
def candidates_along(
    pair: ModelPair, prompt_ids: list[int], tokens: list[int], sampling: SamplingConfig, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sampled, top-k) first-level acceptance [len(tokens), k] at every state of
    ``prompt_ids + tokens`` (the text the target sampled at ``sampling``): p and q are the
    target's and the draft's teacher-forced distributions at that temperature and top-p."""
    return candidates_of(forced_along(pair, prompt_ids, tokens), sampling, k)


def candidates_of(
    forced: TeacherForced, sampling: SamplingConfig, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """candidates_along from the text's teacher-forced pass."""
    if sampling.greedy:
        raise ValueError("sampled candidates are a T > 0 study: at T = 0 the draft drafts argmaxes")
    p = sampling.probs(forced.target_logits.float())
    q = sampling.probs(forced.draft_logits.float())
    return sampled_acceptance(p, q, k), top_k_acceptance(p, q, k)


def leaf_trees(
    acc: np.ndarray, wide: np.ndarray, width: int, k_max: int
) -> list[tuple[list[int], list[float], list[int]]]:
    """Every state's chain with ``width - 1`` sampled leaves beside each token, in selection
    order (each chain node, then its leaves), up to k_max nodes: (parents, p, depth). ``acc``
    [n]: the chain's acceptance at each text position; ``wide`` [n]: A_width there."""
    if width < 2:
        raise ValueError(f"a leaf tree has width >= 2, got {width}")
    n = len(acc)
    out = []
    for t in range(n):
        parents: list[int] = []
        p: list[float] = []
        depth: list[int] = []
        before = -1  # the chain node the next position hangs from
        for j in range(n - t):
            if len(parents) + width > k_max:
                break
            extra = max(float(wide[t + j]) - float(acc[t + j]), 0.0)
            for node_p in (float(acc[t + j]), extra, *[0.0] * (width - 2)):
                parents.append(before)
                p.append(node_p)
                depth.append(j + 1)
            before = len(parents) - width  # this position's chain node
        out.append((parents, p, depth))
    return out


@dataclass
class SampledCandidates:
    """One group of texts at T > 0: the mean over their positions of one position's
    acceptance with i = 1 .. k candidates (drawn from q; the draft's top-i), and for each leaf
    width the ceilings of chains with that many sampled candidates per position."""

    sampled: list[float]
    top: list[float]
    leaves: dict[int, TreeCeiling]


def sampled_candidates_study(
    pair: ModelPair,
    texts: Sequence[tuple[list[int], Sequence[int], np.ndarray, TreeStepCost]],
    sampling: SamplingConfig,
    k: int,
    k_max: int,
    fixed_ks: Sequence[int],
    firsts: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> SampledCandidates:
    """``texts`` as the tree ceiling takes them: (prompt ids, the text the target sampled at
    ``sampling``, its chain acceptances, its step cost); leaf widths 2 .. k. ``firsts``: each
    text's candidates_of, if the caller has them (off texts_tree_ceiling's own passes)."""
    if firsts is None:
        firsts = [
            candidates_along(pair, list(ids), [int(t) for t in toks], sampling, k)
            for ids, toks, *_ in texts
        ]
    if len(firsts) != len(texts) or any(s.shape[1] != k for s, _ in firsts):
        raise ValueError(f"firsts: one (sampled, top) pair of width {k} per text")
    rows = sum(s.shape[0] for s, _ in firsts)
    sampled = (sum(s.sum(0) for s, _ in firsts) / rows).tolist()
    top = (sum(t.sum(0) for _, t in firsts) / rows).tolist()
    leaves = {}
    for width in range(2, k + 1):
        per_text = [
            text_costs(
                acc, leaf_trees(acc, s[:, width - 1].numpy(), width, k_max), step, k_max, fixed_ks
            )
            for (_, _, acc, step), (s, _) in zip(texts, firsts, strict=True)
        ]
        leaves[width] = tree_ceiling(per_text)
    return SampledCandidates(sampled, top, leaves)
