"""Loading a target and draft: the happy path and every way a checkpoint can be wrong."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.models.adapters import (
    SUPPORTED_FAMILIES,
    NoMoELayersError,
    UnsupportedArchitectureError,
)
from pipeline.models.loading import CheckpointError, TokenizerMismatchError, load_pair, pick_device
from pipeline.tiny.corpus import Document
from pipeline.tiny.training import train_tokenizer
from tests.conftest import save_checkpoint
from tests.tinymodels import tiny_config, tiny_model


def _save(path, model, tok):
    return save_checkpoint(path, model, tok)


def test_load_pair_picks_device_dtype_and_experts_kernel(checkpoints):
    target, draft = checkpoints.target, checkpoints.draft
    pair = load_pair(target, draft, experts_implementation="eager")
    assert pair.device == pick_device()
    assert pair.dtype == (torch.bfloat16 if pair.device.type == "cuda" else torch.float32)
    assert pair.spec.family == "qwen3_moe" and pair.spec.moe_layers == (0, 2)
    assert pair.spec.num_experts == 8 and pair.spec.top_k == 2
    assert pair.target.config._experts_implementation == "eager"
    pair = load_pair(target, draft, experts_implementation="grouped_mm")
    assert pair.target.config._experts_implementation in ("grouped_mm", "eager")


def test_every_family_reports_its_moe_layout():
    expected = {
        "qwen3_moe": (0, 2),
        "qwen2_moe": (0, 1, 2),
        "mixtral": (0, 1, 2),
        "olmoe": (0, 1, 2),
        "gpt_oss": (0, 1, 2),
        "deepseek_v3": (1, 2),
    }
    assert set(expected) == set(SUPPORTED_FAMILIES)
    from pipeline.models.adapters import moe_spec

    for family, layers in expected.items():
        spec = moe_spec(tiny_config(family))
        assert (spec.moe_layers, spec.num_experts, spec.top_k) == (layers, 8, 2), family
    assert moe_spec(tiny_config("qwen2_moe")).shared_experts
    assert not moe_spec(tiny_config("mixtral")).shared_experts


def test_target_without_moe_layers(checkpoints, tokenizer):
    root, draft = checkpoints.root, checkpoints.draft
    dense_moe = tiny_model("qwen3_moe", vocab_size=len(tokenizer), mlp_only_layers=[0, 1, 2])
    path = _save(root / "all_dense", dense_moe, tokenizer)
    with pytest.raises(NoMoELayersError, match="no MoE layers"):
        load_pair(path, draft)


def test_unsupported_architecture_is_named_with_the_supported_list(checkpoints):
    draft = checkpoints.draft
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_pair(draft, draft)  # a dense qwen3 as the target
    message = str(err.value)
    assert "'qwen3'" in message
    for family in SUPPORTED_FAMILIES:
        assert family in message


def test_draft_with_another_vocabulary(checkpoints):
    root, target = checkpoints.root, checkpoints.target
    other_tok = train_tokenizer([Document("x", "SELECT * FROM t WHERE a = 1;\n" * 40)], 280)
    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=len(other_tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    path = _save(root / "other_draft", AutoModelForCausalLM.from_config(cfg), other_tok)
    with pytest.raises(TokenizerMismatchError, match="tokenizers differ"):
        load_pair(target, path)


def test_missing_and_corrupt_checkpoints(checkpoints, tmp_path):
    target, draft = checkpoints.target, checkpoints.draft
    with pytest.raises(CheckpointError, match="does not exist"):
        load_pair(tmp_path / "nowhere", draft)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_pair(tmp_path / "empty", draft)
    bad_cfg = tmp_path / "bad_cfg"
    bad_cfg.mkdir()
    (bad_cfg / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json is corrupt"):
        load_pair(target, bad_cfg)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((target / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no weights"):
        load_pair(no_weights, draft)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for f in target.iterdir():
        (corrupt / f.name).write_bytes(f.read_bytes())
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="cannot load the target weights"):
        load_pair(corrupt, draft)
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe"


def test_unknown_experts_implementation(checkpoints):
    target, draft = checkpoints.target, checkpoints.draft
    with pytest.raises(ValueError, match="experts implementation 'fast'"):
        load_pair(target, draft, experts_implementation="fast")
