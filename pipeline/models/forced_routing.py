"""Forced routing: run a target forward with routed experts chosen by design, not by the router.

A verification forward costs what the experts it computes cost, whatever the router would have
picked, so calibration sets the routing: ``design_plan`` draws, per MoE layer, a token-to-expert
assignment touching exactly ``u`` distinct experts, and ``ForcedRouting`` substitutes it for the
router's ``top_k_index`` at the experts module's input (the same seam ``RoutingCapture`` reads).
The router still runs and its ``top_k_weights`` are kept, so a forced forward does the same work
as a natural one apart from which experts are hit. Shared experts are untouched: they sit beside
the experts module and see only the hidden states.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipeline.models.adapters import MoESpec, experts_modules

# Every supported family passes (hidden_states, top_k_index, top_k_weights) positionally; the
# names are the keyword fallbacks (GPT-OSS's eager experts calls its index ``router_indices``).
_INDEX_POSITION = 1
_INDEX_KEYWORDS = ("top_k_index", "router_indices")


class ForcedRouting:
    """Context manager that makes each MoE layer's experts compute with given expert indices.

    ``set(indices)`` takes a ``[num_moe_layers, tokens, top_k]`` integer tensor, tokens being
    ``batch * seq_len`` of the next forward in row-major (batch-major) order, and keeps forcing
    it for every forward inside the context until ``set(None)`` restores the router's choice.
    """

    def __init__(self, model: nn.Module, spec: MoESpec) -> None:
        self.spec = spec
        self._modules = experts_modules(model, spec)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._plan: torch.Tensor | None = None
        # Per-layer copy of the plan on the device/dtype the experts module was last given, so
        # repeated timed forwards do not pay a host-to-device copy each time.
        self._ready: list[torch.Tensor | None] = [None] * len(self._modules)

    def set(self, indices: torch.Tensor | None) -> None:
        self._ready = [None] * len(self._modules)
        if indices is None:
            self._plan = None
            return
        spec = self.spec
        if (
            indices.dtype.is_floating_point
            or indices.dtype.is_complex
            or indices.dtype == torch.bool
        ):
            raise ValueError(f"forced expert indices must be integers, got {indices.dtype}")
        if indices.dim() != 3 or indices.shape[0] != spec.num_moe_layers:
            raise ValueError(
                f"forced expert indices must have shape [num_moe_layers={spec.num_moe_layers}, "
                f"tokens, top_k={spec.top_k}], got {tuple(indices.shape)}"
            )
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= spec.num_experts):
            # The eager kernels silently skip an out-of-range expert; refuse instead.
            raise ValueError(
                f"forced expert indices must lie in [0, {spec.num_experts}), got "
                f"[{int(indices.min())}, {int(indices.max())}]"
            )
        self._plan = indices.detach().contiguous()

    def _hook(self, slot: int):
        def pre_hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
            if self._plan is None:
                return None
            key = next((k for k in _INDEX_KEYWORDS if k in kwargs), None)
            if key is not None:
                router_index = kwargs[key]
            elif len(args) > _INDEX_POSITION:
                router_index = args[_INDEX_POSITION]
            else:
                raise RuntimeError(
                    f"{type(module).__name__} was called without expert indices at position "
                    f"{_INDEX_POSITION} or as one of {_INDEX_KEYWORDS}; cannot force its routing"
                )
            forced = self._forced_for(slot, router_index)
            if key is not None:
                return args, {**kwargs, key: forced}
            return (*args[:_INDEX_POSITION], forced, *args[_INDEX_POSITION + 1 :]), kwargs

        return pre_hook

    def _forced_for(self, slot: int, router_index: torch.Tensor) -> torch.Tensor:
        ready = self._ready[slot]
        if (
            ready is None
            or ready.device != router_index.device
            or ready.dtype != router_index.dtype
        ):
            assert self._plan is not None
            ready = self._plan[slot].to(device=router_index.device, dtype=router_index.dtype)
            self._ready[slot] = ready
        # The router's weights are kept as they are, so the index must match their shape.
        if ready.shape != router_index.shape:
            layer = self.spec.moe_layers[slot]
            raise ValueError(
                f"forced routing for MoE layer {slot} (decoder layer {layer}) has shape "
                f"{tuple(ready.shape)} but the router selected {tuple(router_index.shape)} "
                "([tokens = batch * seq_len, top_k]) in this forward"
            )
        return ready

    def __enter__(self) -> ForcedRouting:
        for slot, module in enumerate(self._modules):
            # Prepended, so every other pre-hook (RoutingCapture included, whenever it was
            # entered) sees the indices the experts actually compute with.
            self._handles.append(
                module.register_forward_pre_hook(self._hook(slot), with_kwargs=True, prepend=True)
            )
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.set(None)


def feasible_unions(m: int, top_k: int, num_experts: int) -> range:
    """Union sizes a design of ``m`` tokens can have: every token takes ``top_k`` distinct
    experts (so at least ``top_k`` in all) and there are only ``m * top_k`` slots to fill."""
    if m < 1 or top_k < 1:
        raise ValueError(f"need m >= 1 and top_k >= 1, got m={m}, top_k={top_k}")
    return range(top_k, min(m * top_k, num_experts) + 1)


def design_indices(
    m: int, u: int, top_k: int, num_experts: int, generator: torch.Generator
) -> torch.Tensor:
    """A random ``[m, top_k]`` routing whose rows are distinct experts and whose union is
    exactly ``u`` experts, drawn at random from ``num_experts``.

    Each of the ``u`` experts is pinned into one row (row-major, ``top_k`` per row, so no row
    gets more than ``top_k`` pins); every row is then completed with the top-scoring experts of
    a uniform random score over the ``u``, pins scored above all. Loads are therefore random
    around ``m * top_k / u`` tokens per expert, like a router's, rather than exactly balanced.
    """
    allowed = feasible_unions(m, top_k, num_experts)
    if u not in allowed:
        raise ValueError(
            f"union size u={u} is infeasible for m={m} tokens, top_k={top_k}, "
            f"num_experts={num_experts}: need {allowed.start} <= u <= {allowed.stop - 1}"
        )
    device = generator.device
    experts = torch.randperm(num_experts, generator=generator, device=device)[:u]
    scores = torch.rand(m, u, generator=generator, device=device)
    slots = torch.arange(u, device=device)
    scores[slots // top_k, slots] = 2.0  # above any uniform draw, so the pin is in the top-k
    chosen = experts[scores.topk(top_k, dim=-1).indices]
    # topk orders by score (pins first) and pins sit in the first rows: shuffle both away.
    rows = torch.randperm(m, generator=generator, device=device)
    within = torch.rand(m, top_k, generator=generator, device=device).argsort(dim=-1)
    return chosen[rows].gather(1, within)


def design_plan(m: int, u: int, spec: MoESpec, generator: torch.Generator) -> torch.Tensor:
    """``[num_moe_layers, m, top_k]``: an independent ``design_indices`` draw per MoE layer."""
    return torch.stack(
        [
            design_indices(m, u, spec.top_k, spec.num_experts, generator)
            for _ in range(spec.num_moe_layers)
        ]
    )
