"""The experts vLLM's target routes each step's tokens to, seen from inside its model: a
forward pre-hook on every MoE block reads the block's input and recomputes the router's
choice with the checkpoint's gate weights (vLLM's CPU kernels repack its own copy; the top-k
of the gate's logits: for softmax routers without a bias, such as
Qwen3-MoE's and Mixtral's, exactly the experts the fused kernel runs). Calibration only: it
adds a small matmul and a top-k per layer to every step."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


class RouterUnion:
    def __init__(self, blocks: list[nn.Module], gates: list[torch.Tensor], top_k: int) -> None:
        self.top_k = top_k
        self._gates = {id(b): g for b, g in zip(blocks, gates, strict=True)}
        self._unions: list[int] = []
        self._positions = 0
        self._layers = len(blocks)
        self._handles = [b.register_forward_pre_hook(self._hook) for b in blocks]

    @classmethod
    def attach(cls, model: nn.Module, checkpoint: str | Path) -> RouterUnion | None:
        """Hooks on ``model``'s MoE blocks (modules with a ``gate`` and ``experts``, in layer
        order), their gates read from ``checkpoint``'s ``*.mlp.gate.weight``; None when the
        model has no MoE blocks or the checkpoint no gates for them."""
        blocks = [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate")]
        gates = _gate_weights(Path(checkpoint))
        if not blocks or len(gates) != len(blocks):
            return None
        config = json.loads((Path(checkpoint) / "config.json").read_text())
        top_k = int(config.get("num_experts_per_tok") or 0)
        return cls(blocks, gates, top_k) if top_k > 0 else None

    @torch.no_grad()
    def _hook(self, module: nn.Module, args: tuple) -> None:
        hidden = args[0]
        hidden = hidden.view(-1, hidden.shape[-1])
        weight = self._gates[id(module)]
        chosen = (hidden.to(weight.dtype) @ weight.t()).topk(self.top_k, dim=-1).indices
        self._unions.append(int(chosen.unique().numel()))
        self._positions = int(hidden.shape[0])

    def take(self) -> tuple[int, float]:
        """(positions, mean union of experts per MoE layer) of the last forward, then reset
        (a step may run more than one forward: the last one, the verification pass, counts)."""
        unions = self._unions[-self._layers :]
        out = (self._positions, sum(unions) / len(unions) if unions else 0.0)
        self._unions, self._positions = [], 0
        return out


def _gate_weights(checkpoint: Path) -> list[torch.Tensor]:
    """Every ``model.layers.<i>.mlp.gate.weight`` of the checkpoint, by layer."""
    found: dict[int, torch.Tensor] = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                m = re.fullmatch(r".*layers\.(\d+)\.mlp\.gate\.weight", key)
                if m:
                    found[int(m.group(1))] = f.get_tensor(key).float()
    return [found[i] for i in sorted(found)]
