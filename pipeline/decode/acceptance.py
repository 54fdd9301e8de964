"""Verification's acceptance rules (lossless): walk the candidates from the root.

* greedy (temperature 0): follow the child whose token is the target's argmax, then emit the
  argmax as the bonus token; the output equals plain greedy decoding;
* sampling, chain drafted by sampling from q: accept x with probability min(1, p(x)/q(x)),
  else emit a sample of norm(max(p - q, 0)) (speculative sampling); several children each
  drawn from its q (siblings drawn from one distribution): try them in order, accepting x with
  min(1, r(x)/q(x)), r starting as p and becoming norm(max(r - q, 0)) after each rejection;
  if none is accepted emit a sample of r (recursive rejection sampling, SpecInfer);
* sampling, candidates chosen deterministically (a top-b tree): try the children in order,
  accepting x with probability r(x) where r starts as p and loses each rejected token's mass
  (renormalised); if none is accepted emit a sample of r (the multi-candidate rule of
  SpecInfer / EAGLE for deterministic proposals).
"""

from __future__ import annotations

import torch

from pipeline.decode.randomness import RandomSource
from pipeline.decode.types import Candidates, SamplingConfig


def accept(
    cands: Candidates, probs: torch.Tensor, sampling: SamplingConfig, rng: RandomSource
) -> tuple[list[int], list[int]]:
    """Walk the candidates from the root; returns (new tokens, accepted node indices).

    ``probs[0]`` is the target's distribution after the last committed token, ``probs[j + 1]``
    after candidate node j.
    """
    children: dict[int, list[int]] = {}
    for j, p in enumerate(cands.parents):
        children.setdefault(p, []).append(j)
    node, row = -1, 0
    accepted: list[int] = []
    tokens: list[int] = []
    while True:
        kids = children.get(node, [])
        p = probs[row]
        if sampling.greedy:
            choice = int(p.argmax())
            nxt = next((c for c in kids if cands.tokens[c] == choice), None)
            if nxt is None:
                return [*tokens, choice], accepted
        elif kids and all(cands.q[c] is not None for c in kids):
            # Recursive rejection sampling; with one child, speculative sampling.
            residual, nxt = p, None
            for c in kids:
                x, q = cands.tokens[c], cands.q[c].to(p.device)
                if rng.bernoulli(min(1.0, float(residual[x] / q[x]))):
                    nxt = c
                    break
                left = (residual - q).clamp_min(0)
                residual = left / left.sum() if left.sum() > 0 else residual
            if nxt is None:
                return [*tokens, rng.categorical(residual)], accepted
        else:
            residual = p.clone()
            nxt = None
            for c in kids:
                x = cands.tokens[c]
                if rng.bernoulli(float(residual[x])):
                    nxt = c
                    break
                residual[x] = 0.0
                total = residual.sum()
                if total <= 0:
                    break
                residual = residual / total
            if nxt is None:
                return [*tokens, rng.categorical(residual if residual.sum() > 0 else p)], accepted
        accepted.append(nxt)
        tokens.append(cands.tokens[nxt])
        node, row = nxt, nxt + 1
