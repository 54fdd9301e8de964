"""The vLLM app (vllm_serving) started from the project's environment: it runs in the vLLM
environment's interpreter, in a Ray cluster of its own, on a free loopback port; the harness
talks to it over HTTP only, like any client."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.bench.serve import free_port
from pipeline.vllm_spec.env import ROOT, engine_env, vllm_python

BIND_ATTEMPTS = 3
BIND_FAILURE = "Failed to bind to address"  # Serve's proxy, when its port was taken


@dataclass
class RunningApp:
    url: str
    process: subprocess.Popen
    log: Path


@contextmanager
def vllm_app(
    settings: dict[str, Any],
    num_cpus: float | None = None,
    log: Path | None = None,
    ready_timeout_s: float = 600.0,
    metrics_port: int | None = None,
) -> Iterator[RunningApp]:
    """The app with ``settings`` (vllm_serving.settings.VllmAppArgs) until the block ends;
    ``metrics_port``: its Ray node's Prometheus endpoint (http://127.0.0.1:PORT/metrics)."""
    # A free port is free when asked, not when Serve's proxy binds it: the cluster's own
    # processes take ports from the same ephemeral range meanwhile. A start that lost that
    # race is retried on another port.
    for attempt in range(1, BIND_ATTEMPTS + 1):
        port = free_port()
        cmd = [str(vllm_python()), "-m", "vllm_serving.run", "--port", str(port)]
        cmd += ["--args", json.dumps(settings), "--ready-timeout", str(ready_timeout_s)]
        if num_cpus is not None:
            cmd += ["--num-cpus", str(num_cpus)]
        if metrics_port is not None:
            cmd += ["--metrics-port", str(metrics_port)]
        env = engine_env()
        env.pop("RAY_ADDRESS", None)  # its own cluster, never the caller's
        path = log or Path(f"/tmp/specbound-vllm-app-{port}.log")
        with path.open("w") as sink:
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=sink,
                text=True,
            )
        try:
            url = _wait_for_ready(proc, path, ready_timeout_s + 60)
        except RuntimeError:
            lost_race = BIND_FAILURE in path.read_text(errors="replace")
            if lost_race and attempt < BIND_ATTEMPTS:
                continue
            raise
        break
    # Keep draining its stdout so it never blocks on a full pipe.
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    try:
        yield RunningApp(url, proc, path)
    finally:
        _stop(proc)


def _wait_for_ready(proc: subprocess.Popen, log: Path, timeout_s: float) -> str:
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            if line.startswith("READY "):
                found.append(line.split()[1])
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not found:
        _stop(proc)
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"the vLLM app did not start (log {log}):\n{tail}")
    return found[0]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            proc.stdin.close()  # the app shuts Serve and Ray down
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
