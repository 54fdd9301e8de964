"""Where each policy's time per token goes, measured, beside its modelled prices: interleaved
prompt by prompt, 8 prompts per domain x 64 tokens, two passes, T = 0. Run from the repository
root:

    python docs/results/repeat_outcomes_2026-12-04/step_parts.py ARTIFACTS POLICIES [DOMAINS]

ARTIFACTS: models (the 1-layer pair) or models/eagle3-head; POLICIES: comma-separated, e.g.
fixed:k=3,throughput@old.json,throughput (NAME@FILE: that policy with another acceptance.json;
NAME#FILE: with another costmodel.json; knobs NAME:k=V;k2=true). PASSES (environment, default
2): passes over the prompts.
Columns: tok/s, ms per token (draft, verify, acceptance walk, the rest), steps, draft forwards
per step, tokens fed per forward, ms per forward, modelled draft and verify ms per token,
measured over modelled."""

import dataclasses
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from pipeline.acceptance.model import AcceptanceModel
from pipeline.cost.model import CostModel
from pipeline.data.domains import load_prompts
from pipeline.data.prompts import encode
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.heap import frozen_heap
from pipeline.decode.policies.artifacts import DEFAULT_PREDICTOR, load_artifacts
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.types import SamplingConfig
from pipeline.models.loading import load_pair


def build(spec: str, art):
    """NAME[:k=V][@ACCEPTANCE_JSON][#COSTMODEL_JSON] -> a policy."""
    spec, _, costmodel = spec.partition("#")
    if costmodel:
        art = dataclasses.replace(art, cost=CostModel.load(Path(costmodel)))
    spec, _, acceptance = spec.partition("@")
    if acceptance:
        art = dataclasses.replace(art, acceptance=AcceptanceModel.load(Path(acceptance)))
    name, _, kv = spec.partition(":")
    knobs = {
        k: v == "true" if v in ("true", "false") else float(v) if "." in v else int(v)
        for k, v in (x.split("=") for x in kv.split(";") if x)
    }
    return make_policy(name, art, **knobs)


def load(artifacts: str):
    """(pair, artifacts): ``models`` (the 1-layer pair) or ``models/eagle3-head``."""
    head = "eagle3" in artifacts
    pair = load_pair(
        "models/target", artifacts if head else "models/draft", "cpu", "float32", "eager"
    )
    d = Path(artifacts)
    art = (
        load_artifacts(
            DEFAULT_PREDICTOR, d / "costmodel.json", d / "policy.json", "cpu", d / "acceptance.json"
        )
        if head
        else load_artifacts()
    )
    return pair, art


def main(artifacts: str, specs: list[str], domains: list[str]) -> None:
    torch.set_num_threads(1)
    pair, art = load(artifacts)
    engine = SpeculativeEngine(pair)
    prompts = [
        encode(pair.tokenizer, p.text, keep_last=512)
        for dom in domains
        for p in load_prompts(dom, 8)
    ]
    sums = {s: defaultdict(float) for s in specs}
    with frozen_heap():  # (pipeline.decode.heap: no full collection inside a timed decode)
        for _ in range(int(os.environ.get("PASSES", "2"))):
            for ids in prompts:
                for spec in specs:
                    session = engine.start(
                        ids, build(spec, art), SamplingConfig(temperature=0.0), seed=0
                    )
                    t0 = time.perf_counter()
                    while len(session.generated) < 64:
                        session.step()
                    a = sums[spec]
                    a["wall"] += (time.perf_counter() - t0) * 1e3
                    a["tok"] += len(session.generated)
                    a["steps"] += len(session.steps)
                    for st in session.steps:
                        a["draft"] += st.t_draft_ms
                        a["verify"] += st.t_verify_ms
                        a["accept"] += st.t_accept_ms
                        a["fw"] += st.draft_forwards
                        a["dtok"] += st.draft_tokens
                        a["mdraft"] += art.cost.t_draft(st.draft_forwards)
                        a["mverify"] += art.cost.t_target(st.verified, st.u_bar, 0)
    print(
        f"{'policy':36s} tok/s ms/tok draft verify accept other | steps fw/step tok/fw ms/fw "
        "model_d model_v meas/mod_d meas/mod_v"
    )
    for spec, a in sums.items():
        t, fw = a["tok"], max(a["fw"], 1)
        other = a["wall"] - a["draft"] - a["verify"] - a["accept"]
        print(
            f"{spec:36s} {1e3 * t / a['wall']:5.1f} {a['wall'] / t:6.3f} {a['draft'] / t:5.3f} "
            f"{a['verify'] / t:6.3f} {a['accept'] / t:6.3f} {other / t:5.3f} | {a['steps']:5.0f} "
            f"{a['fw'] / a['steps']:7.2f} {a['dtok'] / fw:6.2f} {a['draft'] / fw:5.3f} "
            f"{a['mdraft'] / t:7.3f} {a['mverify'] / t:7.3f} "
            f"{a['draft'] / max(a['mdraft'], 1e-9):10.3f} "
            f"{a['verify'] / a['mverify']:10.3f}"
        )


if __name__ == "__main__":
    main(
        sys.argv[1],
        sys.argv[2].split(","),
        sys.argv[3].split(",") if len(sys.argv) > 3 else ["code", "prose", "math"],
    )
