"""`throughput` reading each position with one compiled call (pipeline.acceptance.native_reads,
its default where a C compiler exists) against `throughput` reading with tensor calls, and a
fixed K, interleaved prompt by prompt (every policy decodes prompt j before any decodes
prompt j + 1, the order rotating with j), T = 0, 8 prompts per domain x 64 tokens. The
decisions are the same (the step counts are printed). Run from the repository root:

    PYTHONPATH=.:docs/results/repeat_outcomes_2026-12-04 python \\
        docs/results/cold_decisions_2026-12-04/native_ab.py ARTIFACTS FIXED_K [PASSES]
"""

import sys
import time
from collections import defaultdict

import torch
from step_parts import build, load

from pipeline.data.domains import load_prompts
from pipeline.data.prompts import encode
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.heap import frozen_heap
from pipeline.decode.policies import throughput
from pipeline.decode.types import SamplingConfig

_native = throughput.native_reads


def reads_with(compiled: bool) -> None:
    throughput.native_reads = _native if compiled else lambda: None


def main(artifacts: str, fixed_k: int, passes: int) -> None:
    torch.set_num_threads(1)
    pair, art = load(artifacts)
    assert _native() is not None, "no C compiler here: nothing to compare"
    engine = SpeculativeEngine(pair)
    prompts = [
        encode(pair.tokenizer, p.text, keep_last=512)
        for dom in ("code", "prose", "math")
        for p in load_prompts(dom, 8)
    ]
    specs = [f"fixed:k={fixed_k}", "throughput, tensor calls", "throughput"]
    sums = {s: defaultdict(float) for s in specs}
    with frozen_heap():
        for _ in range(passes):
            for j, ids in enumerate(prompts):
                for spec in specs[j % 3 :] + specs[: j % 3]:  # the order rotates with j
                    reads_with(not spec.endswith("tensor calls"))
                    policy = build(spec.split(",")[0], art)
                    session = engine.start(ids, policy, SamplingConfig(temperature=0.0), seed=0)
                    t0 = time.perf_counter()
                    while len(session.generated) < 64:
                        session.step()
                    a = sums[spec]
                    a["wall"] += time.perf_counter() - t0
                    a["tok"] += len(session.generated)
                    a["steps"] += len(session.steps)
                    a["fw"] += sum(st.draft_forwards for st in session.steps)
                    a["draft"] += sum(st.t_draft_ms for st in session.steps)
                    reads_with(True)
    base = sums[specs[0]]["tok"] / sums[specs[0]]["wall"]
    print(f"{'policy':26s} tok/s  x fixed  steps  ms per draft forward")
    for spec, a in sums.items():
        rate = a["tok"] / a["wall"]
        print(
            f"{spec:26s} {rate:5.1f}  {rate / base:6.3f}  {a['steps']:5.0f}  "
            f"{a['draft'] / max(a['fw'], 1):.3f}"
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 3)
