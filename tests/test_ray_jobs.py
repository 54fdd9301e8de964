"""Jobs submitted with `ray job submit` to a local head started with `ray start --head`.

Ports: every port the head would otherwise take at a fixed default (GCS 6379, dashboard 8265,
dashboard agent 52365, Ray Client 10001: any other Ray on this machine races for those) is
chosen here, free when chosen and outside the kernel's ephemeral range, so no port-0 bind or
outgoing connection elsewhere can take it before the head binds it. The dashboard address is
the one the head prints (the dashboard moves to the next port if its own is taken), so jobs
never go to another cluster's dashboard; a head that does not come up is retried with fresh
ports. Deadlines are liveness bounds only."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from pipeline.cost.model import CostModel
from pipeline.cost.provenance import checkpoint_fingerprint
from pipeline.models.loading import REPO_ROOT
from tests.test_extract_pipeline import FIXTURE

BIN = Path(sys.executable).parent


def _unused_ports(n: int) -> list[int]:
    """``n`` distinct ports free now, between Ray's worker ports (10002-19999) and the kernel's
    ephemeral range, where only a process that names its port explicitly can bind."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    ports: list[int] = []
    for port in random.sample(range(20000, max(ephemeral, 20000 + 64)), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError("no free ports between 20000 and the ephemeral range")


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    env.pop("MLFLOW_TRACKING_URI", None)
    # Where ~/.ray/auth_token exists the head enables token auth and clients must opt in.
    if (Path.home() / ".ray" / "auth_token").exists():
        env["RAY_AUTH_MODE"] = "token"
    return env


def _ray(args: list[str], env, timeout=300, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(BIN / "ray"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def _submit_and_wait(address: str, job_id: str, entrypoint: list[str], env, runtime_env) -> None:
    _ray(
        [
            "job",
            "submit",
            "--address",
            address,
            "--submission-id",
            job_id,
            "--no-wait",
            "--working-dir",
            str(REPO_ROOT),
            "--runtime-env-json",
            json.dumps(runtime_env),
            "--",
            *entrypoint,
        ],
        env,
    )
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


def _stop(proc: subprocess.Popen) -> None:
    """Stops the head's process group: SIGTERM, then SIGKILL after 5 s (its raylet takes about
    30 s to exit on SIGTERM, and nothing of this head is kept)."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def _start_head(env, tmp_path: Path, attempts: int = 3) -> tuple[subprocess.Popen, str, int]:
    """A head of our own: (its `ray start --block` process, its dashboard address as it
    printed it, its GCS port). A head that exits or prints no dashboard address (a chosen
    port taken after all) is stopped and started again on fresh ports."""
    why = ""
    for attempt in range(attempts):
        gcs, dash, agent, client = _unused_ports(4)
        head = (
            f"--head --port {gcs} --dashboard-port {dash} --dashboard-agent-listen-port "
            f"{agent} --ray-client-server-port {client} --num-cpus 2 "
            "--include-dashboard true --disable-usage-stats --block"
        )
        log = tmp_path / f"ray-head-{attempt}.log"
        # --block keeps `ray start` in the foreground: stopping its process group stops this
        # head alone, not other Ray clusters on the machine (as `ray stop` would).
        with log.open("w") as out:
            proc = subprocess.Popen(
                [str(BIN / "ray"), "start", *head.split()],
                env={**env, "PYTHONUNBUFFERED": "1"},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.time() + 180
        while proc.poll() is None and time.time() < deadline:
            found = re.search(r"RAY_API_SERVER_ADDRESS='(http://[^']+)'", log.read_text())
            if found:
                address = found.group(1)
                while time.time() < deadline and proc.poll() is None:
                    if not _ray(["job", "list", "--address", address], env, check=False).returncode:
                        return proc, address, gcs
                    time.sleep(2)
                break
            time.sleep(1)
        why = log.read_text()[-2000:]
        _stop(proc)
    pytest.fail(f"no Ray head came up in {attempts} attempts; the last said:\n{why}")


@pytest.mark.slow
def test_extract_and_oracle_as_ray_jobs(checkpoints, tmp_path):
    env = _env(tmp_path)
    head_proc, address, port = _start_head(env, tmp_path)
    try:
        db = tmp_path / "mlflow.db"
        runtime_env = {"env_vars": {"MLFLOW_TRACKING_URI": f"sqlite:///{db}"}}
        extract_dir, oracle_dir = tmp_path / "extract", tmp_path / "oracle"
        models = ["--target", str(checkpoints.target), "--draft", str(checkpoints.draft)]
        _submit_and_wait(
            address,
            f"extract-{port}",
            [
                "python",
                "-m",
                "jobs.extract",
                "--source",
                str(FIXTURE),
                "--limit",
                "2",
                "--lmax",
                "3",
                "--max-new-tokens",
                "6",
                "--shard-size",
                "1",
                "--trees",
                "eagle2",
                "--tree-budget",
                "3",
                "--out",
                str(extract_dir),
                *models,
            ],
            env,
            runtime_env,
        )
        assert len(list((extract_dir / "tails").glob("shard-*.parquet"))) == 2
        costmodel = tmp_path / "costmodel.json"
        # A synthetic model that says it was measured on the extraction's checkpoints (the
        # oracle refuses one that does not).
        measured_on = {
            "experts_implementation": "eager",
            "target_fingerprint": checkpoint_fingerprint(checkpoints.target),
            "draft_fingerprint": checkpoint_fingerprint(checkpoints.draft),
        }
        CostModel(
            {m: 4.0 + 0.3 * m for m in range(1, 5)},
            {m: 0.1 for m in range(1, 5)},
            0.001,
            0.3,
            0.05,
            meta=measured_on,
        ).save(costmodel)
        _submit_and_wait(
            address,
            f"oracle-{port}",
            [
                "python",
                "-m",
                "jobs.oracle",
                "--extract",
                str(extract_dir),
                "--costmodel",
                str(costmodel),
                "--target",
                str(checkpoints.target),
                "--out",
                str(oracle_dir),
            ],
            env,
            runtime_env,
        )
        assert (oracle_dir / "decisions.parquet").is_file()
        assert json.loads((oracle_dir / "policy.json").read_text())["lmax"] == 3
        trees = pd.read_csv(oracle_dir / "tree_bound.csv")
        assert set(trees["bound"]) == {"chain", "eagle2-b2", "chain-or-eagle2-b2"}
        client = MlflowClient(f"sqlite:///{db}")
        for name in ("extract", "oracle"):
            exp = client.get_experiment_by_name(name)
            assert exp is not None, name
            assert client.search_runs([exp.experiment_id])[0].info.status == "FINISHED"
    finally:
        _stop(head_proc)
        # `ray start` records its address for later clients; drop the record of this head.
        record = Path("/tmp/ray/ray_current_cluster")
        if record.exists() and record.read_text().strip().endswith(f":{port}"):
            record.unlink()
