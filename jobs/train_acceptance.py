"""Learn how often the target accepts the draft's tokens, from what the draft has computed, and
save it (acceptance.json) where the `throughput` policy loads it.

The target decodes each prompt at each temperature; one teacher-forced pass of both models
over the text labels every position with what verification would do with the draft's token
(T = 0: the draft's argmax is the target's token; T > 0: sum min(p, q)). Two logistic models
per mode read the draft's confidence, entropy and top-2 margin, how far its top token
continues an n-gram already in the context, its last hidden state and the generation's recent
acceptance: one for the token about to be drafted, one for the token after it (so that
extending a chain is decided without the forward that would show it). At T = 0 the second
also reads what happened the last time the text was here (two weights on its logit: the draft
agreed, or missed, after the context's most recent earlier occurrence). Also records the mean
expert union of m consecutive positions, what a verification of m positions computes.

The benchmark's prompts are the first --limit of each domain; training skips the first
--skip (8) of each domain, so a bench with --limit <= 8 (its default) runs on prompts never
trained on (the bench warns where they overlap).

    python -m jobs.train_acceptance                                  # models/acceptance.json
    python -m jobs.train_acceptance --draft models/draft-2layer \\
        --out models/draft-2layer/acceptance.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jobs.cli import (
    add_max_new_tokens_arg,
    add_model_args,
    add_out_arg,
    add_seed_arg,
    add_temperatures_arg,
    add_threads_arg,
    parser,
    run,
    torch_threads,
)
from pipeline.acceptance.training import train_acceptance
from pipeline.data.domains import DOMAINS, load_domain
from pipeline.models.loading import REPO_ROOT, load_pair
from pipeline.tracking import tracked_run

DEFAULT_OUT = REPO_ROOT / "models" / "acceptance.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.train_acceptance", __doc__)
    add_model_args(p)
    add_out_arg(p, DEFAULT_OUT)
    p.add_argument(
        "--per-domain",
        type=int,
        default=32,
        help="prompts per domain (32; fewer where a domain has fewer)",
    )
    p.add_argument(
        "--skip",
        type=int,
        default=8,
        help="leading prompts of each domain left out: bench's --limit (8)",
    )
    add_temperatures_arg(p, "0,0.5,1", "0 trains the greedy part, > 0 the sampled")
    add_max_new_tokens_arg(p, 96, "each traced")
    p.add_argument(
        "--max-m",
        type=int,
        default=13,
        help="largest verification pass whose expert union is recorded (13)",
    )
    p.add_argument("--decay", type=float, default=0.8, help="recent acceptance's EMA decay (0.8)")
    add_threads_arg(p, None)
    add_seed_arg(p)
    p.add_argument(
        "--traces",
        type=Path,
        default=None,
        help="an .npz to save the traces to, or to refit from when it exists",
    )
    args = p.parse_args(argv)
    if min(args.temperatures) < 0:
        p.error("--temperatures needs at least one value, none negative")
    if args.per_domain < 1 or args.skip < 0 or args.max_new_tokens < 2 or args.max_m < 1:
        p.error("--per-domain, --max-new-tokens >= 2, --max-m >= 1 and --skip >= 0, please")
    if args.max_new_tokens < args.max_m:
        p.error(
            f"--max-new-tokens ({args.max_new_tokens}) must be >= --max-m ({args.max_m}): "
            "every pass size needs windows of the traced text"
        )
    if not 0 < args.decay < 1:
        p.error("--decay must lie in (0, 1)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    pair = load_pair(args.target, args.draft, args.device, args.dtype, args.experts_implementation)
    prompts = [
        p for name in DOMAINS for p in load_domain(name, args.skip + args.per_domain)[args.skip :]
    ]
    print(
        f"tracing {len(prompts)} prompts x T in {args.temperatures}, "
        f"{args.max_new_tokens} tokens each",
        flush=True,
    )
    with torch_threads(args.threads):
        model, report = train_acceptance(
            pair,
            prompts,
            args.temperatures,
            args.max_new_tokens,
            args.max_m,
            args.out,
            args.decay,
            args.seed,
            log=lambda line: print(line, flush=True),
            traces_path=args.traces,
        )
    for mode, scores in report.items():
        for kind in ("current", "next", "head"):
            s = scores.get(kind)
            if s:
                print(
                    f"{mode:8s} {kind:8s} held out: {s['n']} positions, "
                    f"mean {s['mean_label']:.3f}"
                    f", log loss {s['log_loss']:.3f} (constant {s['log_loss_constant']:.3f}, "
                    f"raw confidence {s.get('log_loss_confidence', float('nan')):.3f}), "
                    f"Brier {s['brier']:.3f}"
                )
        r = scores.get("repeat", {})
        if r.get("fitted"):
            print(
                f"{mode:8s} repeat   agreed there {r['weights'][0]:+.2f}, missed there "
                f"{r['weights'][1]:+.2f} on the `next` logit ({r['rows_agreed']} / "
                f"{r['rows_missed']} rows); `next` held-out log loss "
                f"{r.get('heldout_log_loss_without', float('nan')):.3f} -> "
                f"{r.get('heldout_log_loss_with', float('nan')):.3f}"
            )
    print("expert union per layer by m:", ", ".join(f"{u:.1f}" for u in model.union_by_m))
    print("saved", args.out)
    with tracked_run("train_acceptance", params={k: str(v) for k, v in vars(args).items()}) as t:
        for mode, scores in report.items():
            for kind in ("current", "next"):
                if scores.get(kind):
                    t.log_metrics({f"{mode}_{kind}_log_loss": scores[kind]["log_loss"]})
            repeat = scores.get("repeat", {})
            if "heldout_log_loss_with" in repeat:
                t.log_metrics({f"{mode}_next_repeat_log_loss": repeat["heldout_log_loss_with"]})
        t.log_artifact(str(args.out))
    return json.loads(json.dumps(report))


if __name__ == "__main__":
    run(main)
