"""The draft's teacher-forced pass over a sequence, whatever the draft is: row t is the draft's
prediction of token t + 1 given tokens 0..t, and the hidden state that produced it.

A causal LM gives this from one forward. An EAGLE-3 head predicts token t + 1 at its position
t - 1 (which reads the target's features at t - 1 and token t), so it needs the target's pass
first; its row 0 has no prediction (uniform logits, a zero state). At each row the head reads
only the target's features, as for the first token a step drafts; later tokens of a chain
read the head's own states, and are accepted less often than these rows say.
"""

from __future__ import annotations

import torch

from pipeline.models.eagle3 import HeadCache
from pipeline.models.features import feature_tap
from pipeline.models.loading import ModelPair


@torch.no_grad()
def draft_pass(
    pair: ModelPair,
    ids: torch.Tensor,
    target_features: torch.Tensor | None = None,
    head_cache: HeadCache | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [1, T, V], last hidden state [1, T, H]) of the draft over ``ids`` [1, T]; for a
    head, ``target_features`` [1, T, 3H] from a target pass over ``ids`` (else one runs), its
    hidden state the pre-norm output a next draft step reads, and its keys and values of head
    positions 0 .. T - 2 left in ``head_cache`` where one is given (junk tails continue it)."""
    if not pair.draft_is_head:
        out = pair.draft(ids, output_hidden_states=True)
        return out.logits, out.hidden_states[-1]
    head = pair.draft
    if target_features is None:
        tap = feature_tap(pair.target, head.cfg.aux_layer_ids)
        pair.target(ids)
        target_features = tap.latest()
    t = ids.shape[1]
    logits = torch.zeros(1, t, head.cfg.vocab_size, device=ids.device)
    hidden = torch.zeros(1, t, head.cfg.hidden_size, device=ids.device)
    if t >= 2:
        positions = torch.arange(t - 1, device=ids.device).view(1, -1)
        cache = HeadCache() if head_cache is None else head_cache
        out_logits, out = head(ids[:, 1:], target_features[:, : t - 1], positions, cache)
        logits[:, 1:] = out_logits.float()
        hidden[:, 1:] = out.float()
    return logits, hidden
