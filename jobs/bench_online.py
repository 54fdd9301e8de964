"""Online speculative decoding benchmark: tokens/s and speedup over plain decoding (our `ar`)
for every policy and for transformers' assisted generation, on the same prompts and models in
one run, greedy (T=0) and sampling (T=1); mean accepted length, mean unique experts per
verification pass, and the share of wall time spent in target verification.

    python -m jobs.bench_online --limit 8 --max-new-tokens 64
"""

from __future__ import annotations

import argparse

from jobs.cli import add_model_args, parser, run
from pipeline.models import load_pair
from pipeline.online_bench import DEFAULT_POLICIES, bench_assisted, bench_policy
from pipeline.prompts import load_prompts
from pipeline.tracking import tracked_run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.bench_online", __doc__)
    add_model_args(p, experts=False)
    p.add_argument("--source", default="humaneval")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperatures", default="0,1", help="comma-separated (0,1)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list:
    args = parse_args(argv)
    pair = load_pair(args.target, args.draft, args.device, args.dtype)
    tok = pair.tokenizer
    prompts = [tok(p.text, add_special_tokens=False)["input_ids"][-512:]
               for p in load_prompts(args.source, args.limit)]  # fmt: skip
    temps = [float(t) for t in args.temperatures.split(",")]
    rows = []
    for temp in temps:
        bench_policy(pair, prompts[:1], "fixed", {"k": 2}, temp, 8)  # warm-up
        for name, knobs in DEFAULT_POLICIES:
            rows.append(bench_policy(pair, prompts, name, knobs, temp, args.max_new_tokens))
        rows.append(bench_assisted(pair, prompts, temp, args.max_new_tokens))
    ar = {r.temperature: r.tokens_per_s for r in rows if r.label == "ar"}
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens on {pair.device}\n")
    print(f"{'policy':<38}{'T':>4}{'tok/s':>9}{'speedup':>9}{'accepted':>10}{'U/verify':>10}"
          f"{'T_verify':>10}")  # fmt: skip
    for r in rows:
        print(f"{r.label:<38}{r.temperature:>4g}{r.tokens_per_s:>9.1f}"
              f"{r.tokens_per_s / ar[r.temperature]:>8.2f}x{r.mean_accepted:>10.2f}"
              f"{r.mean_unique_experts:>10.2f}{r.verify_share:>9.0%}")  # fmt: skip
    with tracked_run("bench_online", params=vars(args)) as run:
        for r in rows:
            key = f"{r.label}_T{r.temperature:g}".replace("(", "_").replace(")", "")
            key = key.replace(",", "_").replace("=", "").replace(" ", "_")
            run.log_metrics({f"{key}_tok_s": r.tokens_per_s,
                             f"{key}_speedup": r.tokens_per_s / ar[r.temperature]})  # fmt: skip
    return rows


if __name__ == "__main__":
    run(main)
