"""A second draft for the committed target: a distilled dense draft of another depth, so that
policies are tuned and judged on more than one target/draft pair (a deeper draft agrees more
with the target and costs more per token: another cost regime)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM, Qwen3MoeForCausalLM

from pipeline.tiny.corpus import split_documents, stdlib_documents
from pipeline.tiny.training import (
    TinySizes,
    batches,
    distill_loss,
    draft_config,
    encode_stream,
    heldout_metrics,
    paired_decode_step_ms,
    publish_model_dir,
    train_loop,
)

# A second draft is one small model: it must not grow the repository much.
MAX_DRAFT_BYTES = 8 * 1024 * 1024


def distill_second_draft(
    target_dir: Path,
    out: Path,
    layers: int = 2,
    steps: int = 500,
    batch_size: int = 16,
    seq_len: int = 256,
    lr: float = 3e-3,
    seed: int = 0,
    heldout_tokens: int = 60_000,
    log: Callable[[str], None] = print,
) -> dict[str, float | int]:
    """Distil a dense draft of ``layers`` layers from the target in ``target_dir`` (its own
    tokenizer, the same corpus and split as the embedded build) and write it with the
    tokenizer and a train_report.json to ``out`` (replaced only once complete). Returns the
    report: held-out losses, top-1 agreement with the target and the step-time ratio."""
    target_dir, out = Path(target_dir), Path(out)
    if not (target_dir / "config.json").exists():
        raise FileNotFoundError(f"no target checkpoint at {target_dir} (config.json missing)")
    if layers < 1:
        raise ValueError(f"a draft needs at least one layer, got {layers}")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(target_dir)
    target = Qwen3MoeForCausalLM.from_pretrained(target_dir, experts_implementation="eager")
    target.eval()
    train_docs, heldout_docs = split_documents(stdlib_documents())
    train_stream = encode_stream(tokenizer, train_docs)
    heldout_stream = encode_stream(tokenizer, heldout_docs)[: heldout_tokens + 1]
    sizes = replace(
        TinySizes(),
        vocab_size=target.config.vocab_size,
        hidden_size=target.config.hidden_size,
        draft_layers=layers,
    )
    draft = Qwen3ForCausalLM(draft_config(sizes, tokenizer.eos_token_id))
    log(
        f"distilling a {layers}-layer draft ({sum(p.numel() for p in draft.parameters()):,} "
        f"parameters) from {target_dir}, {steps} steps"
    )
    t0 = time.perf_counter()
    # The embedded build's draft windows (seed + 1): the same text, the same order.
    data = batches(train_stream, batch_size, seq_len, seed + 1)
    train_loop(
        draft, distill_loss(draft, target), data, steps, lr, batch_size * seq_len, f"draft{layers}"
    )
    t_loss, d_loss, agreement, n = heldout_metrics(target, draft, heldout_stream)
    target_ms, draft_ms = paired_decode_step_ms([target, draft], heldout_stream[:64][None])
    report: dict[str, float | int] = {
        "draft_layers": layers,
        "draft_steps": steps,
        "target_heldout_loss": round(t_loss, 4),
        "draft_heldout_loss": round(d_loss, 4),
        "draft_target_top1_agreement": round(agreement, 4),
        "draft_over_target_step_time": round(draft_ms / target_ms, 4),
        "target_step_ms": round(target_ms, 3),
        "draft_step_ms": round(draft_ms, 3),
        "heldout_tokens": n,
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "train_seconds": round(time.perf_counter() - t0, 1),
    }

    def write(directory: Path) -> None:
        draft.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    publish_model_dir(out, write, report, MAX_DRAFT_BYTES, "draft")
    return report
