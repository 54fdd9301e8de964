"""What `throughput`'s decisions cost with the head, separated from what its schedule costs:
per prompt (8 of each domain in argv[1], e.g. code,math; twice), `throughput`, then a replay of
its own per-step draft lengths with no decisions (`Schedule`, fixed chains of those lengths),
then fixed K = 5, interleaved; measured decoding, draft and verification time, and the cost
model's price of the steps. Run from the repository root."""

import sys
import time

from verify_diag import head_setup  # the script beside this one

from pipeline.data.domains import load_prompts
from pipeline.data.prompts import encode
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.base import Policy, draft_chain
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.step_limits import chain_work


class Schedule(Policy):
    """Fixed chains of the given lengths, step by step (4 past the end)."""

    name = "schedule"

    def __init__(self, ks: list[int]):
        self.ks, self.i = list(ks), 0

    def propose(self, drafter, committed):
        k = self.ks[self.i] if self.i < len(self.ks) else 4
        self.i += 1
        return draft_chain(drafter, committed, k)

    def step_work(self):
        return chain_work(12, "max 12")


def main(domains: list[str]) -> None:
    pair, art = head_setup()
    engine = SpeculativeEngine(pair)
    names = ("throughput", "schedule", "fixed5")
    for domain in domains:
        prompts = [encode(pair.tokenizer, p.text, keep_last=512) for p in load_prompts(domain, 8)]
        total = dict.fromkeys(names, 0.0)
        draft, verify, modelled = dict(total), dict(total), dict(total)
        for _ in range(2):
            for ids in prompts:
                ks: list[int] = []
                for name in names:
                    if name == "throughput":
                        policy = make_policy("throughput", art)
                    elif name == "fixed5":
                        policy = make_policy("fixed", art, k=5)
                    else:
                        policy = Schedule(ks)
                    started = time.perf_counter()
                    gen = engine.generate(ids, policy, 64)
                    total[name] += time.perf_counter() - started
                    ctx = len(ids)
                    for s in gen.steps:
                        draft[name] += s.t_draft_ms / 1000
                        verify[name] += s.t_verify_ms / 1000
                        modelled[name] += art.cost.t_target(s.verified, s.u_bar, ctx) / 1000
                        modelled[name] += art.cost.t_draft(s.draft_forwards) / 1000
                        ctx += s.new_tokens
                    if name == "throughput":
                        ks = [s.drafted for s in gen.steps]
        for name in names:
            print(
                f"{domain} {name:11s} total {total[name]:.2f}s draft {draft[name]:.2f} "
                f"verify {verify[name]:.2f} modelled {modelled[name]:.2f}"
            )


if __name__ == "__main__":
    main(sys.argv[1].split(","))
