"""The EAGLE-3 draft head: one decoder layer that reads the target's own hidden states.

At position i the head sees the target's hidden states entering three of its layers (low,
middle, high: ``aux_layer_ids``), concatenated and projected by ``fc`` [H, 3H_target], beside
the embedding of token i + 1, and predicts token i + 2. Its next draft step reads its own
output (the pre-norm hidden state) in place of the target's features, so a chain of k drafted
tokens costs k forwards of one layer. The layer's attention takes [embedding, hidden] (2H) in;
the norms, MLP and rotary embedding are transformers' Llama parts. This is the layout SpecForge
trains and vLLM serves (``LlamaForCausalLMEagle3``); pipeline.models.eagle3_formats reads and
writes its checkpoints. The logits cover a draft vocabulary of ``draft_vocab_size`` ids that
``d2t`` maps into the target's (target id = draft id + d2t[draft id]); ids outside it get -inf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)


@dataclass(frozen=True)
class Eagle3Config:
    """A head's shape and the verifier it was trained for."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    # The target layers whose input residual streams are read, ascending (L: the last layer's
    # output before the final norm).
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False  # the residual is the normed hidden state (some heads)
    verifier_name: str = ""  # the target the head was trained on, as its format names it
    verifier_architectures: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{self.num_attention_heads} attention heads do not split into "
                f"{self.num_key_value_heads} key/value groups"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft vocabulary of {self.draft_vocab_size} ids is not within the target's "
                f"{self.vocab_size}"
            )
        if len(self.aux_layer_ids) not in (0, 3):  # none: the target's default (bound later)
            raise ValueError(
                f"an EAGLE-3 head reads 3 target layers, this one names {list(self.aux_layer_ids)}"
            )

    def layer_config(self) -> LlamaConfig:
        """The Llama config of the head's decoder layer (its norms, MLP and rotary)."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=1,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            hidden_act="silu",
            tie_word_embeddings=False,
        )


class HeadCache:
    """The head's keys and values, [1, kv_heads, positions, head_dim]; cropped like a draft's."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=-2)
            self.values = torch.cat([self.values, v], dim=-2)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        if length > len(self):
            raise ValueError(f"cannot crop a head cache of {len(self)} positions to {length}")
        if self.keys is not None:
            self.keys = self.keys[..., :length, :]
            self.values = self.values[..., :length, :]


class Eagle3Attention(nn.Module):
    """Grouped-query attention whose projections read [embedding, hidden] (2H)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        width = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(width, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(width, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(width, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries [B, heads, T, d] and keys, values [B, kv_heads, T, d]."""
        b, t, _ = x.shape
        d = self.cfg.head_dim
        q = self.q_proj(x).view(b, t, -1, d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        """Softmax attention of q over (k, v) with an additive or boolean mask; [B, T, H]."""
        groups = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        layer = cfg.layer_config()
        self.cfg = cfg
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(layer)

    def attention_input(
        self, embeds: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([normed embedding, normed hidden] 2H, the residual)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.cfg.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The pre-norm output after the attention: what the next draft step reads."""
        hidden = residual + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(nn.Module):
    """The head's modules, named as SpecForge names them (``midlayer``, ``fc``, ``norm``...)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        self.config = cfg.layer_config()  # what callers read of any draft (vocab, width)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(cfg.layer_config())
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's concatenated features (3 H_target) to the head's width; the head's own
        hidden states (H) pass through."""
        if hidden.shape[-1] == 3 * self.cfg.target_hidden_size:
            return self.fc(hidden.to(self.dtype))
        if hidden.shape[-1] != self.cfg.hidden_size:
            raise ValueError(
                f"hidden states of width {hidden.shape[-1]}: the head takes "
                f"{3 * self.cfg.target_hidden_size} (target features) or {self.cfg.hidden_size}"
            )
        return hidden

    def forward(
        self,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: HeadCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits over the target vocabulary [B, T, V], pre-norm output [B, T, H]) of ``ids``
        [B, T] at ``positions`` beside ``hidden`` [B, T, 3H_target or H]. New keys go into
        ``cache``; without ``mask`` a new token sees every cached position and the new ones
        before it (a chain), with one it is the additive [B, 1, T, cached + T] mask (a tree)."""
        embeds = self.embed_tokens(ids)
        x, residual = self.midlayer.attention_input(embeds, self.project(hidden))
        cos, sin = self.rotary_emb(x, positions)
        q, k, v = self.midlayer.self_attn.qkv(x, cos, sin)
        past = 0 if cache is None else len(cache)
        if cache is not None:
            k, v = cache.append(k, v)
        if mask is None:
            t = ids.shape[1]
            mask = torch.ones(t, past + t, dtype=torch.bool, device=ids.device).tril(past)
        out = self.midlayer.finish(self.midlayer.self_attn.attend(q, k, v, mask), residual)
        return self.logits(out), out

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary."""
        return self.lm_head(self.norm(out))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the target vocabulary (ids the draft vocabulary lacks get -inf)."""
        small = self.draft_logits(out)
        if self.cfg.draft_vocab_size == self.cfg.vocab_size and not self.d2t.any():
            return small
        full = small.new_full((*small.shape[:-1], self.cfg.vocab_size), float("-inf"))
        target_ids = torch.arange(self.cfg.draft_vocab_size, device=small.device) + self.d2t
        full[..., target_ids] = small
        return full
