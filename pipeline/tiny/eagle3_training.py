"""Train the embedded target's EAGLE-3 head on CPU in minutes (training-time test).

The target runs once over random windows of the training corpus; its tapped features
(pipeline.models.features) and next-token log-probabilities are kept. The head then learns
to match the target's distribution ``steps`` tokens ahead: step 0 reads the target's
features, step j reads the head's own outputs of step j - 1, exactly as a drafted chain does,
and attends to the step-0 keys of the context plus its own keys of steps 1..j at that
position (the keys a chain of j drafted tokens has in its cache). Step j's loss is weighted
``decay ** j``. A ``sharegpt_fraction`` of the windows comes from ShareGPT conversations
(as published heads are trained on chat data), the rest from the stdlib corpus the target
learnt: code alone leaves the head weak on prose prompts. The draft vocabulary is the target's
whole one (4096 ids): at this size the LM head is cheap, and a reduced vocabulary would cap
acceptance at its coverage.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerFast, Qwen3MoeForCausalLM

from pipeline.models.eagle3 import Eagle3Config, Eagle3Head
from pipeline.models.eagle3_formats import save_head
from pipeline.models.features import FeatureTap
from pipeline.tiny.corpus import sharegpt_documents, split_documents, stdlib_documents
from pipeline.tiny.training import (
    _cosine_lr,
    batches,
    encode_stream,
    publish_model_dir,
)

MAX_HEAD_BYTES = 8 * 1024 * 1024
# The inputs of the target's layers 1, 3 and 5 of 6: low, middle and high features.
AUX_LAYER_IDS = (1, 3, 5)
HELDOUT_WINDOWS = 64  # per source


@dataclass(frozen=True)
class HeadTraining:
    steps: int = 2000
    batch_size: int = 16
    seq_len: int = 128  # a window's positions (each trains every test-time step)
    windows: int = 4096  # target windows computed once (the head trains over them)
    sharegpt_fraction: float = 0.5  # of the windows, from ShareGPT conversations
    ttt_steps: int = 5
    decay: float = 0.8
    lr: float = 3e-3
    intermediate_size: int = 384
    seed: int = 0


@torch.no_grad()
def target_features(
    target: Qwen3MoeForCausalLM, tap: FeatureTap, windows: torch.Tensor, chunk: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [N, T, 3H] float32, log-probs [N, T, V] float16) of ``windows`` [N, T]."""
    feats, logps = [], []
    for part in windows.split(chunk):
        logits = target(part, output_router_logits=False).logits.float()
        feats.append(tap.latest().float())
        logps.append(F.log_softmax(logits, -1).half())
    return torch.cat(feats), torch.cat(logps)


def ttt_loss(
    head: Eagle3Head,
    ids: torch.Tensor,
    feats: torch.Tensor,
    logp: torch.Tensor,
    steps: int,
    decay: float,
) -> tuple[torch.Tensor, list[float]]:
    """The weighted training-time-test loss of a batch and each step's top-1 agreement with the
    target. ``ids`` [B, T], ``feats`` [B, T, 3H], ``logp`` [B, T, V] (the target's distribution
    of the token after each position)."""
    layer = head.midlayer
    attn = layer.self_attn
    b, t = ids.shape
    n = t - 1  # positions with a next token to read
    d = head.cfg.head_dim
    groups = head.cfg.num_attention_heads // head.cfg.num_key_value_heads
    positions = torch.arange(n).expand(b, n)
    hidden = head.project(feats[:, :n])
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    total = torch.zeros(())
    agreement = []
    for j in range(steps):
        valid = n - j  # query t reads token t + 1 + j and predicts the target's at t + 1 + j
        tokens = torch.cat([ids[:, 1 + j :], ids.new_zeros(b, j)], dim=1)[:, :n]
        x, residual = layer.attention_input(head.embed_tokens(tokens), hidden)
        cos, sin = head.rotary_emb(x, positions + j)
        q, k, v = attn.qkv(x, cos, sin)
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        if j == 0:
            k0, v0 = k, v
            scores = (q @ k0.transpose(-1, -2)) / math.sqrt(d)
            scores = scores.masked_fill(~causal, float("-inf"))
            weights = scores.softmax(-1)
            out = weights @ v0
        else:
            keys.append(k)
            values.append(v)
            s0 = ((q @ k0.transpose(-1, -2)) / math.sqrt(d)).masked_fill(~causal, float("-inf"))
            diag = torch.stack([(q * ki).sum(-1) for ki in keys], -1) / math.sqrt(d)
            weights = torch.cat([s0, diag], -1).softmax(-1)
            out = weights[..., :n] @ v0
            for i, vi in enumerate(values):
                out = out + weights[..., n + i : n + i + 1] * vi
        out = attn.o_proj(out.transpose(1, 2).reshape(b, n, -1))
        hidden = layer.finish(out, residual)
        logits = head.draft_logits(hidden)[:, :valid]
        teacher = logp[:, 1 + j : 1 + j + valid].float()
        loss = -(teacher.exp() * F.log_softmax(logits, -1)).sum(-1).mean()
        total = total + decay**j * loss
        agreement.append((logits.argmax(-1) == teacher.argmax(-1)).float().mean().item())
    return total, agreement


@torch.no_grad()
def heldout_agreement(
    head: Eagle3Head,
    windows: torch.Tensor,
    feats: torch.Tensor,
    logp: torch.Tensor,
    config: HeadTraining,
    chunk: int = 16,
) -> list[float]:
    """Top-1 agreement with the target at each test-time step, over held-out windows."""
    agree = [0.0] * config.ttt_steps
    for part in range(0, len(windows), chunk):
        sl = slice(part, part + chunk)
        _, a = ttt_loss(head, windows[sl], feats[sl], logp[sl], config.ttt_steps, config.decay)
        share = len(windows[sl]) / len(windows)
        agree = [x + y * share for x, y in zip(agree, a, strict=True)]
    return [round(a, 4) for a in agree]


def train_head(
    target_dir: Path,
    out: Path,
    config: HeadTraining = HeadTraining(),
    log: Callable[[str], None] = print,
) -> dict:
    """Train a head for the target in ``target_dir`` and write it (SpecForge layout, with a
    train_report.json) to ``out``, replaced only once complete. Returns the report."""
    target_dir, out = Path(target_dir), Path(out)
    if not (target_dir / "config.json").exists():
        raise FileNotFoundError(f"no target checkpoint at {target_dir} (config.json missing)")
    torch.manual_seed(config.seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(target_dir)
    target = Qwen3MoeForCausalLM.from_pretrained(target_dir, experts_implementation="eager")
    target.eval()
    tc = target.config
    cfg = Eagle3Config(
        hidden_size=tc.hidden_size,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=tc.vocab_size,
        draft_vocab_size=tc.vocab_size,
        target_hidden_size=tc.hidden_size,
        aux_layer_ids=AUX_LAYER_IDS,
        rms_norm_eps=tc.rms_norm_eps,
        rope_theta=float(tc.rope_parameters["rope_theta"]),
        max_position_embeddings=tc.max_position_embeddings,
        verifier_name=str(target_dir),
        verifier_architectures=tuple(tc.architectures or ()),
    )
    head = Eagle3Head(cfg)
    with torch.no_grad():  # start from the target's embedding and output layer
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight)
    t0 = time.perf_counter()
    n_chat = round(config.windows * config.sharegpt_fraction)
    sources = {"stdlib": (stdlib_documents(), config.windows - n_chat)}
    if n_chat:
        sources["sharegpt"] = (sharegpt_documents(), n_chat)
    tap = FeatureTap(target, AUX_LAYER_IDS)
    train_parts, heldout = [], {}
    try:
        for name, (docs, count) in sources.items():
            train_docs, heldout_docs = split_documents(docs)
            stream = encode_stream(tokenizer, train_docs)
            if count:
                log(f"target features of {count} {name} windows x {config.seq_len} tokens")
                part = next(batches(stream, count, config.seq_len, config.seed + 7))
                train_parts.append((part, *target_features(target, tap, part)))
            held_stream = encode_stream(tokenizer, heldout_docs)
            held = held_stream[: HELDOUT_WINDOWS * config.seq_len].view(-1, config.seq_len)
            heldout[name] = (held, *target_features(target, tap, held))
    finally:
        tap.remove()
    windows, feats, logp = (torch.cat(x) for x in zip(*train_parts, strict=True))
    del train_parts
    log(
        f"training the head ({sum(p.numel() for p in head.parameters()):,} parameters), "
        f"{config.steps} steps x {config.ttt_steps} test-time steps"
    )
    opt = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=0.01, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(config.seed)
    head.train()
    start = time.perf_counter()
    recent: list[float] = []
    for step in range(config.steps):
        for group in opt.param_groups:
            group["lr"] = _cosine_lr(step, config.steps, config.lr, max(1, config.steps // 20))
        pick = torch.randint(0, len(windows), (config.batch_size,), generator=gen)
        loss, _ = ttt_loss(
            head, windows[pick], feats[pick], logp[pick], config.ttt_steps, config.decay
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent.append(loss.item())
        if (step + 1) % 50 == 0 or step + 1 == config.steps:
            elapsed = time.perf_counter() - start
            eta = elapsed / (step + 1) * (config.steps - step - 1)
            log(
                f"[head] step {step + 1}/{config.steps} loss {sum(recent) / len(recent):.3f} "
                f"ETA {eta:.0f}s"
            )
            recent = []
    head.eval()
    agree = {name: heldout_agreement(head, *data, config) for name, data in heldout.items()}
    report = {
        "format": "specforge",
        "aux_layer_ids": list(AUX_LAYER_IDS),
        "draft_vocab": "full (the target's 4096 ids)",
        "steps": config.steps,
        "ttt_steps": config.ttt_steps,
        "batch_size": config.batch_size,
        "seq_len": config.seq_len,
        "windows": config.windows,
        "sharegpt_windows": n_chat,
        "heldout_top1_agreement_by_step": agree["stdlib"],
        **({"heldout_sharegpt_top1_agreement_by_step": agree["sharegpt"]} if n_chat else {}),
        "head_params": sum(p.numel() for p in head.parameters()),
        "train_seconds": round(time.perf_counter() - t0, 1),
    }
    publish_model_dir(
        out, lambda d: save_head(head, d, "specforge"), report, MAX_HEAD_BYTES, "head"
    )
    return report
