"""EAGLE-3 head checkpoints in the two layouts users have, and the check against a verifier.

* **SpecForge** (what SGLang's trainer writes and vLLM serves as ``LlamaForCausalLMEagle3``): a
  Llama-style config.json with ``draft_vocab_size``; weights ``midlayer.*``, ``fc``, ``norm``,
  ``lm_head``, ``d2t``, ``t2d`` and usually ``embed_tokens``.
* **speculators** (vLLM's own format): ``speculators_model_type: eagle3`` with the layer's
  config under ``transformer_layer_config``, ``draft_vocab_size``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids`` and the verifier under
  ``speculators_config.verifier``; weights ``layers.0.*`` instead of ``midlayer.*``.

A head without ``embed_tokens`` shares the target's input embedding (as vLLM does); one without
``d2t`` drafts over the whole vocabulary (vLLM refuses a d2t then, so none is written). Without
``eagle_aux_hidden_state_layer_ids`` the tapped layers are vLLM's default for the target, the
residual streams entering layers 2, L // 2 and L - 3. vLLM checks neither the verifier nor the
feature width (a mismatch fails at the first draft); pipeline.models.eagle3_verifier does,
before loading.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pipeline.models.eagle3 import Eagle3Config, Eagle3Head
from pipeline.models.eagle3_verifier import bind_to_target

SPECFORGE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
FORMATS = ("specforge", "speculators")
WEIGHTS = "model.safetensors"


class HeadFormatError(ValueError):
    """A directory is not a readable EAGLE-3 head."""


def _read_json(path: Path) -> dict[str, Any]:
    file = path / "config.json"
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise HeadFormatError(f"{path} has no config.json") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HeadFormatError(f"cannot read {file}: {exc}") from exc
    if not isinstance(data, dict):
        raise HeadFormatError(f"{file} is not a JSON object")
    return data


def head_format(path: str | Path) -> str | None:
    """'specforge', 'speculators' or None (not an EAGLE-3 head) for a checkpoint directory."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return None
    try:
        data = _read_json(path)
    except HeadFormatError:
        return None
    if data.get("speculators_model_type") == "eagle3":
        return "speculators"
    if any(a in SPECFORGE_ARCHITECTURES for a in data.get("architectures") or []):
        return "specforge"
    return None


def _need(data: dict[str, Any], key: str, where: str) -> Any:
    if key not in data:
        raise HeadFormatError(f"{where} has no {key!r}")
    return data[key]


def _rope_theta(layer: dict[str, Any]) -> float:
    params = layer.get("rope_parameters") or {}
    return float(params.get("rope_theta", layer.get("rope_theta", 10000.0)))


def read_config(path: str | Path) -> tuple[Eagle3Config, str]:
    """The head's config and its format. The aux layer ids may be empty (the target's default
    applies: bind_to_target)."""
    path = Path(path)
    fmt = head_format(path)
    if fmt is None:
        raise HeadFormatError(
            f"{path} is not an EAGLE-3 head: its config.json has neither "
            f"speculators_model_type 'eagle3' nor an architecture in {SPECFORGE_ARCHITECTURES}"
        )
    data = _read_json(path)
    where = f"{path}/config.json"
    if fmt == "speculators":
        layer = _need(data, "transformer_layer_config", where)
        verifier = (data.get("speculators_config") or {}).get("verifier") or {}
        name = verifier.get("name_or_path") or ""
        archs = tuple(verifier.get("architectures") or ())
    else:
        layer = data
        name, archs = data.get("verifier_name_or_path", ""), ()
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise HeadFormatError(f"{where}: only one-layer EAGLE-3 heads are supported")
    hidden = int(_need(layer, "hidden_size", where))
    heads = int(_need(layer, "num_attention_heads", where))
    vocab = int(_need(layer, "vocab_size", where))
    cfg = Eagle3Config(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=int(layer.get("num_key_value_heads", heads)),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        intermediate_size=int(_need(layer, "intermediate_size", where)),
        vocab_size=vocab,
        draft_vocab_size=int(data.get("draft_vocab_size") or layer.get("draft_vocab_size") or vocab),
        target_hidden_size=int(data.get("target_hidden_size") or hidden),
        aux_layer_ids=_aux_ids(data),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(layer),
        max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
        # speculators' own default is True (vLLM reads it so); SpecForge heads have none.
        norm_before_residual=bool(data.get("norm_before_residual", fmt == "speculators")),
        verifier_name=str(name),
        verifier_architectures=archs,
    )
    return cfg, fmt


def _aux_ids(data: dict[str, Any]) -> tuple[int, ...]:
    """The tapped layers as vLLM reads them: top level, else under eagle_config; ascending
    (vLLM concatenates the features in ascending layer order, whatever order is written)."""
    ids = data.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return tuple(sorted({int(i) for i in ids or ()}))


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    file = path / WEIGHTS
    if file.is_file():
        try:
            return load_file(str(file))
        except Exception as exc:  # a truncated or foreign file raises many types
            raise HeadFormatError(f"cannot read {file}: {type(exc).__name__}: {exc}") from exc
    bins = path / "pytorch_model.bin"
    if bins.is_file():
        return torch.load(bins, map_location="cpu", weights_only=True)
    raise HeadFormatError(f"{path} has no {WEIGHTS} (or pytorch_model.bin)")


def load_head(
    path: str | Path,
    target,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Eagle3Head:
    """The head in ``path`` (either format) bound to ``target`` (a loaded HF causal LM, whose
    input embedding a head without its own shares), in eval mode."""
    path = Path(path)
    cfg, fmt = read_config(path)
    cfg = bind_to_target(cfg, target.config)
    state = {}
    for name, tensor in _load_weights(path).items():
        if fmt == "speculators" and name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0.") :]
        state[name.removeprefix("model.")] = tensor
    if "embed_tokens.weight" not in state:
        state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().cpu()
    state.setdefault("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
    state.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
    head = Eagle3Head(cfg)
    expected = head.state_dict()
    missing = sorted(expected.keys() - state.keys())
    unknown = sorted(state.keys() - expected.keys())
    if missing or unknown:
        raise HeadFormatError(
            f"{path}: weights do not match a {fmt} EAGLE-3 head"
            + (f"; missing {missing[:6]}" if missing else "")
            + (f"; unexpected {unknown[:6]}" if unknown else "")
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise HeadFormatError(
                f"{path}: {name} has shape {list(tensor.shape)}, the config implies "
                f"{list(expected[name].shape)}"
            )
    head.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})
    return head.to(device=device, dtype=dtype).eval()


def _layer_config(cfg: Eagle3Config) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }


def config_json(cfg: Eagle3Config, fmt: str, speculative_tokens: int = 4) -> dict[str, Any]:
    """The config.json of ``cfg`` in ``fmt``."""
    common = {
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
    }
    if fmt == "specforge":
        return {
            "architectures": [SPECFORGE_ARCHITECTURES[0]],
            **_layer_config(cfg),
            **common,
            "torch_dtype": "float32",
            "verifier_name_or_path": cfg.verifier_name,
        }
    if fmt == "speculators":
        return {
            "architectures": [SPECULATORS_ARCHITECTURE],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.1.0",
            "transformer_layer_config": _layer_config(cfg),
            **common,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": speculative_tokens,
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "verifier": {
                    "name_or_path": cfg.verifier_name,
                    "architectures": list(cfg.verifier_architectures),
                },
            },
        }
    raise ValueError(f"unknown head format {fmt!r} (one of {', '.join(FORMATS)})")


def save_head(
    head: Eagle3Head, out: str | Path, fmt: str = "specforge", include_embed: bool = True
) -> Path:
    """Write ``head`` to ``out`` in ``fmt`` (config.json + model.safetensors)."""
    out = Path(out)
    config = config_json(head.cfg, fmt)  # an unknown format fails before anything is written
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    full_vocab = head.cfg.draft_vocab_size == head.cfg.vocab_size and not head.d2t.any()
    for name, tensor in head.state_dict().items():
        if name == "embed_tokens.weight" and not include_embed:
            continue
        if name == "d2t" and full_vocab:
            continue  # vLLM has no d2t buffer for a full draft vocabulary and refuses one
        if fmt == "speculators" and name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer.") :]
        state[name] = tensor.detach().cpu().contiguous()
    save_file(state, str(out / WEIGHTS))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
