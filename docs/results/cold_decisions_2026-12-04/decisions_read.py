"""How many of `throughput`'s decisions read the token's features (position_view) against the
draft forwards its chains ran, for each policy spec: the bench's 8 prompts per domain x 64
tokens, T = 0. With trust_above.diff or sure_at.diff applied (git apply), it counts the
tokens those variants drafted without reading. Run from the repository root:

    PYTHONPATH=.:docs/results/repeat_outcomes_2026-12-04 python \\
        docs/results/cold_decisions_2026-12-04/decisions_read.py ARTIFACTS SPEC...

ARTIFACTS: models (the 1-layer pair) or models/eagle3-head."""

import sys
from collections import Counter

import torch
from step_parts import load

from pipeline.data.domains import load_domain
from pipeline.data.prompts import encode
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies import throughput
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.types import SamplingConfig

READS: Counter = Counter()
_view = throughput.position_view


def counted_view(*args, **kwargs):
    READS["reads"] += 1
    return _view(*args, **kwargs)


def main(artifacts: str, specs: list[str]) -> None:
    torch.set_num_threads(1)
    throughput.position_view = counted_view
    pair, art = load(artifacts)
    engine = SpeculativeEngine(pair)
    for spec in specs:
        name, _, kv = spec.partition(":")
        knobs = {
            k: float(v) if "." in v else int(v)
            for k, v in (x.split("=") for x in kv.split(";") if x)
        }
        for domain in ("code", "prose", "math"):
            READS.clear()
            forwards = 0
            for p in load_domain(domain, 8):
                ids = encode(pair.tokenizer, p.text, keep_last=512)
                out = engine.generate(
                    ids, make_policy(name, art, **knobs), 64, SamplingConfig(0.0), seed=0
                )
                forwards += sum(s.draft_forwards for s in out.steps)
            reads = READS["reads"]
            print(
                f"{spec:32s} {domain:6s} draft forwards {forwards:5d}  features read {reads:5d} "
                f"({reads / max(forwards, 1):.0%})",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
