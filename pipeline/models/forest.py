"""One forward of the target over a packed forest: node j follows its ancestors after the
cache's first ``root_context[j]`` positions (tree_attention_inputs), the cache returned to its
length afterwards. What extraction asks of it: the routing of junk tails and of draft trees'
off-path nodes (pipeline.extract.junk_tails), the target's distribution after every node of
the trees along sampled text (pipeline.extract.sampled_trees)."""

from __future__ import annotations

import numpy as np
import torch
from transformers import Cache, PreTrainedModel

from pipeline.models.adapters import MoESpec
from pipeline.models.kvcache import crop_to
from pipeline.models.routing import RoutingCapture
from pipeline.models.treemask import tree_attention_inputs


@torch.no_grad()
def forest_forward(
    target: PreTrainedModel,
    cache: Cache,
    tokens: list[int] | np.ndarray,
    parents: list[int],
    root_context: list[int],
    spec: MoESpec | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the target's logits after each node [nodes, vocab] in its dtype, its routing of each
    node [nodes, layers, top_k] when ``spec`` is given, else None). The logits stay in the
    model's dtype: a routing-only caller (junk tails) never reads them, and on a bf16 target a
    float32 copy of [nodes, vocab] would be wasted."""
    device = next(target.parameters()).device
    base_len = cache.get_seq_length()
    if not len(tokens):
        routing = None if spec is None else torch.zeros(0, spec.num_moe_layers, spec.top_k)
        return torch.zeros(0, target.config.vocab_size, dtype=target.dtype), routing
    mask, positions = tree_attention_inputs(
        parents, base_len, target.dtype, device, root_context=root_context
    )
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=device).view(1, -1)
    kwargs = {"attention_mask": mask, "position_ids": positions}
    try:
        if spec is None:
            out = target(ids, past_key_values=cache, use_cache=True, **kwargs)
            return out.logits[0], None
        with RoutingCapture(target, spec) as capture:
            out = target(ids, past_key_values=cache, use_cache=True, **kwargs)
            routing = capture.take(1, ids.shape[1])[0]
        return out.logits[0], routing
    finally:
        crop_to(cache, base_len)
