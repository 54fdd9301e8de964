"""The target's hidden states an EAGLE-3 head reads, captured from any target forward.

A forward pre-hook on each tapped decoder layer keeps the hidden state entering it (vLLM's
convention for ``eagle_aux_hidden_state_layer_ids``: layer i's input is transformers'
``hidden_states[i]``; id L, one past the last layer, is that layer's output before the final
norm). Like routing capture it needs no change to the forward: a prefill, a
cached verification pass or a tree-masked one all leave their features behind. One tap per
target and layer set is shared by every session decoding with it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of an HF causal LM."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers to tap")
    return layers


class FeatureTap:
    """Keeps the input hidden states of ``layer_ids`` from the latest forward of ``model``."""

    def __init__(self, model: nn.Module, layer_ids: tuple[int, ...]) -> None:
        layers = decoder_layers(model)
        bad = [i for i in layer_ids if not 0 <= i <= len(layers)]
        if bad:
            raise ValueError(f"cannot tap layers {bad}: the target has {len(layers)}")
        self.layer_ids = tuple(layer_ids)
        self._latest: list[torch.Tensor | None] = [None] * len(layer_ids)
        self._handles = []
        for slot, i in enumerate(layer_ids):
            if i < len(layers):
                handle = layers[i].register_forward_pre_hook(self._pre(slot), with_kwargs=True)
            else:  # id L: the last layer's output, before the final norm
                handle = layers[-1].register_forward_hook(self._post(slot))
            self._handles.append(handle)

    def _pre(self, slot: int):
        def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            self._latest[slot] = hidden.detach()

        return pre_hook

    def _post(self, slot: int):
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            self._latest[slot] = hidden.detach()

        return hook

    def latest(self) -> torch.Tensor:
        """[batch, seq, 3 H] of the latest forward, layers in the order given."""
        if any(t is None for t in self._latest):
            raise RuntimeError("no target forward has run since the tap was set")
        return torch.cat(self._latest, dim=-1)  # type: ignore[arg-type]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def feature_tap(model: nn.Module, layer_ids: tuple[int, ...]) -> FeatureTap:
    """The shared tap of ``model`` for ``layer_ids`` (set on first use)."""
    taps: dict[tuple[int, ...], FeatureTap] = model.__dict__.setdefault("_specbound_taps", {})
    key = tuple(layer_ids)
    if key not in taps:
        taps[key] = FeatureTap(model, key)
    return taps[key]
