"""Routing capture: the experts the target's router actually selected, for any forward.

A forward pre-hook on each MoE layer's experts module reads the ``top_k_index`` argument the
block passes in. That tensor is the router's final selection (after DeepSeek-V3's bias and group
limits, after GPT-OSS's biased top-k), so it is exact where top-k of the raw logits is not. It
works the same for a teacher-forced pass, a cached decode step or a tree-masked forward, and for
every experts implementation (eager, grouped_mm, batched_mm).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipeline.models.adapters import MoESpec, experts_modules


class RoutingCapture:
    """Context manager that records the selected experts of every forward run inside it.

    ``take(batch, seq_len)`` returns the latest forward's routing as an int tensor of shape
    ``[batch, seq_len, n_moe_layers, top_k]``, each token's experts sorted ascending.
    """

    def __init__(self, model: nn.Module, spec: MoESpec) -> None:
        self.spec = spec
        self._modules = experts_modules(model, spec)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._latest: list[torch.Tensor | None] = [None] * len(self._modules)

    def _hook(self, slot: int):
        def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            index = kwargs.get("top_k_index")
            if index is None:
                index = args[1]
            self._latest[slot] = index.detach()

        return pre_hook

    def __enter__(self) -> RoutingCapture:
        for slot, module in enumerate(self._modules):
            self._handles.append(
                module.register_forward_pre_hook(self._hook(slot), with_kwargs=True)
            )
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def take(self, batch: int, seq_len: int) -> torch.Tensor:
        if any(t is None for t in self._latest):
            raise RuntimeError("no forward pass was captured (run the model inside the context)")
        per_layer = [t.reshape(batch, seq_len, -1) for t in self._latest]  # type: ignore[union-attr]
        self._latest = [None] * len(self._modules)
        routing = torch.stack(per_layer, dim=2)
        return routing.sort(dim=-1).values


@torch.no_grad()
def forward_with_routing(
    model: nn.Module, spec: MoESpec, input_ids: torch.Tensor, **forward_kwargs: Any
) -> tuple[Any, torch.Tensor]:
    """Run ``model(input_ids, **forward_kwargs)`` and return (outputs, routing)."""
    with RoutingCapture(model, spec) as capture:
        outputs = model(input_ids, **forward_kwargs)
        routing = capture.take(*input_ids.shape)
    return outputs, routing


def unique_experts_per_layer(routing: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Unique experts per MoE layer over a set of positions.

    ``routing`` is ``[positions, layers, top_k]``; returns ``[layers]`` counts of the union.
    """
    positions, layers, top_k = routing.shape
    hit = torch.zeros(layers, num_experts, dtype=torch.bool, device=routing.device)
    layer_ids = torch.arange(layers, device=routing.device).view(1, layers, 1).expand_as(routing)
    hit[layer_ids.reshape(-1), routing.reshape(-1).long()] = True
    return hit.sum(dim=1)


def verification_forward(
    model: nn.Module, spec: MoESpec, ids: torch.Tensor, cache, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """One verification pass as the engine times it: the forward on the cache with the routing
    captured; (logits [seq, vocab], routing [seq, layers, top_k]). Designed calibration times
    this same call, so the cost model prices the hooks and bookkeeping decoding pays."""
    with RoutingCapture(model, spec) as capture:
        out = model(ids, past_key_values=cache, use_cache=True, **kwargs)
        return out.logits[0], capture.take(1, ids.shape[1])[0]
