"""Every registered policy on the device (CUDA when present): greedy tokens equal to plain
greedy (`ar`) for the embedded 1-layer draft and the EAGLE-3 head, and a T = 1 run of each.

    PYTHONPATH=. python docs/results/gpu_h200_2026-12-04/engine_on_device.py [cuda|cpu]
"""

from __future__ import annotations

import sys
import time
import traceback

import torch

from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.artifacts import load_pair_artifacts
from pipeline.decode.policies.registry import POLICIES, make_policy
from pipeline.decode.types import SamplingConfig
from pipeline.models.loading import load_pair

PROMPTS = [
    "def fibonacci(n):\n    ",
    "The history of the river begins",
    "Question: what is 17 * 23? Answer:",
]
HEAD = "models/eagle3-head"
PAIRS = {"draft (1 layer)": (None, None), "eagle3 head": (HEAD, HEAD)}
SKIP = {"batch"}  # decodes several requests at once; not a single-session policy


def main(device: str) -> int:
    failures = 0
    for label, (draft, art_dir) in PAIRS.items():
        kw = {} if draft is None else {"draft": draft}
        pair = load_pair(device=device, dtype="float32", **kw)
        artifacts = load_pair_artifacts(art_dir, device=str(pair.device))
        engine = SpeculativeEngine(pair)
        on_gpu = pair.device.type == "cuda"
        device_name = torch.cuda.get_device_name() if on_gpu else "cpu"
        print(f"== {label} on {pair.device} ({device_name})", flush=True)
        ids = [pair.tokenizer(p)["input_ids"] for p in PROMPTS]
        ar = make_policy("ar")
        reference = [engine.generate(i, ar, 32, stop_at_eos=False).tokens for i in ids]
        for name in sorted(set(POLICIES) - SKIP):
            try:
                t0 = time.perf_counter()
                out = [
                    engine.generate(i, make_policy(name, artifacts), 32, stop_at_eos=False)
                    for i in ids
                ]
                greedy_s = time.perf_counter() - t0
                equal = all(o.tokens == r for o, r in zip(out, reference, strict=True))
                accepted = sum(o.mean_accepted for o in out) / len(out)
                t1 = [
                    engine.generate(
                        i,
                        make_policy(name, artifacts),
                        32,
                        SamplingConfig(1.0),
                        seed=j,
                        stop_at_eos=False,
                    )
                    for j, i in enumerate(ids)
                ]
                print(
                    f"  {name:14s} greedy==ar {equal!s:5s} accepted/step {accepted:.2f} "
                    f"({greedy_s:.2f} s)  T=1 tokens {[len(o.tokens) for o in t1]}",
                    flush=True,
                )
                failures += not equal
            except Exception:  # report every policy, then fail
                failures += 1
                print(f"  {name:14s} FAILED\n{traceback.format_exc()}", flush=True)
    print(f"failures: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cuda"))
