"""The oracle job end to end on a small extraction made with the tiny models."""

from __future__ import annotations

import json

import pandas as pd
import pyarrow.parquet as pq
import pytest
import ray

from jobs import oracle as oracle_job
from pipeline.cost.model import CostModel
from pipeline.data.prompts import load_jsonl
from pipeline.data.references import build_references
from pipeline.data.shards import check_manifest, write_shard
from pipeline.extract.rows import extract_sequence
from pipeline.models.adapters import moe_spec
from pipeline.models.loading import load_pair
from tests.test_extract_pipeline import FIXTURE

LMAX = 4


@pytest.fixture(scope="module")
def extraction(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("extract")
    pair = load_pair(checkpoints.target, checkpoints.draft)
    refs = build_references(load_jsonl(FIXTURE, limit=4), pair.target, pair.tokenizer, 12)
    check_manifest(out, {"lmax": LMAX, "mode": "shared"})
    for shard, ref in enumerate(refs):
        part = extract_sequence(pair, ref, LMAX, "shared", seed=0)
        write_shard(out, shard, {"sequences": part.sequences, "tokens": part.tokens,
                                 "tails": part.tails})  # fmt: skip
    model = CostModel({m: 4.0 + 0.3 * m for m in range(1, LMAX + 2)},
                      {m: 0.05 * m for m in range(1, LMAX + 2)}, 0.001, 0.2, 0.05,
                      meta={"device": "synthetic"})  # fmt: skip
    model.save(out / "costmodel.json")
    return out, pair


def test_oracle_job_writes_the_study(extraction, checkpoints, tmp_path, monkeypatch, capsys):
    extract_dir, pair = extraction
    monkeypatch.chdir(tmp_path)
    ray.init(num_cpus=2)
    try:
        oracle_job.main(["--extract", str(extract_dir), "--costmodel",
                         str(extract_dir / "costmodel.json"), "--target", str(checkpoints.target),
                         "--out", "oracle"])  # fmt: skip
    finally:
        ray.shutdown()
    printed = capsys.readouterr().out
    assert "Lmax sweep" in printed and "boundary slope lambda" in printed
    out = tmp_path / "oracle"
    decisions = pq.read_table(out / "decisions.parquet").to_pandas()
    summary = pq.read_table(out / "summary.parquet").to_pandas()
    assert {"seq_id", "lmax", "i", "k", "e_accept", "e_cost_ms", "e_experts", "q_value",
            "chosen", "visit"} <= set(decisions.columns)  # fmt: skip
    assert {"seq_id", "lmax", "dp0_ms", "ar_ms", "speedup", "mean_k", "mean_accept"} <= set(
        summary.columns
    )
    assert sorted(summary["lmax"].unique()) == list(range(1, LMAX + 1))
    # Exactly one chosen budget per state.
    assert (decisions.groupby(["seq_id", "i"])["chosen"].sum() == 1).all()
    sweep = pd.read_csv(out / "lmax_sweep.csv")
    bound = sweep[sweep["category"] == "all"].sort_values("lmax")["speedup_bound"].to_numpy()
    assert (bound[1:] >= bound[:-1] - 1e-12).all()
    policy = json.loads((out / "policy.json").read_text())
    assert policy["lambda_ms_per_token"] > 0 and policy["lmax"] == LMAX
    assert (out / "lmax_sweep.png").is_file() and (out / "delta_space.png").is_file()
    classes = pd.read_csv(out / "context_classes.csv")
    assert classes["states"].sum() == len(decisions[decisions["chosen"]])
    assert moe_spec(pair.target.config).num_experts == 8


def test_oracle_job_rejects_a_sweep_beyond_the_extraction(extraction, checkpoints, tmp_path):
    extract_dir, _ = extraction
    with pytest.raises(ValueError, match="must lie in 1..4"):
        oracle_job.main(["--extract", str(extract_dir), "--costmodel",
                         str(extract_dir / "costmodel.json"), "--lmax", "1-6",
                         "--out", str(tmp_path)])  # fmt: skip
