"""Each policy's propose time outside the draft's forwards, per step and per draft forward,
interleaved prompt by prompt (24 prompts x 64 tokens, two passes). Run from the repository
root: python docs/results/remeasured_2026-12-04_afternoon/decision_overhead.py head|draft
POLICIES [TEMPERATURE]"""

import sys
import time

import torch

sys.path.insert(0, "docs/results/repeat_outcomes_2026-12-04")
from pathlib import Path

from step_parts import build

from pipeline.data.domains import load_prompts
from pipeline.data.prompts import encode
from pipeline.decode.drafter import Drafter
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.artifacts import DEFAULT_PREDICTOR, load_artifacts
from pipeline.decode.types import SamplingConfig
from pipeline.models.loading import load_pair

torch.set_num_threads(1)
head = sys.argv[1] == "head"
specs = sys.argv[2].split(",")
T = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
if head:
    d = Path("models/eagle3-head")
    pair = load_pair("models/target", str(d), "cpu", "float32", "eager")
    art = load_artifacts(
        DEFAULT_PREDICTOR, d / "costmodel.json", d / "policy.json", "cpu", d / "acceptance.json"
    )
else:
    pair = load_pair("models/target", "models/draft", "cpu", "float32", "eager")
    art = load_artifacts()
engine = SpeculativeEngine(pair)
prompts = [
    encode(pair.tokenizer, p.text, keep_last=512)
    for dom in ["code", "prose", "math"]
    for p in load_prompts(dom, 8)
]
acc = {"fw": 0.0}
orig = Drafter._run


def run(self, ids, **kw):
    t = time.perf_counter()
    r = orig(self, ids, **kw)
    acc["fw"] += time.perf_counter() - t
    return r


Drafter._run = run
res = {s: [0.0] * 6 for s in specs}
for _ in range(2):
    for ids in prompts:
        for s in specs:
            pol = build(s, art)
            sess = engine.start(ids, pol, SamplingConfig(temperature=T), seed=0)
            origp = pol.propose

            def prop(dr, c, origp=origp, s=s):
                acc["fw"] = 0.0
                t = time.perf_counter()
                r = origp(dr, c)
                dt = time.perf_counter() - t
                res[s][0] += dt
                res[s][1] += acc["fw"]
                res[s][2] += dr.forwards
                res[s][3] += 1
                return r

            pol.propose = prop
            t0 = time.perf_counter()
            while len(sess.generated) < 64:
                sess.step()
            res[s][4] += time.perf_counter() - t0
            res[s][5] += len(sess.generated)
for s, (p, f, n, st, w, tok) in res.items():
    other = 1e3 * (p - f)
    print(
        f"{s:20s} tok/s {tok / w:6.1f} propose {1e3 * p / st:.3f} ms/step "
        f"fw {1e3 * f / st:.3f} other {other / st:.3f} ms/step = "
        f"{other / max(n, 1):.3f} ms/forward; fw/step {n / st:.2f}"
    )
