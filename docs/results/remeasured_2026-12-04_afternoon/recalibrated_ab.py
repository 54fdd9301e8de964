"""throughput priced by the committed cost model against the same policy priced by one
recalibrated now, beside fixed(k=3) and fixed(k=4), interleaved prompt by prompt, T = 0."""

import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from pipeline.data.domains import load_prompts
from pipeline.data.prompts import encode
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.artifacts import load_artifacts
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.types import SamplingConfig
from pipeline.models.loading import load_pair

torch.set_num_threads(1)

pair = load_pair("models/target", "models/draft", "cpu", "float32", "eager")
arts = {"committed": load_artifacts(), "recalibrated": load_artifacts(costmodel=Path(sys.argv[1]))}
domains = sys.argv[2].split(",")
specs = [
    ("fixed(k=3)", "fixed", {"k": 3}, "committed"),
    ("fixed(k=4)", "fixed", {"k": 4}, "committed"),
    ("throughput committed", "throughput", {}, "committed"),
    ("throughput recalibrated", "throughput", {}, "recalibrated"),
]
engine = SpeculativeEngine(pair)
prompts = [
    encode(pair.tokenizer, p.text, keep_last=512) for d in domains for p in load_prompts(d, 8)
]
sec, tok, acc = defaultdict(float), defaultdict(int), defaultdict(float)
for rep in range(3):
    for j, ids in enumerate(prompts):
        for t in range(len(specs)):
            label, name, knobs, a = specs[(t + j + rep) % len(specs)]
            s = engine.start(
                ids, make_policy(name, arts[a], **knobs), SamplingConfig(temperature=0.0), seed=0
            )
            t0 = time.perf_counter()
            while len(s.generated) < 64:
                s.step()
            sec[label] += time.perf_counter() - t0
            tok[label] += len(s.generated)
            acc[label] += len(s.steps)
best = max(tok[name] / sec[name] for name, *_ in specs[:2])
for name, *_ in specs:
    rate = tok[name] / sec[name]
    print(
        f"{name:26s} {rate:6.1f} tok/s  x best fixed {rate / best:.3f}  "
        f"tokens/step {tok[name] / acc[name]:.2f}"
    )
