"""Modelled T = 0 speedup of policies over the best fixed K (1-6, or FIXED), the first 8 prompts
of each domain x 64 tokens (bench_online's), priced with the pair's committed cost model:
deterministic, so a change of decisions is measured without timing noise. Run from the
repository root:

    python docs/results/repeat_outcomes_2026-12-04/modelled_t0.py ACCEPTANCE POLICY...
    DRAFT=models/draft-2layer python docs/results/repeat_outcomes_2026-12-04/modelled_t0.py ...
    DRAFT=models/eagle3-head FIXED=3,4,5,6,8 python docs/results/.../modelled_t0.py - throughput

ACCEPTANCE: an acceptance.json to use instead of the pair's own ('-': its own); the models
before this change: git show 4bfc0b5:models/acceptance.json > old.json."""

import dataclasses
import os
import sys
from pathlib import Path

import torch

from pipeline.acceptance.model import AcceptanceModel
from pipeline.bench.online_bound import modelled_generation
from pipeline.data.domains import load_domain
from pipeline.data.prompts import encode
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.artifacts import DEFAULT_PREDICTOR, load_artifacts
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.types import SamplingConfig
from pipeline.models.loading import load_pair

FIXED = [f"fixed:k={k}" for k in os.environ.get("FIXED", "1,2,3,4,5,6").split(",")]


def setup(acceptance: str):
    draft = os.environ.get("DRAFT")
    if draft:
        d = Path(draft)
        pair = load_pair("models/target", draft, "cpu", "float32", "eager")
        files = (d / "costmodel.json", d / "policy.json", "cpu", d / "acceptance.json")
        art = load_artifacts(DEFAULT_PREDICTOR, *files)
    else:
        pair, art = load_pair(), load_artifacts()
    if acceptance != "-":
        art = dataclasses.replace(art, acceptance=AcceptanceModel.load(Path(acceptance)))
    return pair, art


def main(acceptance: str, specs: list[str]) -> None:
    torch.set_num_threads(1)
    pair, art = setup(acceptance)
    engine = SpeculativeEngine(pair)
    total: dict[str, list[float]] = {}
    for domain in ("code", "prose", "math"):
        prompts = [encode(pair.tokenizer, p.text, keep_last=512) for p in load_domain(domain, 8)]
        res = {}
        for spec in FIXED + specs:
            name, _, kv = spec.partition(":")
            knobs = {
                k: v == "true" if v in ("true", "false") else float(v) if "." in v else int(v)
                for k, v in (x.split("=") for x in kv.split(";") if x)
            }
            ar = ms = 0.0
            accepted = steps = 0
            for ids in prompts:
                policy = make_policy(name, art, **knobs)
                out = engine.generate(ids, policy, 64, SamplingConfig(0.0), seed=0)
                run = modelled_generation(pair, ids, out.tokens, out.steps, art.cost)
                ar, ms = ar + run.ar_ms, ms + run.policy_ms
                accepted += sum(s.accepted for s in out.steps)
                steps += len(out.steps)
            res[spec] = (ar / ms, accepted / steps)
            sums = total.setdefault(spec, [0.0, 0.0])
            sums[0], sums[1] = sums[0] + ar, sums[1] + ms
        best = max(FIXED, key=lambda s: res[s][0])
        ours = " ".join(f"{s} {res[s][0] / res[best][0]:.3f} (acc {res[s][1]:.2f})" for s in specs)
        print(domain, "best", best, f"{res[best][0]:.3f}", ours, flush=True)
    best = max(FIXED, key=lambda s: total[s][0] / total[s][1])
    b = total[best][0] / total[best][1]
    print("all best", best, " ".join(f"{s} {total[s][0] / total[s][1] / b:.3f}" for s in specs))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["throughput"])
