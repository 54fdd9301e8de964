"""Modelled speedups at T = 1 over several seeds (the sampled text differs with the seed, so
one seed's 8 prompts x 64 tokens move a policy by several points): each policy's generations
priced with the committed cost model (bench_online's `modelled`), summed over the first 8
prompts of a domain and SEEDS seeds, over the best fixed K of the same prompts and seeds.

    python docs/results/bench_sampled_leaves_2026-12-03/modelled_t1.py SEEDS POLICIES [FIRST]

FIRST (0): the first prompt of each domain; 8 takes held-out prompts 8-15 (never in the bench,
never in the acceptance model's training set).

`specdec-leaves:n=N` (defined here only, an experiment): `specdec` with a further draw beside
each of its first N chain tokens, chosen before those tokens are drawn (lossless)."""

import sys
from dataclasses import dataclass

import torch

from pipeline.bench.online_bound import modelled_generation
from pipeline.data.domains import load_domain
from pipeline.data.prompts import encode
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.artifacts import load_artifacts
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.policies.specdec import SpecDecPolicy
from pipeline.decode.types import Candidates, SamplingConfig
from pipeline.models.loading import load_pair


@dataclass
class SpecDecLeaves(SpecDecPolicy):
    n: int = 1

    def propose(self, drafter, committed):
        cands, leaves = Candidates(), []
        probs, p_all = drafter.begin(committed), 1.0
        for j in range(self.max_k - self.n):
            state = drafter.hidden[-1]
            if j < self.n:
                leaves.append((j, drafter.sample(probs), probs))
            token = drafter.sample(probs)
            cands.extend_chain(token, probs, False)
            p_all *= self.acceptance.head_probability(False, state)
            if j + 1 == self.max_k - self.n or 1.0 - p_all > self.threshold:
                break
            probs = drafter.extend(token)
        for j, token, q in leaves:
            cands.tokens.append(token)
            cands.parents.append(j - 1)
            cands.q.append(q)
            cands.confidences.append(None)
        return cands


def main(seeds: int, specs: list[str], first: int = 0) -> None:
    torch.set_num_threads(1)
    pair, art = load_pair(), load_artifacts()
    engine = SpeculativeEngine(pair)
    for domain in ("code", "prose", "math"):
        prompts = [
            encode(pair.tokenizer, p.text, keep_last=256) for p in load_domain(domain, first + 8)
        ][first:]
        speedup, accepted = {}, {}
        for spec in specs:
            name, _, kv = spec.partition(":")
            knobs = {
                k: float(v) if "." in v else int(v)
                for k, v in (x.split("=") for x in kv.split(";") if x)
            }
            ar = total = 0.0
            acc = steps = 0
            for seed in range(seeds):
                for ids in prompts:
                    policy = (
                        SpecDecLeaves(art.acceptance, **knobs)
                        if name == "specdec-leaves"
                        else make_policy(name, art, **knobs)
                    )
                    out = engine.generate(ids, policy, 64, SamplingConfig(1.0), seed=seed)
                    run = modelled_generation(pair, ids, out.tokens, out.steps, art.cost)
                    ar, total = ar + run.ar_ms, total + run.policy_ms
                    acc, steps = acc + sum(s.accepted for s in out.steps), steps + len(out.steps)
            speedup[spec], accepted[spec] = ar / total, acc / steps
        best = max(v for k, v in speedup.items() if k.startswith("fixed"))
        for spec in specs:
            print(
                f"{domain:6s} {spec:24s} modelled {speedup[spec]:.3f}x over ar, "
                f"{speedup[spec] / best:.3f}x the best fixed K, accepted/step {accepted[spec]:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3]) if len(sys.argv) > 3 else 0)
