"""Jobs submitted with `ray job submit` to a local head started with `ray start --head`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline.cost.model import CostModel
from pipeline.models.loading import REPO_ROOT
from tests.test_extract_pipeline import FIXTURE

BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    env.pop("MLFLOW_TRACKING_URI", None)
    # Where ~/.ray/auth_token exists the head enables token auth and clients must opt in.
    if (Path.home() / ".ray" / "auth_token").exists():
        env["RAY_AUTH_MODE"] = "token"
    return env


def _ray(args: list[str], env, timeout=300, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(BIN / "ray"), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def _submit_and_wait(address: str, job_id: str, entrypoint: list[str], env, runtime_env) -> None:
    _ray(["job", "submit", "--address", address, "--submission-id", job_id, "--no-wait",
          "--working-dir", str(REPO_ROOT), "--runtime-env-json", json.dumps(runtime_env),
          "--", *entrypoint], env)  # fmt: skip
    deadline = time.time() + 600
    status = ""
    while time.time() < deadline:
        proc = _ray(["job", "status", "--address", address, job_id], env)
        status = (proc.stdout + proc.stderr).lower()  # "Job 'x' succeeded", "... failed"
        if any(word in status for word in ("succeeded", "failed", "stopped")):
            break
        time.sleep(2)
    if "succeeded" not in status:
        logs = _ray(["job", "logs", "--address", address, job_id], env, check=False)
        pytest.fail(f"job {job_id}: {status}\n{logs.stdout[-3000:]}{logs.stderr[-2000:]}")


@pytest.mark.slow
def test_extract_and_oracle_as_ray_jobs(checkpoints, tmp_path):
    env = _env(tmp_path)
    port, dash = _free_port(), _free_port()
    head = f"--head --port {port} --dashboard-port {dash} --num-cpus 2 --include-dashboard true"
    # --block keeps `ray start` in the foreground: stopping its process group stops this head
    # alone, not other Ray clusters on the machine (as `ray stop` would).
    head_proc = subprocess.Popen(
        [str(BIN / "ray"), "start", *head.split(), "--disable-usage-stats", "--block"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.time() + 120
        while _ray(["job", "list", "--address", address], env, check=False).returncode:
            assert time.time() < deadline and head_proc.poll() is None, "the head did not start"
            time.sleep(2)
        db = tmp_path / "mlflow.db"
        runtime_env = {"env_vars": {"MLFLOW_TRACKING_URI": f"sqlite:///{db}"}}
        extract_dir, oracle_dir = tmp_path / "extract", tmp_path / "oracle"
        models = ["--target", str(checkpoints.target), "--draft", str(checkpoints.draft)]
        _submit_and_wait(address, f"extract-{port}", [
            "python", "-m", "jobs.extract", "--source", str(FIXTURE), "--limit", "2",
            "--lmax", "3", "--max-new-tokens", "6", "--shard-size", "1",
            "--out", str(extract_dir), *models,
        ], env, runtime_env)  # fmt: skip
        assert len(list((extract_dir / "tails").glob("shard-*.parquet"))) == 2
        costmodel = tmp_path / "costmodel.json"
        CostModel({m: 4.0 + 0.3 * m for m in range(1, 5)}, {m: 0.1 for m in range(1, 5)},
                   0.001, 0.3, 0.05).save(costmodel)  # fmt: skip
        _submit_and_wait(address, f"oracle-{port}", [
            "python", "-m", "jobs.oracle", "--extract", str(extract_dir), "--costmodel",
            str(costmodel), "--target", str(checkpoints.target), "--out", str(oracle_dir),
        ], env, runtime_env)  # fmt: skip
        assert (oracle_dir / "decisions.parquet").is_file()
        assert json.loads((oracle_dir / "policy.json").read_text())["lmax"] == 3
        client = MlflowClient(f"sqlite:///{db}")
        for name in ("extract", "oracle"):
            exp = client.get_experiment_by_name(name)
            assert exp is not None, name
            assert client.search_runs([exp.experiment_id])[0].info.status == "FINISHED"
    finally:
        os.killpg(head_proc.pid, signal.SIGTERM)
        try:
            head_proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head_proc.pid, signal.SIGKILL)
        # `ray start` records its address for later clients; drop the record of this head.
        record = Path("/tmp/ray/ray_current_cluster")
        if record.exists() and record.read_text().strip().endswith(f":{port}"):
            record.unlink()
