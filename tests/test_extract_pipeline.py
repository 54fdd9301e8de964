"""The extraction pipeline on real Ray clusters: sharding over nodes, resuming after a kill."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pytest
import ray
from ray.cluster_utils import Cluster

from pipeline.data.prompts import load_jsonl
from pipeline.data.shards import (
    ManifestMismatchError,
    completed_shards,
    read_table,
    shard_name,
)
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
    context = ray.data.DataContext.get_current()
    wait_before = context.wait_for_min_actors_s
    # Both 1-CPU actors land on different nodes; waiting until both are up before the first
    # shard is dispatched makes each get one, instead of the first ready taking them all.
    context.wait_for_min_actors_s = 300
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
        # No Ray Data thread that outlives the cluster: its usage poller, polling after
        # ray.shutdown(), made Ray exit this whole test process later in the suite.
        assert "data-usage-metrics-poller" not in {t.name for t in threading.enumerate()}
    finally:
        context.wait_for_min_actors_s = wait_before
        ray.shutdown()
        cluster.shutdown()


def test_rerun_with_other_parameters_is_refused(checkpoints, tmp_path):
    from pipeline.data.shards import check_manifest

    cfg = _config(checkpoints, tmp_path)
    check_manifest(tmp_path, cfg.manifest("a.jsonl", None, 1))
    check_manifest(tmp_path, cfg.manifest("a.jsonl", None, 1))  # the same run, read back
    changes = {
        "lmax": (5, "lmax: 3 -> 5"),
        "acceptances": (("greedy",), "acceptances: \\['surrogate', 'greedy', 'sampling'\\]"),
        "draws": (1, "draws: 2 -> 1"),
        "temperature": (0.5, "temperature: 1.0 -> 0.5"),
    }
    for field, (value, message) in changes.items():
        with pytest.raises(ManifestMismatchError, match=message):
            other = ExtractConfig(**{**cfg.__dict__, field: value})
            check_manifest(tmp_path, other.manifest("a.jsonl", None, 1))


def _extract_cmd(checkpoints, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jobs.extract",
        "--source",
        str(FIXTURE),
        "--limit",
        "6",
        "--target",
        str(checkpoints.target),
        "--draft",
        str(checkpoints.draft),
        "--out",
        str(out),
        "--lmax",
        "3",
        "--max-new-tokens",
        "6",
        "--shard-size",
        "1",
        "--num-cpus",
        "2",
        "--tail-mode",
        "paper",
        "--trees",
        "eagle2",
        "--tree-budget",
        "2",
    ]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return env


def _processes_with(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker`` (a run's driver, Ray daemons and
    workers inherit it, whatever process group they put themselves in)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker.encode() in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
    return pids


def _kill_run(proc: subprocess.Popen, marker: str) -> None:
    """SIGKILL a run and every process it started, and return only once all are gone, so that
    nothing of it can write a shard afterwards."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 120
    while pids := _processes_with(marker):
        assert time.time() < deadline, f"processes of the killed run survive: {pids}"
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def _assert_same_rows(full: Path, resumed: Path) -> None:
    keys = {
        "sequences": ["seq_id"],
        "tokens": ["seq_id", "t"],
        "tails": ["seq_id", "acceptance", "draw", "i", "k", "a", "r"],
        "trees": ["seq_id", "rule", "i", "j"],
    }
    for name in TABLES:
        a = _sorted(read_table(full, name), keys[name])
        b = _sorted(read_table(resumed, name), keys[name])
        assert a.num_rows == b.num_rows and a.equals(b), name
        assert a.num_rows > 0, name


@pytest.mark.slow
def test_killed_run_resumes_to_exactly_the_uninterrupted_rows(checkpoints, tmp_path):
    """A kill loses no completed shard, and a rerun redoes exactly the missing ones and ends
    with the rows of an uninterrupted run. What the kill catches is up to the machine's timing
    (no shard, some, or all of them), so nothing below depends on it; on top of the kill, one
    shard loses a table (as a kill between two writes leaves it) and one shard all of them, so
    every run of this test resumes something."""
    env = _env(tmp_path)
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    subprocess.run(
        _extract_cmd(checkpoints, full), env=env, check=True, timeout=600, capture_output=True
    )

    marker = f"SPECBOUND_KILLED_RUN={uuid.uuid4().hex}"
    killed_env = {**env, marker.split("=")[0]: marker.split("=")[1]}
    proc = subprocess.Popen(
        _extract_cmd(checkpoints, resumed),
        env=killed_env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline and not completed_shards(resumed, TABLES):
        time.sleep(0.2)
    _kill_run(proc, marker)
    for shard, tables in ((2, ("tails",)), (4, TABLES)):
        for name in tables:
            (resumed / name / shard_name(shard)).unlink(missing_ok=True)
    complete = completed_shards(resumed, TABLES)
    assert complete <= set(range(6)) - {2, 4}

    done = subprocess.run(
        _extract_cmd(checkpoints, resumed), env=env, timeout=600, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    counts = re.search(r"(\d+) shards, (\d+) already complete, (\d+) to do", done.stdout)
    assert counts, done.stdout[-2000:]
    assert tuple(map(int, counts.groups())) == (6, len(complete), 6 - len(complete))
    assert completed_shards(resumed, TABLES) == set(range(6))
    _assert_same_rows(full, resumed)


def test_batch_size_is_recorded_and_validated(checkpoints, tmp_path):
    from jobs.extract import parse_args
    from pipeline.data.shards import check_manifest

    cfg = _config(checkpoints, tmp_path)
    assert cfg.batch_size == 16 and cfg.manifest("a.jsonl", None, 1)["batch_size"] == 16
    check_manifest(tmp_path, cfg.manifest("a.jsonl", None, 1))
    other = ExtractConfig(**{**cfg.__dict__, "batch_size": 1})
    with pytest.raises(ManifestMismatchError, match="batch_size: 16 -> 1"):
        check_manifest(tmp_path, other.manifest("a.jsonl", None, 1))
    bad = ExtractConfig(**{**cfg.__dict__, "batch_size": 0, "out": str(tmp_path / "bad")})
    with pytest.raises(ValueError, match="batch size"):
        run_extraction(bad, [], "a.jsonl", None, log=lambda *_: None)
    assert parse_args(["--batch-size", "4"]).batch_size == 4
    with pytest.raises(SystemExit):
        parse_args(["--batch-size", "0"])


@pytest.mark.slow
def test_batched_actors_write_the_rows_of_one_at_a_time(checkpoints, tmp_path):
    """Through the Ray actors: shards of 3 prompts extracted 3 at a time give the rows of one
    at a time (probabilities to float rounding; tests/test_batched_extraction.py holds the
    near-tie analysis of the batched rows themselves)."""
    import numpy as np

    prompts = load_jsonl(FIXTURE, limit=6)
    out = {}
    ray.init(num_cpus=2)
    try:
        for batch_size in (1, 3):
            out[batch_size] = tmp_path / f"b{batch_size}"
            cfg = _config(
                checkpoints,
                out[batch_size],
                batch_size=batch_size,
                threads=1,
                trees=("eagle2-b2",),
                tree_budget=2,
            )
            result = run_extraction(
                cfg, prompts, str(FIXTURE), 6, shard_size=3, actors=1, log=lambda *_: None
            )
            assert result["shards_done"] == 2
    finally:
        ray.shutdown()
    keys = {
        "sequences": ["seq_id"],
        "tokens": ["seq_id", "t"],
        "tails": ["seq_id", "acceptance", "draw", "s", "r"],
        "trees": ["seq_id", "rule", "i", "j"],
    }
    probs = ("draft_prob", "target_prob", "path_prob")
    for name in TABLES:
        a = _sorted(read_table(out[1], name), keys[name])
        b = _sorted(read_table(out[3], name), keys[name])
        same = [c for c in a.column_names if c not in probs]
        assert a.select(same).equals(b.select(same)), name
        for column in set(probs) & set(a.column_names):
            x, y = (np.array(t.column(column).to_pylist(), dtype=float) for t in (a, b))
            np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6, equal_nan=True)
