"""Teacher-forced passes of reference sequences: what extraction reads from the target and the
draft before any junk tail is drawn.

Per sequence: the target's routing of ``x_0 .. x_N``, both models' logits after
``x_0 .. x_{N-1}`` (row j predicts ``x_{j+1}``), and both KV caches of the whole reference,
which the junk tails are verified against. ``teacher_forced`` runs one sequence alone;
``teacher_forced_batch`` runs several in one left-padded forward per model (a 2D attention
mask, per-row positions counted from each row's first token) and slices each row's logits,
routing and caches back out, so the rows read the same values a lone pass would (up to float
rounding of the batched matmuls).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import Cache, DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from pipeline.data.references import ReferenceSequence, left_padded
from pipeline.models.draft_pass import draft_pass
from pipeline.models.eagle3 import HeadCache
from pipeline.models.features import feature_tap
from pipeline.models.loading import ModelPair
from pipeline.models.routing import forward_with_routing

# Cache layers holding one K/V tensor per layer, [batch, heads, positions, dim]: a row is a slice.
_SLICEABLE = (DynamicLayer, DynamicSlidingWindowLayer)


@dataclass
class TeacherForced:
    routing: np.ndarray  # [N + 1, layers, top_k] int16: the target's experts for x_0 .. x_N
    target_logits: torch.Tensor  # [N, vocab], model dtype
    draft_logits: torch.Tensor  # [N, vocab], float32
    target_cache: Cache  # every position of the reference
    draft_cache: Cache | HeadCache  # a head's: its positions 0 .. prompt + N - 2
    # The draft's last hidden state after every position of prompt + reference (EcoSpec's
    # predictor contexts in the draft trees; a head's pre-norm output, which the next draft
    # step of a junk tail reads), [prompt + N, hidden].
    draft_hidden: torch.Tensor | None = None


@torch.no_grad()
def teacher_forced(pair: ModelPair, ref: ReferenceSequence) -> TeacherForced:
    """One sequence alone (extraction's original path)."""
    ids = torch.tensor([ref.all_ids], device=pair.device)
    p0, n = ref.prompt_len - 1, ref.n_tokens  # p0: absolute index of x_0
    # Logits of x_0 .. x_N only (the prompt's other positions predict nothing we use).
    keep = {"logits_to_keep": n + 1, "use_cache": True}
    target_cache = DynamicCache(config=pair.target.config)
    tap = feature_tap(pair.target, pair.draft.cfg.aux_layer_ids) if pair.draft_is_head else None
    target_out, routing = forward_with_routing(
        pair.target, pair.spec, ids, past_key_values=target_cache, **keep
    )
    if tap is not None:
        # The head teacher-forced on the target's features of the reference (docs/contract.md:
        # a head is a draft like any other): row t is its distribution of token t + 1 as the
        # first token of a chain drafted after t.
        head_cache = HeadCache()
        logits, hidden = draft_pass(pair, ids, tap.latest(), head_cache)
        return TeacherForced(
            routing=routing[0, p0:].to(torch.int16).cpu().numpy(),
            target_logits=target_out.logits[0, :n],
            draft_logits=logits[0, p0 : p0 + n],
            target_cache=target_cache,
            draft_cache=head_cache,
            draft_hidden=hidden[0],
        )
    draft_cache = DynamicCache(config=pair.draft.config)
    draft_out = pair.draft(ids, past_key_values=draft_cache, output_hidden_states=True, **keep)
    return TeacherForced(
        routing=routing[0, p0:].to(torch.int16).cpu().numpy(),
        target_logits=target_out.logits[0, :n],
        draft_logits=draft_out.logits[0, :n].float(),
        target_cache=target_cache,
        draft_cache=draft_cache,
        draft_hidden=draft_out.hidden_states[-1][0],
    )


def row_cache(cache: Cache, config: PretrainedConfig, row: int, length: int) -> DynamicCache:
    """Row ``row`` of a left-padded batch's cache as a cache of its own: its last ``length``
    positions (the row's tokens; the pads sit before them)."""
    out = DynamicCache(config=config)
    for idx, layer in enumerate(cache.layers):
        if type(layer) not in _SLICEABLE or layer.keys.shape[-2] < length:
            raise TypeError(
                f"cache layer {idx} ({type(layer).__name__}) cannot be split into rows; "
                "extract with batch size 1"
            )
        out.update(
            layer.keys[row : row + 1, ..., -length:, :],
            layer.values[row : row + 1, ..., -length:, :],
            idx,
        )
        if type(out.layers[idx]) is not type(layer):
            raise TypeError(f"cache layer {idx}: the row's cache has another layer type")
    return out


@torch.no_grad()
def teacher_forced_batch(pair: ModelPair, refs: list[ReferenceSequence]) -> list[TeacherForced]:
    """The passes of ``refs`` in one forward per model; ``refs[b]``'s result is row b. Left
    padding lines every row's last token up, so keeping the last ``max N + 1`` logits covers
    every row's ``x_0 .. x_N`` (no more logits than the lone passes compute in all). An
    EAGLE-3 head's sequences run one at a time (its features come from each target pass)."""
    if len(refs) == 1 or pair.draft_is_head:
        return [teacher_forced(pair, ref) for ref in refs]
    ids, mask, positions = left_padded([list(r.all_ids) for r in refs], pair.device)
    keep = max(r.n_tokens for r in refs) + 1
    kwargs = {
        "attention_mask": mask,
        "position_ids": positions,
        "use_cache": True,
        "logits_to_keep": keep,
    }
    target_cache = DynamicCache(config=pair.target.config)
    target_out, routing = forward_with_routing(
        pair.target, pair.spec, ids, past_key_values=target_cache, **kwargs
    )
    draft_cache = DynamicCache(config=pair.draft.config)
    draft_out = pair.draft(ids, past_key_values=draft_cache, output_hidden_states=True, **kwargs)
    draft_logits, draft_hidden = draft_out.logits, draft_out.hidden_states[-1]
    routing = routing.to(torch.int16).cpu().numpy()
    out = []
    for b, ref in enumerate(refs):
        n, length = ref.n_tokens, len(ref.all_ids)
        rows = slice(keep - 1 - n, keep - 1)  # after x_0 .. x_{N-1}
        out.append(
            TeacherForced(
                routing=routing[b, -(n + 1) :],
                target_logits=target_out.logits[b, rows],
                draft_logits=draft_logits[b, rows].float(),
                target_cache=row_cache(target_cache, pair.target.config, b, length),
                draft_cache=row_cache(draft_cache, pair.draft.config, b, length),
                draft_hidden=draft_hidden[b, -length:],
            )
        )
    return out
