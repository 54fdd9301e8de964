"""Calibrate what vLLM's engine step costs, the cost-aware scheduler's prior
(pipeline.vllm_spec.priors): vLLM decodes the prompts at each --batch-sizes with the
calibration drafter (pipeline.vllm_spec.calibration_drafter) drafting a random length 0..K
per row and step, a hook on vLLM's MoE gates records the
experts every pass routes to, and the steps are fitted to

    T_T(P, U, A, B) = b0 + b_pos P + b_union U + b_ctx A + b_row B
                                        (vLLM's step outside the drafter, B rows)
    T_D(n) = d0 + d_tok n               (one packed draft forward, n tokens)
    S(B) = s0 + s_row B                 (the drafter's own work, B rows)

saved as vllm_costmodel.json with its provenance (device, dtype, checkpoints, vLLM version,
the engine's OpenMP threads):
the scheduler takes it as a prior only on the device it was measured on. Runs vLLM in its own
environment (make vllm-env).

    python -m jobs.calibrate_vllm                                   # models/vllm_costmodel.json
    python -m jobs.calibrate_vllm --draft models/draft-2layer \
        --out models/draft-2layer/vllm_costmodel.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jobs.cli import (
    add_batch_sizes_arg,
    add_draft_arg,
    add_limit_arg,
    add_max_tokens_arg,
    add_out_arg,
    add_prompt_tokens_arg,
    add_source_arg,
    add_target_arg,
    parser,
    run,
)
from pipeline.data.domains import load_prompts
from pipeline.data.prompts import encode
from pipeline.tracking import tracked_run
from pipeline.vllm_spec.calibration import calibrate_vllm


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.calibrate_vllm", __doc__)
    add_target_arg(p, Path("models/target"))
    add_draft_arg(p, Path("models/draft"))
    add_source_arg(p)
    add_limit_arg(p, 16)
    add_batch_sizes_arg(p, "1,2,4,8,16")
    p.add_argument("--k", type=int, default=8, help="longest draft the design draws (8)")
    add_max_tokens_arg(p, 64)
    add_prompt_tokens_arg(p)
    add_out_arg(p, Path("models/vllm_costmodel.json"), "the vLLM step cost model")
    args = p.parse_args(argv)
    if args.limit < 1 or args.max_tokens < 8 or not 1 <= args.k <= 16:
        p.error("--limit must be >= 1, --max-tokens >= 8 and --k in 1..16")
    if min(args.batch_sizes) < 1:
        p.error("--batch-sizes must be >= 1")
    for path in (args.target, args.draft):
        if not (path / "config.json").is_file():
            p.error(f"no checkpoint at {path}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    prompts = [
        encode(tokenizer, p.text, keep_last=args.prompt_tokens)
        for p in load_prompts(args.source, args.limit)
    ]
    print(
        f"vLLM step calibration: {len(prompts)} prompts x {args.max_tokens} tokens at batch "
        f"sizes {args.batch_sizes}, k ~ U{{0..{args.k}}} per row and step",
        flush=True,
    )
    result = calibrate_vllm(
        args.target, args.draft, prompts, args.batch_sizes, args.k, args.max_tokens, args.out
    )
    c, fit = result.cost, result.fit
    metrics = {
        **{k: v for k, v in c.to_json().items() if isinstance(v, int | float)},
        **{k: v for k, v in fit.items() if isinstance(v, int | float)},
        "seconds": result.seconds,
    }
    with tracked_run("calibrate_vllm", params={k: str(v) for k, v in vars(args).items()}) as t:
        t.log_metrics(metrics)
        t.log_artifact(str(args.out))
    print(
        f"T_T(P, U, A, B) = {c.b0:.3f} + {c.b_pos:.4f} P + {c.b_union:.4f} U + {c.b_ctx:.7f} A "
        f"{c.b_row:+.4f} B ms"
        f"  (R^2 {c.r2_target:.3f}, {fit['fitted_steps']} steps, bias {fit['bias_ms']:+.3f} "
        f"ms, MAPE {fit['mape']:.1%})"
    )
    print(
        f"T_D(n)          = {c.d0:.3f} + {c.d_tok:.4f} n ms per draft forward of n tokens "
        f"(R^2 {c.r2_draft:.3f}, {fit['draft_forwards']} forwards)"
    )
    print(f"S(B)            = {c.s0:.3f} + {c.s_row:.4f} B ms of the drafter's own work per step")
    print(f"U(P)            = {c.experts} - {c.experts - c.top_k} x {c.union_decay:.4f}^(P-1)")
    print(f"-> {args.out} ({result.seconds:.0f} s)")
    return {"cost": c.to_json(), "fit": fit}


if __name__ == "__main__":
    run(main)
