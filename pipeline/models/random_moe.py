"""Real-shape MoE targets with random weights, built from a config alone (no download).

Designed calibration (pipeline.cost.designed) sets the routing, so a pass costs what the same
pass costs with trained weights: the kernels, shapes and bytes moved are the model's, only the
values differ. That is how a 30B-class MoE is timed on a GPU without fetching its checkpoint:
take its config (a layout below, or a config.json), build the model straight on the device
with random weights, force the routing. On a CPU the same layout is scaled down by overrides
(fewer layers, experts, a narrower hidden size...).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PretrainedConfig

from pipeline.models.adapters import adapter_for, moe_spec
from pipeline.models.loading import EXPERTS_IMPLEMENTATIONS

# Config fields of public MoE checkpoints, as transformers 5 names them (rope_theta lives in
# rope_parameters there). Qwen3-30B-A3B: 48 layers x 128 experts, top-8, ~30.5e9 parameters.
LAYOUTS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 40960,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
    },
}

# The job's scale-down flags, for error messages that say how to make a model fit.
SCALE_DOWN_FLAGS = "--layers, --experts, --hidden, --moe-intermediate, --intermediate, --vocab"

# Fraction of the free memory the weights may take: the rest is for the KV caches of the
# calibration contexts, activations and the allocator's slack.
WEIGHT_FRACTION = 0.9


class ModelTooLargeError(ValueError):
    """The requested model's weights do not fit in the device's free memory."""


def _read_config_file(path: Path) -> dict[str, Any]:
    file = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the config {file}: {exc}") from exc
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"config {file} has no model_type")
    return data


def layout_config(layout: str | Path, **overrides: Any) -> PretrainedConfig:
    """The config of a named layout (LAYOUTS) or of a local config.json (or a directory
    holding one), with ``overrides`` (config field names: num_hidden_layers, num_experts,
    hidden_size...) applied, e.g. to scale a layout down for a CPU. An unknown field, a
    top_k above the experts or a config without MoE layers is a ValueError."""
    if str(layout) in LAYOUTS:
        base = copy.deepcopy(LAYOUTS[str(layout)])
    elif Path(layout).expanduser().exists():
        base = _read_config_file(Path(layout).expanduser())
    else:
        raise ValueError(f"unknown layout {str(layout)!r}: not one of {', '.join(LAYOUTS)} "
                         "and not an existing config.json")
    model_type = base.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"config model_type {model_type!r} is unknown to transformers")
    cls = CONFIG_MAPPING[model_type]
    config = cls(**base)
    known = set(config.to_dict()) | set(getattr(cls, "attribute_map", {}))
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown {model_type} config field(s) to override: "
                         f"{', '.join(unknown)}")
    if overrides:
        fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type",
                  "transformers_version", "architectures", "_name_or_path")}
        # An alias (Qwen3-MoE's num_experts -> num_local_experts) replaces its target field.
        attribute_map = getattr(cls, "attribute_map", {})
        for key, value in overrides.items():
            fields.pop(attribute_map.get(key, key), None)
            fields[key] = value
        layer_types = fields.get("layer_types")
        if isinstance(layer_types, list) and layer_types:  # cycle the pattern to the new depth
            n = int(fields["num_hidden_layers"])
            fields["layer_types"] = [layer_types[i % len(layer_types)] for i in range(n)]
        config = cls(**fields)
    adapter = adapter_for(config)  # an unsupported family fails here, by name
    top_k = int(getattr(config, adapter.top_k_key, 0) or 0)
    experts = int(getattr(config, adapter.num_experts_key, 0) or 0)
    if top_k > experts:
        raise ValueError(
            f"top_k {top_k} ({adapter.top_k_key}) exceeds the {experts} experts "
            f"({adapter.num_experts_key}): lower --top-k or raise --experts"
        )
    moe_spec(config)  # NoMoELayersError when no layer is sparse
    return config


def parameter_count(config: PretrainedConfig) -> int:
    """Parameters of the model ``config`` describes, counted on the meta device (nothing is
    allocated, so a 30B layout is counted on any machine in about a second)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    return sum(p.numel() for p in model.parameters())


def available_memory(device: torch.device) -> tuple[int, str]:
    """Free bytes on ``device`` and where the number comes from."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), "torch.cuda.mem_get_info"
    try:
        import psutil

        return int(psutil.virtual_memory().available), "psutil available"
    except ImportError:  # page cache counts as free to the kernel; sysconf is a lower bound
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "sysconf free pages"


def check_fits(config: PretrainedConfig, device: torch.device, dtype: torch.dtype) -> int:
    """Raise ModelTooLargeError, with the numbers and the flags that scale a layout down,
    when the weights would take more than WEIGHT_FRACTION of the device's free memory.
    Returns the parameter count."""
    params = parameter_count(config)
    need = params * torch.empty((), dtype=dtype).element_size()
    free, source = available_memory(device)
    if need > WEIGHT_FRACTION * free:
        raise ModelTooLargeError(
            f"a {config.model_type} with {params / 1e9:.2f}e9 parameters needs "
            f"{need / 2**30:.1f} GiB of weights in {str(dtype).removeprefix('torch.')}, but "
            f"{device} has {free / 2**30:.1f} GiB free ({source}; weights may take "
            f"{WEIGHT_FRACTION:.0%} of it): scale the layout down ({SCALE_DOWN_FLAGS}), use a "
            "smaller dtype or a device with more memory"
        )
    return params


def build_random_moe(
    config: PretrainedConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    experts_implementation: str = "eager",
    seed: int = 0,
) -> nn.Module:
    """The causal LM of ``config`` with random weights, built directly on ``device`` (on a
    GPU the weights are never in host memory), in eval mode, with the requested experts
    kernel. Refuses (ModelTooLargeError) before allocating when it cannot fit."""
    if experts_implementation not in EXPERTS_IMPLEMENTATIONS:
        raise ValueError(f"experts implementation {experts_implementation!r} is not one of "
                         f"{', '.join(EXPERTS_IMPLEMENTATIONS)}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    moe_spec(config)
    check_fits(config, device, dtype)
    torch.manual_seed(seed)  # seeds the CUDA generators too: the same weights on every run
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            copy.deepcopy(config), dtype=dtype, experts_implementation=experts_implementation
        )
    return model.eval()
