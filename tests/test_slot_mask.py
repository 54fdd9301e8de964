"""The slot cache's packed-forward mask is built only when read (pipeline.models.slots): the
segmented SDPA path never builds the whole [N, rows * capacity] mask, yet attends by exactly
its diagonal blocks; any other reader (eager attention, a caller) gets the same values the
mask always had."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from pipeline.models.slots import LazyMask, SlotCache, segmented_attention
from tests.tinymodels import FAMILIES, tiny_model

SEQS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
CPU = torch.device("cpu")


def _packed(model, cache: SlotCache, parts):
    """One packed forward of ``parts`` (row, ids, visibility) as the batcher runs it (under
    segmented_attention, which only an SDPA model takes): its logits and its mask."""
    positions = [
        p for r, ids, _ in parts for p in range(cache.length[r], cache.length[r] + len(ids))
    ]
    mask = cache.plan([(r, len(ids), vis) for r, ids, vis in parts], model.dtype, CPU)
    kw = {
        "past_key_values": cache,
        "use_cache": True,
        "attention_mask": mask,
        "position_ids": torch.tensor([positions]),
    }
    ids = torch.tensor([[t for _, ids, _ in parts for t in ids]])
    with torch.no_grad(), segmented_attention(model, cache):
        return model(ids, **kw).logits[0], mask


def _steps(rows: list[int]) -> tuple[list, list]:
    """Every sequence but its last token, then every last token: two packed forwards."""
    pairs = list(zip(rows, SEQS, strict=True))
    return [(r, s[:-1], None) for r, s in pairs], [(r, s[-1:], None) for r, s in pairs]


def _alone(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        return model(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1]


def _expected_mask(cache: SlotCache, visibility: list[torch.Tensor], width: int, dtype):
    """The whole mask as the plan describes it: each part's visibility in its own block."""
    total = sum(v.shape[0] for v in visibility)
    visible = torch.zeros(total, width, dtype=torch.bool)
    for (q0, q1, k0, k1), vis in zip(cache.segments, visibility, strict=True):
        visible[q0:q1, k0:k1] = vis
    mask = torch.zeros(total, width, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask.view(1, 1, total, width)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt_oss"])
def test_the_segmented_path_never_builds_the_whole_mask(family):
    model = tiny_model(family)
    assert model.config._attn_implementation == "sdpa"
    cache = SlotCache(model.config.num_hidden_layers, rows=2, capacity=8)  # both must grow
    prefix, last_tokens = _steps([cache.acquire() for _ in SEQS])
    _, first = _packed(model, cache, prefix)
    got, last = _packed(model, cache, last_tokens)
    assert isinstance(first, LazyMask) and not first.built and not last.built
    for j, s in enumerate(SEQS):
        torch.testing.assert_close(got[j], _alone(model, s), atol=1e-4, rtol=1e-4)
    # What the segments attended by: exactly the whole mask's diagonal blocks.
    dense = last.dense()
    for (q0, q1, k0, k1), block in zip(cache.segments, cache.segment_masks(), strict=True):
        assert torch.equal(block, dense[:, :, q0:q1, k0:k1])


def test_a_read_mask_is_the_mask_the_plan_describes():
    """A causal part and a tree part (a node that sees the root but not its sibling)."""
    cache = SlotCache(2, rows=2, capacity=4)
    a, b = cache.acquire(), cache.acquire()
    cache.plan([(a, 3, None), (b, 2, None)], torch.float32, CPU)
    tree = torch.ones(3, 6, dtype=torch.bool)
    tree[:, 3:] = torch.tril(tree[:, 3:])
    tree[2, 4] = False
    mask = cache.plan([(a, 3, tree), (b, 1, None)], torch.float32, CPU)
    assert tuple(mask.shape) == (1, 1, 4, 16) and mask.dtype == torch.float32
    assert not mask.built  # reading its shape and dtype builds nothing
    causal = torch.ones(1, 3, dtype=torch.bool)
    want = _expected_mask(cache, [tree, causal], cache.capacity * 2, torch.float32)
    assert torch.equal(mask + 0, want) and mask.built  # any operation reads the values
    with pytest.raises(ValueError, match="visibility"):
        cache.plan([(a, 2, tree)], torch.float32, CPU)


def test_eager_attention_reads_the_whole_mask_and_decodes_the_same():
    model = tiny_model("qwen3_moe")
    model.set_attn_implementation("eager")
    cache = SlotCache(model.config.num_hidden_layers, rows=2, capacity=8)
    prefix, last_tokens = _steps([cache.acquire() for _ in SEQS])
    _packed(model, cache, prefix)
    got, mask = _packed(model, cache, last_tokens)
    assert mask.built  # eager attention adds the mask: it had to be built
    for j, s in enumerate(SEQS):
        torch.testing.assert_close(got[j], _alone(model, s), atol=1e-4, rtol=1e-4)
