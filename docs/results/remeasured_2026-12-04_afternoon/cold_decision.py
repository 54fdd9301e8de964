"""position_view's time in a decoding `throughput` with the head, called twice in a row after
each draft forward (and once more on a copy of the distribution): the first call pays for
caches the forward evicted. Run from the repository root."""

import sys
import time

import torch

sys.path.insert(0, "docs/results/repeat_outcomes_2026-12-04")
from collections import defaultdict
from pathlib import Path

from step_parts import build

import pipeline.decode.policies.throughput as tp
from pipeline.data.domains import load_prompts
from pipeline.data.prompts import encode
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.artifacts import DEFAULT_PREDICTOR, load_artifacts
from pipeline.decode.types import SamplingConfig
from pipeline.models.loading import load_pair

torch.set_num_threads(1)
d = Path("models/eagle3-head")
pair = load_pair("models/target", str(d), "cpu", "float32", "eager")
art = load_artifacts(
    DEFAULT_PREDICTOR, d / "costmodel.json", d / "policy.json", "cpu", d / "acceptance.json"
)
engine = SpeculativeEngine(pair)
prompts = [
    encode(pair.tokenizer, p.text, keep_last=512) for dom in ["code"] for p in load_prompts(dom, 8)
]
T = defaultdict(float)
N = defaultdict(int)
orig = tp.position_view


def pv(probs, index, tail):
    t0 = time.perf_counter()
    orig(probs, index, tail)
    t1 = time.perf_counter()
    r = orig(probs, index, tail)
    t2 = time.perf_counter()
    x = probs.clone()
    t3 = time.perf_counter()
    orig(x, index, tail)
    t4 = time.perf_counter()
    T["first"] += t1 - t0
    T["second"] += t2 - t1
    T["clone"] += t4 - t3
    N["n"] += 1
    return r


tp.position_view = pv
for ids in prompts:
    s = engine.start(ids, build("throughput", art), SamplingConfig(temperature=0.0), seed=0)
    while len(s.generated) < 64:
        s.step()
for k, v in T.items():
    print(f"{k:10s} {1e6 * v / N['n']:.1f} us")
