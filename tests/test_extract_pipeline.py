"""The extraction pipeline on real Ray clusters: sharding over nodes, resuming after a kill."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
import ray
from ray.cluster_utils import Cluster

from pipeline.data.prompts import load_jsonl
from pipeline.data.shards import ManifestMismatchError, completed_shards, read_table
from pipeline.extract.ray_pipeline import TABLES, ExtractConfig, run_extraction
from pipeline.models.loading import REPO_ROOT

FIXTURE = Path(__file__).parent / "fixtures" / "mtbench_small.jsonl"


def _config(checkpoints, out, **kw) -> ExtractConfig:
    return ExtractConfig(
        target=str(checkpoints.target),
        draft=str(checkpoints.draft),
        out=str(out),
        lmax=3,
        max_new_tokens=6,
        **kw,
    )


def _sorted(table: pa.Table, keys: list[str]) -> pa.Table:
    return table.sort_by([(k, "ascending") for k in keys])


@pytest.mark.slow
def test_two_nodes_both_process_shards(checkpoints, tmp_path):
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address)
        prompts = load_jsonl(FIXTURE, limit=6)
        result = run_extraction(
            _config(checkpoints, tmp_path / "out", threads=1),
            prompts,
            str(FIXTURE),
            6,
            shard_size=1,
            actors=2,
            log=lambda *_: None,
        )
        assert result["shards_done"] == 6
        assert len(result["nodes"]) == 2, result["nodes"]
        assert completed_shards(tmp_path / "out", TABLES) == set(range(6))
        seqs = read_table(tmp_path / "out", "sequences")
        assert sorted(seqs.column("seq_id").to_pylist()) == sorted(p.prompt_id for p in prompts)
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_rerun_with_other_parameters_is_refused(checkpoints, tmp_path):
    from pipeline.data.shards import check_manifest

    cfg = _config(checkpoints, tmp_path)
    check_manifest(tmp_path, cfg.manifest("a.jsonl", None, 1))
    with pytest.raises(ManifestMismatchError, match="lmax: 3 -> 5"):
        other = ExtractConfig(**{**cfg.__dict__, "lmax": 5})
        check_manifest(tmp_path, other.manifest("a.jsonl", None, 1))


def _extract_cmd(checkpoints, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "jobs.extract", "--source", str(FIXTURE), "--limit", "6",
        "--target", str(checkpoints.target), "--draft", str(checkpoints.draft),
        "--out", str(out), "--lmax", "3", "--max-new-tokens", "6", "--shard-size", "1",
        "--num-cpus", "2", "--tail-mode", "paper",
    ]  # fmt: skip


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return env


@pytest.mark.slow
def test_killed_run_resumes_to_exactly_the_uninterrupted_rows(checkpoints, tmp_path):
    env = _env(tmp_path)
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    subprocess.run(_extract_cmd(checkpoints, full), env=env, check=True, timeout=600,
                   capture_output=True)  # fmt: skip

    proc = subprocess.Popen(
        _extract_cmd(checkpoints, resumed), env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.time() + 300
    while time.time() < deadline and not completed_shards(resumed, TABLES):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = completed_shards(resumed, TABLES)
    assert partial and len(partial) < 6, partial

    done = subprocess.run(_extract_cmd(checkpoints, resumed), env=env, timeout=600,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    resumed_from = int(re.search(r"(\d+) already complete", done.stdout).group(1))
    # Workers of the killed run may still finish a shard after the kill; never all of them.
    assert len(partial) <= resumed_from < 6
    keys = {"sequences": ["seq_id"], "tokens": ["seq_id", "t"],
            "tails": ["seq_id", "i", "k", "a", "r"]}  # fmt: skip
    for name in TABLES:
        a = _sorted(read_table(full, name), keys[name])
        b = _sorted(read_table(resumed, name), keys[name])
        assert a.num_rows == b.num_rows and a.equals(b), name
