"""Online speculative decoding benchmark: tokens/s and speedup over plain decoding (our `ar`)
for every policy, the cost-aware ones (ecospec, ecospec-global, marginal) and transformers'
assisted generation, on the same prompts and models in one run, greedy (T=0) and sampling
(T=1); mean accepted length, mean unique experts per verification pass, the share of wall time
spent in target verification, and the fraction of the oracle's bound each policy captures.

The bound: the text `ar` generated at that temperature goes through the extraction and the
Bellman oracle with the same cost model the marginal policy uses (exact-greedy acceptance at
T=0, the paper's surrogate from draft probabilities otherwise); "of bound" is a policy's
measured speedup over that S. At T=0 the `oracle-replay` row decodes with the oracle's own
k*(i), and its modelled cost is compared with the measured time.

    python -m jobs.bench_online --limit 8 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from jobs.cli import add_model_args, parser, run
from pipeline.models import load_pair
from pipeline.online_bench import (
    COST_AWARE_POLICIES,
    DEFAULT_POLICIES,
    BenchRow,
    bench_assisted,
    bench_policy,
)
from pipeline.online_bound import ReplayPolicy, replay, sequence_bounds
from pipeline.policy_artifacts import (
    DEFAULT_COSTMODEL,
    DEFAULT_POLICY,
    DEFAULT_PREDICTOR,
    load_artifacts,
)
from pipeline.prompts import load_prompts
from pipeline.tracking import tracked_run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.bench_online", __doc__)
    add_model_args(p, experts=False)
    p.add_argument("--source", default="humaneval")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperatures", default="0,1", help="comma-separated (0,1)")
    p.add_argument("--predictor", type=Path, default=DEFAULT_PREDICTOR, help="expert predictor")
    p.add_argument("--costmodel", type=Path, default=DEFAULT_COSTMODEL, help="costmodel.json")
    p.add_argument("--policy", type=Path, default=DEFAULT_POLICY, help="the oracle's policy.json")
    p.add_argument("--lmax", type=int, default=12, help="Lmax of the bound (12)")
    p.add_argument("--quick", action="store_true", help="only ar, fixed(k=2) and marginal")
    args = p.parse_args(argv)
    if args.limit < 1 or args.max_new_tokens < 1 or args.lmax < 1:
        p.error("--limit, --max-new-tokens and --lmax must be >= 1")
    return args


def _key(label: str, temperature: float) -> str:
    """An MLflow metric name (alphanumerics, _ - . only) for a row label."""
    key = re.sub(r"[^0-9A-Za-z.\-]+", "_", f"{label}_T{temperature:g}")
    return key.strip("_")


def main(argv: list[str] | None = None) -> list:
    args = parse_args(argv)
    pair = load_pair(args.target, args.draft, args.device, args.dtype)
    artifacts = load_artifacts(args.predictor, args.costmodel, args.policy, str(pair.device))
    artifacts.check_target(pair.spec.num_moe_layers, pair.spec.num_experts)
    tok = pair.tokenizer
    prompts = [tok(p.text, add_special_tokens=False)["input_ids"][-512:]
               for p in load_prompts(args.source, args.limit)]  # fmt: skip
    temps = [float(t) for t in args.temperatures.split(",")]
    policies = DEFAULT_POLICIES + COST_AWARE_POLICIES
    if args.quick:
        policies = [("ar", {}), ("fixed", {"k": 2}), ("marginal", {})]
    rows: list[BenchRow] = []
    bounds: dict[float, float] = {}
    replay_errors: list[str] = []
    for temp in temps:
        bench_policy(pair, prompts[:1], "fixed", {"k": 2}, temp, 8)  # warm-up
        for name, knobs in policies:
            print(f"[bench_online] T={temp:g} {name} {knobs or ''}", flush=True)
            rows.append(bench_policy(pair, prompts, name, knobs, temp, args.max_new_tokens,
                                     artifacts))  # fmt: skip
        if not args.quick:
            rows.append(bench_assisted(pair, prompts, temp, args.max_new_tokens))
        ar_row = next(r for r in rows if r.label == "ar" and r.temperature == temp)
        acceptance = "greedy" if temp == 0 else "surrogate"
        bound = sequence_bounds(pair, prompts, ar_row.outputs, artifacts.cost, args.lmax,
                                acceptance)  # fmt: skip
        bounds[temp] = bound.speedup
        if temp == 0:
            # The oracle's own decisions, decoded online: S realised, and the cost model's error.
            by_prompt = {int(b.seq.seq_id.split("-")[1]): b for b in bound.sequences}

            def replay_policy(j: int, by_prompt=by_prompt) -> ReplayPolicy:
                return ReplayPolicy(by_prompt[j].solution.k_star, len(prompts[j]))

            rows.append(bench_policy(pair, prompts, replay_policy, {}, temp, args.max_new_tokens,
                                     label="oracle-replay (k*)"))  # fmt: skip
            for j, b in sorted(by_prompt.items())[:2]:
                rep = replay(pair, b, prompts[j], artifacts.cost)
                same = sum(x == y for x, y in zip(rep.accepted, rep.oracle_accepted, strict=True))
                replay_errors.append(
                    f"prompt {j}: {len(rep.states)} steps, accepted = oracle's a in {same}; "
                    f"measured {sum(rep.measured_ms):.1f} ms vs modelled "
                    f"{sum(rep.modelled_ms):.1f} ms ({rep.relative_error:+.1%}; "
                    f"{rep.relative_error_online_u:+.1%} against the same model priced with the "
                    "experts the passes really used)"
                )
    ar = {r.temperature: r.tokens_per_s for r in rows if r.label == "ar"}
    print(f"\n{len(prompts)} prompts x {args.max_new_tokens} tokens on {pair.device}; "
          f"lambda {artifacts.lam:.3f} ms/token\n")  # fmt: skip
    header = (f"{'policy':<42}{'T':>4}{'tok/s':>9}{'speedup':>9}{'of bound':>10}{'accepted':>10}"
              f"{'U/verify':>10}{'T_verify':>10}")  # fmt: skip
    print(header)
    for r in rows:
        speedup = r.tokens_per_s / ar[r.temperature]
        print(f"{r.label:<42}{r.temperature:>4g}{r.tokens_per_s:>9.1f}{speedup:>8.2f}x"
              f"{speedup / bounds[r.temperature]:>10.0%}{r.mean_accepted:>10.2f}"
              f"{r.mean_unique_experts:>10.2f}{r.verify_share:>9.0%}")  # fmt: skip
    for temp, s in bounds.items():
        kind = "exact-greedy" if temp == 0 else "surrogate"
        print(f"oracle bound S at T={temp:g} ({kind} acceptance, Lmax {args.lmax}, the cost "
              f"model's prices): {s:.3f}x")  # fmt: skip
    for line in replay_errors:
        print(f"oracle replay, {line}")
    per_m = artifacts.cost.meta.get("fit", {}).get("per_m", {})
    if per_m:
        n = sum(f["n"] for f in per_m.values())
        mape = sum(f["n"] * f["oos_mape_pct"] for f in per_m.values()) / n
        print(f"cost model error: out-of-sample MAPE {mape:.1f}% over the calibration's rounds")
    with tracked_run("bench_online", params=vars(args)) as mlrun:
        for r in rows:
            speedup = r.tokens_per_s / ar[r.temperature]
            key = _key(r.label, r.temperature)
            mlrun.log_metrics({f"{key}_tok_s": r.tokens_per_s, f"{key}_speedup": speedup,
                               f"{key}_of_bound": speedup / bounds[r.temperature]})  # fmt: skip
        mlrun.log_metrics({f"bound_T{t:g}": s for t, s in bounds.items()})
    return rows


if __name__ == "__main__":
    run(main)
