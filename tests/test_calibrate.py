"""Speculative rounds (shared with the engine) and a real calibration on the embedded models."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pipeline.cost.rounds import _generation_rounds
from pipeline.data.references import greedy_continuation
from pipeline.data.schemas import ROUNDS_SCHEMA
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.simple import FixedPolicy
from pipeline.decode.types import SamplingConfig
from pipeline.models.adapters import moe_spec
from pipeline.models.loading import REPO_ROOT, ModelPair
from tests.conftest import tiny_draft
from tests.tinymodels import VOCAB, tiny_model


@pytest.fixture(scope="module")
def pair() -> ModelPair:
    target = tiny_model("mixtral", seed=3)
    return ModelPair(target, tiny_draft(VOCAB), None, moe_spec(target.config),
                     torch.device("cpu"), torch.float32, "eager", "t", "d")  # fmt: skip


def test_timed_rounds_repeat_passes_without_changing_the_output(pair):
    engine = SpeculativeEngine(pair)
    prompt = [3, 14, 15, 92, 65]
    expected = greedy_continuation(pair.target, prompt, 12, eos_id=None)
    for k in (0, 3):
        rows = _generation_rounds(engine, prompt, k, 12, None, repeats=3)
        assert [r["m"] for r in rows] == [k + 1] * len(rows)
        assert all(r["t_target_ms"] > 0 for r in rows)
        assert sum(r["accepted"] + 1 for r in rows) >= 12
    session = engine.start(prompt, FixedPolicy(3), repeats=3)
    while len(session.generated) < 12:
        session.step()
        assert session.target_cache.get_seq_length() == len(session.committed) - 1
    assert session.generated[:12] == expected
    with pytest.raises(ValueError, match="need greedy"):
        engine.start(prompt, FixedPolicy(2), SamplingConfig(temperature=1.0), repeats=2)


@pytest.mark.slow
def test_real_calibration_on_embedded_models(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    args = "--limit 6 --ks 0,1,3,5,7 --max-new-tokens 32 --experts-implementation eager --out cal"
    args += " --repeats 5"  # median of 5 timings per pass: robust to a busy machine
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
