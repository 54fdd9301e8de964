"""Forced routing: designs have the asked-for union, and a forced forward really computes the
forced experts, in every supported family and experts implementation."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from pipeline.models.adapters import decoder_layers, experts_modules, moe_spec
from pipeline.models.forced_routing import (
    ForcedRouting,
    design_indices,
    design_plan,
    feasible_unions,
)
from pipeline.models.routing import RoutingCapture
from tests.tinymodels import FAMILIES, VOCAB, tiny_model

SEQ = 12


def _ids(seed: int = 1, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


@contextmanager
def _record_experts_calls(model, spec):
    """Each experts module's (hidden_states, top_k_index, top_k_weights, output), as it ran."""
    calls: list[tuple[torch.Tensor, ...] | None] = [None] * spec.num_moe_layers

    def hook(slot):
        def fwd(module, args, kwargs, output):
            calls[slot] = tuple(t.detach().clone() for t in (*args[:3], output))

        return fwd

    handles = [
        m.register_forward_hook(hook(slot), with_kwargs=True)
        for slot, m in enumerate(experts_modules(model, spec))
    ]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def _natural(model, spec, ids):
    with _record_experts_calls(model, spec) as calls:
        logits = model(ids).logits
    return logits, torch.stack([c[1] for c in calls])


def _as_capture(plan: torch.Tensor, batch: int = 1) -> torch.Tensor:
    """A ``[layers, tokens, top_k]`` plan in RoutingCapture.take's layout and sort order."""
    layers, tokens, top_k = plan.shape
    return plan.permute(1, 0, 2).reshape(batch, tokens // batch, layers, top_k).sort(-1).values


def test_design_indices_rows_distinct_and_union_exact():
    gen = torch.Generator().manual_seed(0)
    rng = torch.Generator().manual_seed(1)
    for num_experts, top_k in [(8, 2), (16, 4), (6, 6), (64, 8), (5, 1)]:
        for _ in range(40):
            m = int(torch.randint(1, 20, (1,), generator=rng))
            allowed = feasible_unions(m, top_k, num_experts)
            u = allowed[int(torch.randint(0, len(allowed), (1,), generator=rng))]
            design = design_indices(m, u, top_k, num_experts, gen)
            assert design.shape == (m, top_k) and design.dtype == torch.long
            assert int(design.min()) >= 0 and int(design.max()) < num_experts
            assert all(len(set(row.tolist())) == top_k for row in design), design
            assert design.unique().numel() == u, (m, u, top_k, num_experts)


def test_design_indices_bounds_and_randomness():
    gen = torch.Generator().manual_seed(0)
    assert feasible_unions(3, 2, 8) == range(2, 7)
    assert feasible_unions(10, 2, 8) == range(2, 9)
    for u in (1, 7, 9):
        with pytest.raises(ValueError, match="infeasible"):
            design_indices(3, u, 2, 8, gen)
    with pytest.raises(ValueError, match="infeasible"):
        design_indices(4, 3, 4, 2, gen)  # top_k > num_experts: nothing is feasible
    draws = [design_indices(6, 5, 2, 64, gen) for _ in range(8)]
    assert len({tuple(d.unique().tolist()) for d in draws}) > 1, "expert identities never vary"
    assert len({tuple(d.flatten().tolist()) for d in draws}) == len(draws)
    # The pinned experts must not always land in the same rows / slots.
    firsts = {tuple(design_indices(6, 12, 2, 12, gen)[0].sort().values.tolist()) for _ in range(20)}
    assert len(firsts) > 1
    same = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(design_indices(6, 5, 2, 64, same[0]), design_indices(6, 5, 2, 64, same[1]))


def test_design_plan_draws_each_layer_independently():
    spec = moe_spec(tiny_model("mixtral").config)
    plan = design_plan(SEQ, 5, spec, torch.Generator().manual_seed(0))
    assert plan.shape == (spec.num_moe_layers, SEQ, spec.top_k)
    assert all(layer.unique().numel() == 5 for layer in plan)
    assert len({tuple(layer.flatten().tolist()) for layer in plan}) == spec.num_moe_layers


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_forced_experts_are_the_ones_computed(family):
    model = tiny_model(family)
    spec = moe_spec(model.config)
    ids = _ids()
    natural_logits, natural = _natural(model, spec, ids)
    plan = design_plan(SEQ, 3, spec, torch.Generator().manual_seed(3))
    assert not torch.equal(plan, natural)
    with ForcedRouting(model, spec) as forced, RoutingCapture(model, spec) as capture:
        forced.set(plan)
        with _record_experts_calls(model, spec) as calls:
            forced_logits = model(ids).logits
        routing = capture.take(1, SEQ)
    assert torch.equal(routing, _as_capture(plan)), family
    assert not torch.equal(forced_logits, natural_logits)
    # Outside every hook: the experts module given the forced indices gives the recorded output,
    # and the router's choice for the very same hidden states would not have.
    for slot, experts in enumerate(experts_modules(model, spec)):
        hidden, index, weights, output = calls[slot]
        assert torch.equal(index, plan[slot]) and index.dtype == natural.dtype
        assert torch.equal(experts(hidden, plan[slot], weights), output), (family, slot)
        assert weights.shape == index.shape
    first = experts_modules(model, spec)[0]
    hidden, _, weights, output = calls[0]  # layer 0's input does not depend on any forcing
    assert not torch.equal(first(hidden, natural[0], weights), output)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_forcing_the_natural_choice_reproduces_the_logits(family):
    model = tiny_model(family)
    spec = moe_spec(model.config)
    ids = _ids(seed=4)
    natural_logits, natural = _natural(model, spec, ids)
    with ForcedRouting(model, spec) as forced:
        forced.set(natural)
        assert torch.equal(model(ids).logits, natural_logits)
        forced.set(torch.flip(natural, dims=[-1]))  # same experts, weights now misassigned
        assert not torch.equal(model(ids).logits, natural_logits)
        forced.set(None)
        with RoutingCapture(model, spec) as capture:
            assert torch.equal(model(ids).logits, natural_logits)
            assert torch.equal(capture.take(1, SEQ), _as_capture(natural))


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
@torch.no_grad()
def test_shared_experts_are_unaffected(family):
    model = tiny_model(family)
    spec = moe_spec(model.config)
    mlp = decoder_layers(model)[spec.moe_layers[0]].mlp
    shared = mlp.shared_expert if family == "qwen2_moe" else mlp.shared_experts
    outs: list[torch.Tensor] = []
    handle = shared.register_forward_hook(lambda m, a, out: outs.append(out.clone()))
    routed: list[torch.Tensor] = []
    handle2 = mlp.experts.register_forward_hook(lambda m, a, out: routed.append(out.clone()))
    try:
        model(_ids())
        with ForcedRouting(model, spec) as forced:
            forced.set(design_plan(SEQ, 4, spec, torch.Generator().manual_seed(0)))
            model(_ids())
    finally:
        handle.remove()
        handle2.remove()
    assert torch.equal(outs[0], outs[1])  # the first MoE layer sees the same hidden states
    assert not torch.equal(routed[0], routed[1])


@pytest.mark.parametrize("impl", ["batched_mm", "grouped_mm"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@torch.no_grad()
def test_other_experts_implementations(family, impl):
    model = tiny_model(family, experts_implementation=impl)
    spec = moe_spec(model.config)
    ids = _ids(batch=2)
    natural_logits, natural = _natural(model, spec, ids)
    plan = design_plan(2 * SEQ, 5, spec, torch.Generator().manual_seed(1))
    with RoutingCapture(model, spec) as capture, ForcedRouting(model, spec) as forced:
        # Entered after the capture, yet prepended: the capture still sees the forced indices.
        forced.set(natural)
        assert torch.allclose(model(ids).logits, natural_logits, atol=1e-6, rtol=0)
        forced.set(plan)
        with _record_experts_calls(model, spec) as calls:
            model(ids)
        assert torch.equal(capture.take(2, SEQ), _as_capture(plan, batch=2))
    for slot, experts in enumerate(experts_modules(model, spec)):
        hidden, _, weights, output = calls[slot]
        assert torch.allclose(experts(hidden, plan[slot], weights), output, atol=1e-6, rtol=0)


@torch.no_grad()
def test_bad_plans_raise_and_hooks_are_removed():
    model = tiny_model("deepseek_v3")
    spec = moe_spec(model.config)
    modules = experts_modules(model, spec)
    before = [len(m._forward_pre_hooks) for m in modules]
    gen = torch.Generator().manual_seed(0)
    with ForcedRouting(model, spec) as forced:
        forced.set(design_plan(SEQ + 1, 3, spec, gen))
        with pytest.raises(
            ValueError, match=r"MoE layer 0 \(decoder layer 1\).*\(13, 2\).*\(12, 2\)"
        ):
            model(_ids())
        with pytest.raises(ValueError, match="top_k=2"):
            forced.set(torch.zeros(spec.num_moe_layers + 1, SEQ, spec.top_k, dtype=torch.long))
        with pytest.raises(ValueError, match=r"in \[0, 8\)"):
            forced.set(torch.full((spec.num_moe_layers, SEQ, spec.top_k), 8))
        with pytest.raises(ValueError, match="integers"):
            forced.set(torch.zeros(spec.num_moe_layers, SEQ, spec.top_k))
        # A top_k mismatch is caught per layer at the forward.
        forced.set(torch.zeros(spec.num_moe_layers, SEQ, 1, dtype=torch.long))
        with pytest.raises(ValueError, match=r"\(12, 1\).*\(12, 2\)"):
            model(_ids())
        assert [len(m._forward_pre_hooks) for m in modules] == [b + 1 for b in before]
    assert [len(m._forward_pre_hooks) for m in modules] == before
    model(_ids())  # nothing left behind
