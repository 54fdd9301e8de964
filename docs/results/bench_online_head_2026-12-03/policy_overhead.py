"""The time a policy spends per draft forward outside the head's own forwards (its decisions),
for fixed K = 6, `specdec` and `throughput` on 8 math prompts, twice. Run from the repository
root."""

import time

from verify_diag import head_setup  # the script beside this one

from pipeline.data.domains import load_prompts
from pipeline.data.prompts import encode
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.head_drafter import HeadDrafter
from pipeline.decode.policies.registry import make_policy

FORWARD_S = [0.0]


def _timed(method):
    def wrapped(self, *args, **kwargs):
        start = time.perf_counter()
        out = method(self, *args, **kwargs)
        FORWARD_S[0] += time.perf_counter() - start
        return out

    return wrapped


def main() -> None:
    pair, art = head_setup()
    HeadDrafter.begin = _timed(HeadDrafter.begin)
    HeadDrafter.extend = _timed(HeadDrafter.extend)
    engine = SpeculativeEngine(pair)
    prompts = [encode(pair.tokenizer, p.text, keep_last=512) for p in load_prompts("math", 8)]
    for _ in range(2):
        for name, knobs in [("fixed", {"k": 6}), ("specdec", {}), ("throughput", {})]:
            FORWARD_S[0], draft_ms, forwards = 0.0, 0.0, 0
            for ids in prompts:
                gen = engine.generate(ids, make_policy(name, art, **knobs), 64)
                draft_ms += sum(s.t_draft_ms for s in gen.steps)
                forwards += sum(s.draft_forwards for s in gen.steps)
            fwd_ms = FORWARD_S[0] * 1000
            print(
                f"{name:12s} draft ms/fwd {draft_ms / forwards:.3f}  forwards only "
                f"{fwd_ms / forwards:.3f}  the rest {(draft_ms - fwd_ms) / forwards:.3f}"
            )


if __name__ == "__main__":
    main()
