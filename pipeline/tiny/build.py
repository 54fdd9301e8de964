"""Building the embedded default models end to end: corpus -> tokenizer -> MoE target ->
distilled draft -> held-out metrics -> a models directory within the size budget."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)

from pipeline.tiny.corpus import split_documents, stdlib_documents
from pipeline.tiny.training import (
    TinySizes,
    batches,
    directory_size_bytes,
    distill_loss,
    draft_config,
    encode_stream,
    heldout_metrics,
    paired_decode_step_ms,
    target_config,
    target_loss,
    train_loop,
    train_tokenizer,
)

# The models ship inside the repository, so they must stay small.
MAX_MODELS_BYTES = 24 * 1024 * 1024


@dataclass
class EmbeddedModels:
    """What was built: the report (train_report.json plus models_mib, rounded) and the exact
    measurements behind it."""

    out: Path
    report: dict[str, float | int]
    target_loss: float
    draft_loss: float
    agreement: float
    heldout_tokens: int
    target_ms: float
    draft_ms: float
    size_bytes: int


def build_embedded_models(
    out: Path,
    sizes: TinySizes,
    target_steps: int = 700,
    draft_steps: int = 500,
    batch_size: int = 16,
    seq_len: int = 256,
    lr: float = 3e-3,
    seed: int = 0,
    heldout_tokens: int = 60_000,
    log: Callable[[str], None] = print,
) -> EmbeddedModels:
    """Train the target and distil the draft on the standard-library corpus, measure them on
    held-out text and write both (with the tokenizer and train_report.json) to ``out``, which
    is replaced only once the new models are complete and within MAX_MODELS_BYTES. Model
    initialisation draws from torch's global RNG: seed it first for a reproducible build."""
    train_docs, heldout_docs = split_documents(stdlib_documents())
    log(f"corpus: {len(train_docs)} train / {len(heldout_docs)} held-out documents")
    t0 = time.perf_counter()
    tokenizer = train_tokenizer(train_docs, sizes.vocab_size)
    train_stream = encode_stream(tokenizer, train_docs)
    heldout_stream = encode_stream(tokenizer, heldout_docs)[: heldout_tokens + 1]
    log(
        f"tokenizer: vocab {len(tokenizer)}; {len(train_stream):,} train tokens, "
        f"{len(heldout_stream):,} held-out tokens ({time.perf_counter() - t0:.0f}s)"
    )

    eos = tokenizer.eos_token_id
    target = Qwen3MoeForCausalLM._from_config(
        target_config(sizes, eos), experts_implementation="eager"
    )
    draft = Qwen3ForCausalLM(draft_config(sizes, eos))
    tokens_per_step = batch_size * seq_len
    target_batches = batches(train_stream, batch_size, seq_len, seed)
    train_loop(
        target, target_loss(target), target_batches, target_steps, lr, tokens_per_step, "target"
    )
    # Other windows than the target saw, from the same text.
    draft_batches = batches(train_stream, batch_size, seq_len, seed + 1)
    train_loop(
        draft, distill_loss(draft, target), draft_batches, draft_steps, lr, tokens_per_step, "draft"
    )

    t_loss, d_loss, agreement, n_heldout = heldout_metrics(target, draft, heldout_stream)
    prompt = heldout_stream[:64].unsqueeze(0)
    target_ms, draft_ms = paired_decode_step_ms([target, draft], prompt)
    report: dict[str, float | int] = {
        "target_heldout_loss": round(t_loss, 4),
        "draft_heldout_loss": round(d_loss, 4),
        "draft_target_top1_agreement": round(agreement, 4),
        "draft_over_target_step_time": round(draft_ms / target_ms, 4),
        "target_step_ms": round(target_ms, 3),
        "draft_step_ms": round(draft_ms, 3),
        "heldout_tokens": n_heldout,
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
    }
    size = write_models(out, {"target": target, "draft": draft}, tokenizer, report)
    report["models_mib"] = round(size / 2**20, 2)
    return EmbeddedModels(
        out, report, t_loss, d_loss, agreement, n_heldout, target_ms, draft_ms, size
    )


def write_models(
    out: Path,
    models: dict[str, PreTrainedModel],
    tokenizer: PreTrainedTokenizerFast,
    report: dict[str, float | int],
) -> int:
    """Save each model with the tokenizer under out/<name> and the report beside them; returns
    the bytes written. Everything goes to a .partial directory first, so a failed or
    oversized build never replaces the models already in ``out``."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    for name, model in models.items():
        model.config.output_router_logits = False  # inference default: no aux loss
        model.save_pretrained(tmp / name)
        tokenizer.save_pretrained(tmp / name)
    (tmp / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    size = directory_size_bytes(tmp)
    if size > MAX_MODELS_BYTES:
        raise ValueError(f"models take {size / 2**20:.1f} MiB, over the 24 MiB budget")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return size
