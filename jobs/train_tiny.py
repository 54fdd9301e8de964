"""Train the embedded default models under models/ from the offline standard-library corpus.

    python -m jobs.train_tiny --out models          # full run (~20 min on 2 CPU cores)
    python -m jobs.train_tiny --out /tmp/m --target-steps 5 --draft-steps 5   # smoke test

Prints, and logs to MLflow: the target's held-out loss, the draft's top-1 agreement with the
target's greedy next token on held-out text, and the time of one draft decode step over one
target decode step, measured interleaved in one run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

from pipeline.corpus import split_documents, stdlib_documents
from pipeline.tiny_models import (
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
from pipeline.tracking import tracked_run

MAX_MODELS_BYTES = 24 * 1024 * 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("models"), help="output directory")
    p.add_argument("--target-steps", type=int, default=700, help="target optimizer steps")
    p.add_argument("--draft-steps", type=int, default=500, help="draft distillation steps")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--heldout-tokens", type=int, default=60_000, help="held-out tokens to evaluate on"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    sizes = TinySizes()

    docs = stdlib_documents()
    train_docs, heldout_docs = split_documents(docs)
    print(f"corpus: {len(train_docs)} train / {len(heldout_docs)} held-out documents", flush=True)
    t0 = time.perf_counter()
    tokenizer = train_tokenizer(train_docs, sizes.vocab_size)
    train_stream = encode_stream(tokenizer, train_docs)
    heldout_stream = encode_stream(tokenizer, heldout_docs)[: args.heldout_tokens + 1]
    print(
        f"tokenizer: vocab {len(tokenizer)}; {len(train_stream):,} train tokens, "
        f"{len(heldout_stream):,} held-out tokens ({time.perf_counter() - t0:.0f}s)",
        flush=True,
    )

    eos = tokenizer.eos_token_id
    target = Qwen3MoeForCausalLM._from_config(
        target_config(sizes, eos), experts_implementation="eager"
    )
    draft = Qwen3ForCausalLM(draft_config(sizes, eos))
    tokens_per_step = args.batch_size * args.seq_len
    train_loop(
        target,
        target_loss(target),
        batches(train_stream, args.batch_size, args.seq_len, args.seed),
        args.target_steps,
        args.lr,
        tokens_per_step,
        "target",
    )
    train_loop(
        draft,
        distill_loss(draft, target),
        batches(train_stream, args.batch_size, args.seq_len, args.seed + 1),
        args.draft_steps,
        args.lr,
        tokens_per_step,
        "draft",
    )

    t_loss, d_loss, agreement, n_heldout = heldout_metrics(target, draft, heldout_stream)
    prompt = heldout_stream[:64].unsqueeze(0)
    target_ms, draft_ms = paired_decode_step_ms([target, draft], prompt)

    out: Path = args.out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    for name, model in (("target", target), ("draft", draft)):
        model.config.output_router_logits = False  # inference default: no aux loss
        model.save_pretrained(tmp / name)
        tokenizer.save_pretrained(tmp / name)
    report = {
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
    (tmp / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    size = directory_size_bytes(tmp)
    if size > MAX_MODELS_BYTES:
        raise SystemExit(f"models take {size / 2**20:.1f} MiB, over the 24 MiB budget")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    report["models_mib"] = round(size / 2**20, 2)

    with tracked_run("train_tiny", params={**vars(args), "sizes": vars(sizes)}) as run:
        run.log_metrics({k: float(v) for k, v in report.items()})
        run.log_artifact(str(out / "train_report.json"))

    print("\nembedded models written to", out)
    print(f"  target held-out loss            {t_loss:.3f} nats/token ({n_heldout:,} tokens)")
    print(f"  draft held-out loss             {d_loss:.3f} nats/token")
    print(f"  draft top-1 agreement w/ target {agreement:.1%}")
    print(
        f"  draft step / target step        {draft_ms / target_ms:.3f} "
        f"({draft_ms:.2f} ms / {target_ms:.2f} ms, CPU, one run)"
    )
    print(f"  size on disk                    {size / 2**20:.1f} MiB")
    return report


if __name__ == "__main__":
    main()
