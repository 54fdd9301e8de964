"""Speculative rounds (shared with the engine) and a real calibration on the embedded models."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pipeline.adapters import moe_spec
from pipeline.calibrate import ROUNDS_SCHEMA
from pipeline.models import REPO_ROOT, ModelPair
from pipeline.reference import greedy_continuation
from pipeline.speculative import commit, propose_greedy, start, verify_greedy
from tests.conftest import tiny_draft
from tests.tinymodels import VOCAB, tiny_model


@pytest.fixture(scope="module")
def pair() -> ModelPair:
    target = tiny_model("mixtral", seed=3)
    return ModelPair(target, tiny_draft(VOCAB), None, moe_spec(target.config),
                     torch.device("cpu"), torch.float32, "eager", "t", "d")  # fmt: skip


@pytest.mark.parametrize("k", [0, 1, 3, 6])
def test_fixed_chain_rounds_reproduce_plain_greedy(pair, k):
    prompt = [3, 14, 15, 92, 65]
    expected = greedy_continuation(pair.target, prompt, 20, eos_id=None)
    state = start(pair, prompt)
    while state.generated < 20:
        proposal = propose_greedy(pair, state, k, repeats=2 if k == 3 else 1)
        verification = verify_greedy(pair, state, proposal.tokens, repeats=2 if k == 6 else 1)
        assert verification.routing.shape == (k + 1, pair.spec.num_moe_layers, pair.spec.top_k)
        commit(state, verification)
        # Invariant: the target cache holds every committed token but the last.
        assert state.target_cache.get_seq_length() == len(state.committed) - 1
        assert state.draft_cache.get_seq_length() <= len(state.committed)
    assert state.committed[len(prompt) : len(prompt) + 20] == expected


@pytest.mark.slow
def test_real_calibration_on_embedded_models(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    args = "--limit 6 --ks 0,1,3,5,7 --max-new-tokens 32 --experts-implementation eager --out cal"
    cmd = [sys.executable, "-m", "jobs.calibrate", *args.split()]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "factor importance" in proc.stdout
    out = tmp_path / "cal"
    for name in ("costmodel.json", "rounds.parquet", "per_k.csv", "target_vs_experts.png",
                 "draft_vs_k.png"):  # fmt: skip
        assert (out / name).is_file(), name
    import pyarrow.parquet as pq

    assert pq.read_schema(out / "rounds.parquet").names == ROUNDS_SCHEMA.names
    model = json.loads((out / "costmodel.json").read_text())
    assert model["experts_implementation"] == "eager"
    assert model["draft"]["a"] > 0 and "draft_model" in model
    per_m = model["fit"]["per_m"]
    assert set(per_m) == {"1", "2", "4", "6", "8"}
    for m in ("4", "6", "8"):
        # Eager experts on CPU: each extra unique expert costs time, clearly measurable.
        assert model["alpha"][m] > 0, (m, model["alpha"])
        assert per_m[m]["alpha_p"] < 0.05, (m, per_m[m])
