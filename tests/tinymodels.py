"""Tiny random-weight models of every supported MoE family, built from transformers configs."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

VOCAB = 256

# Enough layers that some are dense where the family allows it, so layer indexing is exercised.
FAMILY_OVERRIDES: dict[str, dict] = {
    "qwen3_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        norm_topk_prob=True,
    ),
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2),
    "gpt_oss": dict(
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "deepseek_v3": dict(
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        moe_intermediate_size=32,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}
FAMILIES = tuple(FAMILY_OVERRIDES)


def tiny_config(family: str, vocab_size: int = VOCAB, **extra):
    base = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    base.update(FAMILY_OVERRIDES[family])
    base.update(extra)
    return AutoConfig.for_model(family, **base)


def tiny_model(
    family: str,
    seed: int = 0,
    experts_implementation: str = "eager",
    dtype: torch.dtype = torch.float32,
    **extra,
) -> PreTrainedModel:
    torch.manual_seed(seed)
    config = tiny_config(family, **extra)
    model = AutoModelForCausalLM.from_config(
        config, experts_implementation=experts_implementation, dtype=dtype
    )
    if family == "deepseek_v3":
        # A non-zero selection bias makes the router's choice differ from top-k of its scores.
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(torch.randn_like(gate.e_score_correction_bias))
    if family == "gpt_oss":
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.mlp.router.bias, std=1.0)
    return model.eval()


def tiny_head(
    target: PreTrainedModel,
    seed: int = 0,
    draft_vocab: int | None = None,
    aux_layer_ids: tuple[int, ...] = (0, 1, 2),
):
    """A random-weight EAGLE-3 head for ``target`` (its width, vocabulary and first three
    layers); with ``draft_vocab`` a reduced draft vocabulary mapped through a random d2t."""
    from pipeline.models.eagle3 import Eagle3Config, Eagle3Head

    tc = target.config
    vocab = tc.vocab_size
    cfg = Eagle3Config(
        hidden_size=tc.hidden_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab or vocab,
        target_hidden_size=tc.hidden_size,
        aux_layer_ids=aux_layer_ids,
        max_position_embeddings=512,
        verifier_architectures=tuple(tc.architectures or ()),
    )
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5 * 4)
        if draft_vocab:
            kept = torch.randperm(vocab)[:draft_vocab].sort().values
            head.d2t.copy_(kept - torch.arange(draft_vocab))
            head.t2d.zero_()
            head.t2d[kept] = True
    return head.eval()


def cpu_pair(target: PreTrainedModel, draft, name: str = "tiny"):
    """A float32 CPU ModelPair of ``target`` and ``draft`` (a causal LM or an EAGLE-3 head),
    without a tokenizer."""
    from pipeline.models.adapters import moe_spec
    from pipeline.models.loading import ModelPair

    return ModelPair(
        target=target,
        draft=draft,
        tokenizer=None,
        spec=moe_spec(target.config),
        device=torch.device("cpu"),
        dtype=torch.float32,
        experts_implementation="eager",
        target_path=name,
        draft_path=name,
    )
