"""Measured against modelled verification and draft time per pass size m, with the head: `ar`,
fixed K = 1, 3, 6, 8 and `throughput` on 8 prompts of each domain in argv[1] (e.g. math,code),
priced by the committed cost model. Run from the repository root."""

import sys
from collections import defaultdict
from pathlib import Path

import torch

from pipeline.data.domains import load_prompts
from pipeline.data.prompts import encode
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.artifacts import load_artifacts
from pipeline.decode.policies.registry import make_policy
from pipeline.models.loading import load_pair

SPECS = [("ar", {}), ("fixed", {"k": 1}), ("fixed", {"k": 3}), ("fixed", {"k": 6})]
SPECS += [("fixed", {"k": 8}), ("throughput", {})]


def head_setup():
    """The head pair on CPU (float32, eager experts, one thread) and its committed artifacts."""
    torch.set_num_threads(1)
    head = Path("models/eagle3-head")
    pair = load_pair("models/target", head, "cpu", "float32", "eager")
    art = load_artifacts(
        Path("models/predictor"),
        head / "costmodel.json",
        head / "policy.json",
        "cpu",
        head / "acceptance.json",
    )
    return pair, art


def main(domains: list[str]) -> None:
    pair, art = head_setup()
    engine = SpeculativeEngine(pair)
    for domain in domains:
        prompts = [encode(pair.tokenizer, p.text, keep_last=512) for p in load_prompts(domain, 8)]
        verify = defaultdict(lambda: [0, 0.0, 0.0])  # m -> [steps, measured, modelled]
        draft = defaultdict(lambda: [0, 0.0, 0.0])  # forwards -> the same
        for name, knobs in SPECS:
            for ids in prompts:
                gen = engine.generate(ids, make_policy(name, art, **knobs), 64)
                ctx = len(ids)
                for s in gen.steps:
                    cell = verify[s.verified]
                    cell[0] += 1
                    cell[1] += s.t_verify_ms
                    cell[2] += art.cost.t_target(s.verified, s.u_bar, ctx)
                    if s.draft_forwards:
                        cell = draft[s.draft_forwards]
                        cell[0] += 1
                        cell[1] += s.t_draft_ms
                        cell[2] += art.cost.t_draft(s.draft_forwards)
                    ctx += s.new_tokens
        print(f"== {domain}: verification, m  steps  measured ms  modelled ms  ratio")
        for m, (n, measured, modelled) in sorted(verify.items()):
            print(
                f"  m={m:2d} n={n:4d} {measured / n:7.2f} {modelled / n:7.2f} "
                f"{measured / modelled:5.2f}"
            )
        print("   draft, forwards  steps  measured ms  modelled ms  ratio")
        for f, (n, measured, modelled) in sorted(draft.items()):
            print(
                f"  f={f:2d} n={n:4d} {measured / n:7.2f} {modelled / n:7.2f} "
                f"{measured / modelled:5.2f}"
            )


if __name__ == "__main__":
    main(sys.argv[1].split(","))
