"""One adapter per MoE architecture family: where the family keeps its MoE layers and experts.

No model code is copied: every supported family in transformers 5 runs its routed experts as a
``mlp.experts`` module called as ``experts(hidden_states, top_k_index, top_k_weights)`` with the
indices its router actually selected (after any bias or group selection). The adapter only has to
know which config keys name the expert counts and which decoder layers are sparse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig


class UnsupportedArchitectureError(ValueError):
    pass


class NoMoELayersError(ValueError):
    pass


@dataclass(frozen=True)
class MoESpec:
    """What routing capture and the cost model need to know about a target."""

    family: str
    moe_layers: tuple[int, ...]  # decoder-layer indices whose MLP is a routed MoE block
    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts each token selects per MoE layer
    shared_experts: bool  # an always-on shared expert runs beside the routed ones

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)


def _sparse_step_layers(cfg: PretrainedConfig) -> list[int]:
    """Qwen2/Qwen3-MoE: sparse every ``decoder_sparse_step`` layers but mlp_only_layers."""
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    return [
        i
        for i in range(cfg.num_hidden_layers)
        if i not in dense and cfg.num_experts > 0 and (i + 1) % step == 0
    ]


def _all_layers(cfg: PretrainedConfig) -> list[int]:
    return list(range(cfg.num_hidden_layers))


def _after_first_k_dense(cfg: PretrainedConfig) -> list[int]:
    return list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))


@dataclass(frozen=True)
class FamilyAdapter:
    family: str
    num_experts_key: str
    sparse_layers: Callable[[PretrainedConfig], list[int]]
    shared_experts: bool = False
    top_k_key: str = "num_experts_per_tok"

    def spec(self, cfg: PretrainedConfig) -> MoESpec:
        num_experts = int(getattr(cfg, self.num_experts_key, 0) or 0)
        layers = tuple(self.sparse_layers(cfg)) if num_experts > 0 else ()
        if not layers:
            raise NoMoELayersError(
                f"the {self.family} target has no MoE layers ({self.num_experts_key}="
                f"{num_experts}, {cfg.num_hidden_layers} decoder layers): speculation cost "
                "analysis needs a Mixture-of-Experts target"
            )
        return MoESpec(
            family=self.family,
            moe_layers=layers,
            num_experts=num_experts,
            top_k=int(getattr(cfg, self.top_k_key)),
            shared_experts=self.shared_experts,
        )


ADAPTERS: dict[str, FamilyAdapter] = {
    "qwen3_moe": FamilyAdapter("qwen3_moe", "num_experts", _sparse_step_layers),
    "qwen2_moe": FamilyAdapter(
        "qwen2_moe", "num_experts", _sparse_step_layers, shared_experts=True
    ),
    "mixtral": FamilyAdapter("mixtral", "num_local_experts", _all_layers),
    "olmoe": FamilyAdapter("olmoe", "num_experts", _all_layers),
    "gpt_oss": FamilyAdapter("gpt_oss", "num_local_experts", _all_layers),
    "deepseek_v3": FamilyAdapter(
        "deepseek_v3", "n_routed_experts", _after_first_k_dense, shared_experts=True
    ),
}

SUPPORTED_FAMILIES = tuple(ADAPTERS)


def adapter_for(cfg: PretrainedConfig) -> FamilyAdapter:
    model_type = getattr(cfg, "model_type", None)
    if model_type not in ADAPTERS:
        raise UnsupportedArchitectureError(
            f"unsupported target architecture {model_type!r}; supported MoE families: "
            f"{', '.join(SUPPORTED_FAMILIES)}"
        )
    return ADAPTERS[model_type]


def moe_spec(cfg: PretrainedConfig) -> MoESpec:
    return adapter_for(cfg).spec(cfg)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM (``model.model.layers`` in every supported family)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} has no decoder layers at .model.layers"
        )
    return layers


def experts_modules(model: nn.Module, spec: MoESpec) -> list[nn.Module]:
    """The routed-experts module of each MoE layer, in ``spec.moe_layers`` order."""
    layers = decoder_layers(model)
    modules = []
    for idx in spec.moe_layers:
        experts = getattr(getattr(layers[idx], "mlp", None), "experts", None)
        if experts is None:
            raise UnsupportedArchitectureError(
                f"layer {idx} of the {spec.family} model should be a MoE layer but has no "
                "mlp.experts module; this transformers version lays the family out differently"
            )
        modules.append(experts)
    return modules
