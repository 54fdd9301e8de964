"""`serve run` as a user runs it, stopped the way a user stops it: SIGINT while the worst request
the step limits allow is generating. The process (its own local Ray cluster, the proxy and
the replica) must exit within the deployment's shutdown budget: Serve drains the request,
which ends by its deadline, and the replica's decoding thread never holds the process open.
Once, a ThreadPoolExecutor's exit join kept a replica alive until its generation finished."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from pipeline.models.loading import REPO_ROOT
from tests.serving_support import held_port, wait_healthy

pytestmark = pytest.mark.slow
# serve run is started through this, as from a user's shell: SIGINT at its default. A child
# inherits an ignored signal, and in full suite runs serve run has let SIGINT pass unheeded
# (its request ran to its deadline, nothing logged after it). (An exec, not preexec_fn: that
# is unsafe in a process with threads.)
DEFAULT_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)

REQUEST_TIMEOUT_S = 10.0
SHUTDOWN_TIMEOUT_S = 5.0
WORST = {
    "prompt": "class Stack:\n    def push(self, item):\n        ",
    "max_tokens": 1024,
    "temperature": 0,
    "speculation": {"policy": "tree", "depth": 52, "branch": 2, "gamma": 64},
}


def test_sigint_stops_serve_run_within_the_shutdown_budget(tmp_path: Path):
    serve_bin = Path(sys.executable).with_name("serve")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own cluster
    # ... and its own Ray temp dir: with none given, ray.init() joins whatever cluster
    # /tmp/ray/ray_current_cluster names (one another test's `ray start` may have left).
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="sr", dir="/tmp")
    with held_port() as port:
        config = {
            "http_options": {"host": "127.0.0.1", "port": port},
            "applications": [
                {
                    "name": "specbound",
                    "route_prefix": "/",
                    "import_path": "serving.app:build_app",
                    "args": {
                        "device": "cpu",
                        "num_gpus": 0,
                        "num_cpus": 1,
                        "request_timeout_s": REQUEST_TIMEOUT_S,
                        "shutdown_timeout_s": SHUTDOWN_TIMEOUT_S,
                    },
                }
            ],
        }
        path = tmp_path / "serve_config.yaml"
        path.write_text(yaml.safe_dump(config))
        # Its output goes to a file, shown when the budget is missed.
        log = tmp_path / "serve_run.log"
        with log.open("w") as out:  # (the child keeps its own copy of the descriptor)
            proc = subprocess.Popen(
                [sys.executable, "-c", DEFAULT_SIGINT, str(serve_bin), "run", str(path)],
                cwd=REPO_ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        base = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(base, 300)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    try:
        outcome: list = []
        worker = threading.Thread(target=lambda: outcome.append(_post(base)), daemon=True)
        worker.start()
        started = time.monotonic()
        while httpx.get(f"{base}/healthz", timeout=30).json()["in_flight"] < 1:
            assert time.monotonic() - started < 60, "the request never started"
            time.sleep(0.1)
        interrupted = time.monotonic()
        proc.send_signal(signal.SIGINT)
        budget = REQUEST_TIMEOUT_S + SHUTDOWN_TIMEOUT_S + 30  # drain, cancel, Ray's own exit
        try:
            proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            tail = log.read_text(errors="replace")[-6000:]
            here = signal.getsignal(signal.SIGINT)
            pytest.fail(
                f"serve run still running {budget:g} s after SIGINT (SIGINT in this process: "
                f"{here}); its output:\n{tail}"
            )
        took = time.monotonic() - interrupted
        worker.join(30)
        print(
            f"\nserve run exited {took:.1f} s after SIGINT with a generation running "
            f"(request: {outcome[0] if outcome else 'no answer'})"
        )
        assert took < budget
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _post(base: str) -> str:
    """What the client saw: the finish reason, or the transport error."""
    try:
        r = httpx.post(f"{base}/v1/completions", json=WORST, timeout=120)
        return (
            f"{r.status_code} {r.json()['choices'][0]['finish_reason']}"
            if r.is_success
            else f"{r.status_code}"
        )
    except httpx.HTTPError as exc:
        return type(exc).__name__
