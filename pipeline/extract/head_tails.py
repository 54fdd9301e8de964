"""Junk tails drafted by an EAGLE-3 head (pipeline.extract.junk_tails for a separate draft).

A tail diverging after ``x_s`` is what the head would draft there: its first token from the
head's teacher-forced distribution after ``x_s`` (the same ``first_tokens`` rule as a draft
model's), each later one from the head's own pre-norm output at the previous tail token, the
way a chain is drafted (pipeline.decode.head_drafter). Head position p reads token p + 1, so the
tail's r-th token sits at head position ``p0 + s + r - 1`` and sees the reference's head
positions before ``p0 + s`` (``contexts - 1``, contexts counting the target's positions
``x_{<= s}``) and its own earlier tokens. All tails are packed into one head step per tail
position, as a draft model's are.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pipeline.extract.junk_tails import TailSpecs, packed_visibility, pick_next
from pipeline.models.eagle3 import Eagle3Head, HeadCache


@torch.no_grad()
def head_chains(
    head: Eagle3Head,
    cache: HeadCache,
    outputs: torch.Tensor,
    contexts: np.ndarray,
    first: np.ndarray,
    lengths: np.ndarray,
    choose: Callable[[int, np.ndarray, torch.Tensor, torch.Tensor], np.ndarray],
) -> np.ndarray:
    """Chains of ``lengths[b]`` tokens drafted by the head after the first ``contexts[b]``
    target positions of a reference, packed: chain b starts with ``first[b]``; the step for
    token r (r >= 2) feeds every active chain's token r - 1 with its state and asks
    ``choose(r, active, logits, states)`` (the active chains' indices, their logits over the
    target vocabulary and the head's pre-norm states that produced them) for their tokens r.
    ``cache`` holds the head's positions of the whole reference, ``outputs`` [positions, H]
    its pre-norm output at each target position (row t: the state that predicted token
    t + 1). The tokens, [chains, max length]; the cache is returned to its original length."""
    device = head.device
    base_len = len(cache)
    tokens = np.zeros((len(first), int(lengths.max())), dtype=np.int64)
    tokens[:, 0] = first
    visible_ctx = torch.from_numpy(contexts - 1).to(device)  # head positions before the chain
    # The state each chain's next token reads: at first the head's output after its prefix.
    parent = outputs[torch.from_numpy(contexts - 1).to(outputs.device)].to(device, head.dtype)
    owners = torch.zeros(0, dtype=torch.long, device=device)  # chain owning each appended slot
    try:
        for r in range(2, tokens.shape[1] + 1):
            active = np.nonzero(lengths >= r)[0]
            act = torch.from_numpy(active).to(device)
            visible = packed_visibility(base_len, visible_ctx[act], owners, act)
            positions = (visible_ctx[act] + (r - 2)).view(1, -1)
            step_ids = torch.from_numpy(tokens[active, r - 2]).to(device).view(1, -1)
            mask = visible.view(1, 1, *visible.shape)
            logits, out = head(step_ids, parent[act].unsqueeze(0), positions, cache, mask)
            parent[act] = out[0]
            tokens[active, r - 1] = choose(r, active, logits[0], out[0])
            owners = torch.cat([owners, act])
    finally:
        cache.crop(base_len)
    return tokens


def sample_head_tails(
    head: Eagle3Head,
    cache: HeadCache,
    outputs: torch.Tensor,
    first: np.ndarray,
    contexts: np.ndarray,
    specs: TailSpecs,
    temperature: float = 1.0,
) -> list[np.ndarray]:
    """Continue every tail in ``specs`` from ``first[b]`` (head_chains): greedy tails take the
    head's argmax, the others sample at ``temperature`` with the tail's keyed uniforms;
    ``contexts[b]`` counts the target positions tail b follows."""
    if len(specs) == 0:
        return []

    def choose(r: int, active: np.ndarray, logits: torch.Tensor, _: torch.Tensor) -> np.ndarray:
        picked = np.zeros((len(specs), r), dtype=np.int64)
        pick_next(picked, logits, active, r, specs, temperature)
        return picked[active, r - 1]

    tokens = head_chains(head, cache, outputs, contexts, first, specs.length, choose)
    return [tokens[b, : specs.length[b]] for b in range(len(specs))]
