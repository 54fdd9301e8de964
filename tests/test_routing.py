"""Routing capture is exact: it names the experts that really processed each token, and it is
the same whether tokens arrive teacher-forced, one cached step at a time, or inside a tree."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from pipeline.models.adapters import decoder_layers, experts_modules, moe_spec
from pipeline.models.routing import RoutingCapture, forward_with_routing, unique_experts_per_layer
from pipeline.models.treemask import chains_as_tree, tree_attention_inputs
from tests.tinymodels import FAMILIES, VOCAB, tiny_model


def _block_output(output):
    # GPT-OSS's MoE block returns (hidden_states, router_scores).
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
def _moe_block_outputs(model, spec, ids):
    layers = decoder_layers(model)
    outputs: dict[int, torch.Tensor] = {}
    handles = [
        layers[idx].mlp.register_forward_hook(
            lambda mod, args, out, idx=idx: outputs.__setitem__(idx, _block_output(out).clone())
        )
        for idx in spec.moe_layers
    ]
    try:
        model(ids)
    finally:
        for h in handles:
            h.remove()
    return outputs


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_captured_ids_are_the_experts_that_processed_each_token(family):
    """Silence one expert at a time; exactly the tokens whose captured routing names it change."""
    model = tiny_model(family)
    spec = moe_spec(model.config)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    _, routing = forward_with_routing(model, spec, ids)
    routing = routing[0]  # [positions, layers, top_k]
    baseline = _moe_block_outputs(model, spec, ids)
    for slot, (layer_idx, experts) in enumerate(
        zip(spec.moe_layers, experts_modules(model, spec), strict=True)
    ):
        per_expert = [
            p for p in experts.parameters() if p.dim() >= 1 and p.shape[0] == spec.num_experts
        ]
        assert per_expert, f"{family}: no per-expert parameters found"
        for expert in range(spec.num_experts):
            saved = [p[expert].clone() for p in per_expert]
            for p in per_expert:
                p[expert].zero_()
            ablated = _moe_block_outputs(model, spec, ids)[layer_idx]
            for p, s in zip(per_expert, saved, strict=True):
                p[expert].copy_(s)
            changed = (ablated[0] - baseline[layer_idx][0]).abs().amax(-1) > 0
            routed = (routing[:, slot, :] == expert).any(-1)
            assert torch.equal(changed, routed), (family, layer_idx, expert)


@torch.no_grad()
def test_deepseek_selection_is_not_topk_of_router_logits():
    """Why capture hooks the experts' input: DeepSeek-V3's bias and groups change the choice."""
    model = tiny_model("deepseek_v3")
    spec = moe_spec(model.config)
    ids = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(2))
    layer = decoder_layers(model)[spec.moe_layers[0]]
    logits = {}
    handle = layer.mlp.gate.register_forward_hook(lambda m, a, out: logits.__setitem__("x", out[0]))
    try:
        _, routing = forward_with_routing(model, spec, ids)
    finally:
        handle.remove()
    naive = logits["x"].topk(spec.top_k, dim=-1).indices.sort(-1).values
    assert not torch.equal(naive, routing[0, :, 0, :].to(naive.dtype))


def _random_ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_cached_decode_steps_route_like_teacher_forcing(family):
    model = tiny_model(family)
    spec = moe_spec(model.config)
    ids = _random_ids(16, 3)
    _, full = forward_with_routing(model, spec, ids)
    cache = DynamicCache(config=model.config)
    _, prefix = forward_with_routing(
        model, spec, ids[:, :12], past_key_values=cache, use_cache=True
    )
    steps = [prefix]
    for t in range(12, 16):
        _, r = forward_with_routing(
            model, spec, ids[:, t : t + 1], past_key_values=cache, use_cache=True
        )
        steps.append(r)
    assert torch.equal(torch.cat(steps, dim=1), full)


# Two roots (two packed chains), branching, and a node whose siblings precede it.
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, -1, 6, 3]


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_tree_masked_forward_routes_like_plain_chains(family):
    model = tiny_model(family)
    spec = moe_spec(model.config)
    prefix = _random_ids(7, 4)
    tree_tokens = _random_ids(len(TREE_PARENTS), 5)
    cache = DynamicCache(config=model.config)
    model(prefix, past_key_values=cache, use_cache=True)
    mask, positions = tree_attention_inputs(TREE_PARENTS, prefix.shape[1], torch.float32)
    with RoutingCapture(model, spec) as capture:
        tree_out = model(
            tree_tokens,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        tree_routing = capture.take(1, len(TREE_PARENTS))
    for node in range(len(TREE_PARENTS)):
        path = [node]
        while TREE_PARENTS[path[-1]] >= 0:
            path.append(TREE_PARENTS[path[-1]])
        chain = torch.cat([prefix, tree_tokens[:, path[::-1]]], dim=1)
        chain_out, chain_routing = forward_with_routing(model, spec, chain)
        assert torch.equal(chain_routing[0, -1], tree_routing[0, node]), (family, node)
        torch.testing.assert_close(
            chain_out.logits[0, -1], tree_out.logits[0, node], atol=1e-4, rtol=1e-4
        )


def test_unique_experts_per_layer_counts_the_union():
    routing = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [2, 3]], [[0, 5], [3, 4]]])
    assert unique_experts_per_layer(routing, 8).tolist() == [4, 3]


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@torch.no_grad()
def test_capture_is_the_same_for_every_experts_implementation(impl):
    ids = _random_ids(20, 6)
    eager = tiny_model("qwen3_moe")
    other = tiny_model("qwen3_moe", experts_implementation=impl)
    spec = moe_spec(eager.config)
    _, a = forward_with_routing(eager, spec, ids)
    _, b = forward_with_routing(other, spec, ids)
    assert torch.equal(a, b)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_packed_tails_against_a_longer_cache_route_like_plain_chains(family):
    """Junk tails diverging at different points share one cache of the whole reference."""
    model = tiny_model(family)
    spec = moe_spec(model.config)
    reference = _random_ids(12, 7)
    lengths, contexts = [3, 2, 4], [4, 9, 12]  # each tail sees the first `context` positions
    parents = chains_as_tree(lengths)
    root_context = []
    for length, ctx in zip(lengths, contexts, strict=True):
        root_context += [ctx] * length
    tails = _random_ids(len(parents), 8)
    cache = DynamicCache(config=model.config)
    model(reference, past_key_values=cache, use_cache=True)
    mask, positions = tree_attention_inputs(
        parents, reference.shape[1], torch.float32, root_context=root_context
    )
    packed_out, packed = forward_with_routing(
        model,
        spec,
        tails,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
    )
    start = 0
    for length, ctx in zip(lengths, contexts, strict=True):
        chain = torch.cat([reference[:, :ctx], tails[:, start : start + length]], dim=1)
        chain_out, plain = forward_with_routing(model, spec, chain)
        assert torch.equal(plain[0, ctx:], packed[0, start : start + length]), family
        torch.testing.assert_close(
            chain_out.logits[0, ctx:],
            packed_out.logits[0, start : start + length],
            atol=1e-4,
            rtol=1e-4,
        )
        start += length
