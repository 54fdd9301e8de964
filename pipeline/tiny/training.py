"""Build, train and evaluate the embedded default models (a Qwen3-MoE target and a dense draft).

Everything is trained on CPU from the offline standard-library corpus (pipeline.tiny.corpus), so the
project runs out of the box without downloading weights. The draft is distilled from the target
(KL to the target's next-token distribution plus the data loss) because what speculation needs
from a draft is agreement with the target, not a good language model on its own.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    DynamicCache,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from pipeline.models.kvcache import crop_to
from pipeline.tiny.corpus import Document

EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class TinySizes:
    vocab_size: int = 4096
    hidden_size: int = 128
    target_layers: int = 6
    num_experts: int = 32
    top_k: int = 4
    moe_intermediate_size: int = 48
    draft_layers: int = 1
    draft_intermediate_size: int = 384
    max_positions: int = 2048


# Plain-text role markers (the tiny models know no special tokens): what the endpoint's chat
# route renders messages with (serving.chat); committed in models/*/tokenizer_config.json.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '### ' + (message['role'] | capitalize) }}"
    "{% if message['name'] %}{{ ' (' + message['name'] + ')' }}{% endif %}"
    "{{ '\\n' + message['content'] + '\\n\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Assistant\\n' }}{% endif %}"
)


def train_tokenizer(docs: list[Document], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE, so any text (any script, any byte) round-trips without unknown tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((d.text for d in docs), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        model_max_length=TinySizes.max_positions,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def target_config(sizes: TinySizes, eos_id: int) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=sizes.vocab_size,
        hidden_size=sizes.hidden_size,
        intermediate_size=4 * sizes.hidden_size,
        moe_intermediate_size=sizes.moe_intermediate_size,
        num_hidden_layers=sizes.target_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=sizes.hidden_size // 4,
        num_experts=sizes.num_experts,
        num_experts_per_tok=sizes.top_k,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        # The load-balancing loss keeps many experts in use, as in real MoE checkpoints.
        output_router_logits=True,
        router_aux_loss_coef=0.02,
        max_position_embeddings=sizes.max_positions,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def draft_config(sizes: TinySizes, eos_id: int) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=sizes.vocab_size,
        hidden_size=sizes.hidden_size,
        intermediate_size=sizes.draft_intermediate_size,
        num_hidden_layers=sizes.draft_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=sizes.hidden_size // 4,
        max_position_embeddings=sizes.max_positions,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def encode_stream(tokenizer: PreTrainedTokenizerFast, docs: list[Document]) -> torch.Tensor:
    """All documents as one token stream, separated by EOS."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for enc in tokenizer([d.text for d in docs], add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def batches(
    stream: torch.Tensor, batch_size: int, seq_len: int, seed: int
) -> Iterator[torch.Tensor]:
    """Random windows of the stream, forever; seeded so a retrain gives the same models."""
    gen = torch.Generator().manual_seed(seed)
    high = len(stream) - seq_len - 1
    while True:
        starts = torch.randint(0, high, (batch_size,), generator=gen)
        yield torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


def _cosine_lr(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_loop(
    model: PreTrainedModel,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    data: Iterator[torch.Tensor],
    steps: int,
    lr: float,
    tokens_per_step: int,
    label: str,
    log_every: int = 25,
) -> list[float]:
    """AdamW with warmup and cosine decay; prints loss, tokens/s and ETA as it goes."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _cosine_lr(step, steps, lr, warmup=max(1, steps // 20))
        loss = loss_fn(next(data))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % log_every == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - start
            rate = (step + 1) * tokens_per_step / elapsed
            eta = elapsed / (step + 1) * (steps - step - 1)
            recent = sum(losses[-log_every:]) / len(losses[-log_every:])
            print(
                f"[{label}] step {step + 1}/{steps} loss {recent:.3f} "
                f"{rate:,.0f} tok/s ETA {eta:.0f}s",
                flush=True,
            )
    model.eval()
    return losses


def target_loss(model: Qwen3MoeForCausalLM) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(batch: torch.Tensor) -> torch.Tensor:
        # The model adds the router load-balancing loss when output_router_logits is on.
        return model(batch, labels=batch).loss

    return fn


def distill_loss(
    draft: PreTrainedModel, target: PreTrainedModel, kl_weight: float = 0.7
) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            teacher = target(batch, output_router_logits=False).logits[:, :-1].float()
        logits = draft(batch).logits[:, :-1].float()
        vocab = logits.shape[-1]
        ce = F.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
        kl = F.kl_div(
            F.log_softmax(logits, -1).reshape(-1, vocab),
            F.log_softmax(teacher, -1).reshape(-1, vocab),
            log_target=True,
            reduction="batchmean",
        )
        return kl_weight * kl + (1 - kl_weight) * ce

    return fn


@torch.no_grad()
def heldout_metrics(
    target: PreTrainedModel, draft: PreTrainedModel, stream: torch.Tensor, seq_len: int = 256
) -> tuple[float, float, float, int]:
    """Target and draft next-token loss, and the draft's top-1 agreement with the target's
    greedy token, over non-overlapping windows of the held-out stream."""
    n_windows = (len(stream) - 1) // seq_len
    windows = stream[: n_windows * seq_len].view(n_windows, seq_len)
    t_loss = d_loss = agree = 0.0
    count = 0
    for chunk in windows.split(8):
        t_logits = target(chunk, output_router_logits=False).logits[:, :-1].float()
        d_logits = draft(chunk).logits[:, :-1].float()
        labels = chunk[:, 1:]
        vocab = t_logits.shape[-1]
        t_loss += F.cross_entropy(t_logits.reshape(-1, vocab), labels.reshape(-1), reduction="sum")
        d_loss += F.cross_entropy(d_logits.reshape(-1, vocab), labels.reshape(-1), reduction="sum")
        agree += (t_logits.argmax(-1) == d_logits.argmax(-1)).sum().item()
        count += labels.numel()
    return float(t_loss) / count, float(d_loss) / count, agree / count, count


@torch.no_grad()
def paired_decode_step_ms(
    models: list[PreTrainedModel], prompt: torch.Tensor, repeats: int = 60
) -> list[float]:
    """Median wall time of one cached single-token forward of each model after a prefill of
    ``prompt``. The models' steps are interleaved so machine noise hits all of them alike."""
    caches = []
    for model in models:
        model.eval()
        cache = DynamicCache(config=model.config)
        model(prompt, past_key_values=cache, use_cache=True)
        caches.append(cache)
    token = prompt[:, -1:]
    times: list[list[float]] = [[] for _ in models]
    for _ in range(repeats):
        for model, cache, bucket in zip(models, caches, times, strict=True):
            t0 = time.perf_counter()
            model(token, past_key_values=cache, use_cache=True)
            bucket.append(time.perf_counter() - t0)
            crop_to(cache, prompt.shape[1])
    return [sorted(b)[len(b) // 2] * 1e3 for b in times]


def directory_size_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def publish_model_dir(
    out: Path, write: Callable[[Path], None], report: dict, max_bytes: int, what: str
) -> None:
    """``write`` a model into a scratch directory beside ``out`` with its train_report.json;
    ``out`` is replaced only once that is complete and within ``max_bytes``."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    (tmp / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    size = directory_size_bytes(tmp)
    if size > max_bytes:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(
            f"the {what} takes {size / 2**20:.1f} MiB, over the {max_bytes / 2**20:.0f} MiB budget"
        )
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
