"""Run the vLLM app in a Ray cluster of its own until told to stop (the project's harnesses
start it this way, from the project's environment, in the vLLM environment's interpreter).

    python -m vllm_serving.run --port 8001 --num-cpus 4 --args '{"speculation": "ours"}'

Prints ``READY <url>`` once /healthz answers and every model id is listed, then serves until
stdin closes or SIGTERM/SIGINT arrives, and shuts Serve and Ray down.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time

from vllm_serving.placement import engine_demand, shortfall

APP = "specbound-vllm"


def _wait_ready(url: str, app: str, deadline_s: float) -> None:
    """Until Serve reports the app running (every engine replica up) and /healthz answers."""
    import httpx
    from ray import serve

    ends = time.monotonic() + deadline_s
    while time.monotonic() < ends:
        status = serve.status().applications.get(app)
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"the vLLM app failed to deploy: {status.message}")
        if status is not None and status.status == "RUNNING":
            try:
                if httpx.get(f"{url}/healthz", timeout=10, trust_env=False).status_code == 200:
                    return
            except httpx.TransportError:
                pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready {deadline_s:.0f} s after deploying")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m vllm_serving.run", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--port", type=int, required=True, help="Serve's HTTP port on the loopback")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs of the local Ray cluster")
    p.add_argument("--args", default="{}", help="the app's settings, a JSON object (VllmAppArgs)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="the Ray node's Prometheus port (GET /metrics: vLLM's and Serve's metrics)",
    )
    opts = p.parse_args(argv)

    import ray
    from ray import serve

    from vllm_serving.app import build_app
    from vllm_serving.llm_configs import llm_config_dicts
    from vllm_serving.settings import VllmAppArgs

    settings = json.loads(opts.args)
    checked = VllmAppArgs.model_validate(settings)
    configs = llm_config_dicts(checked)  # bad settings and artifacts fail here, before Ray
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    ray.init(
        address="local",
        num_cpus=opts.num_cpus,
        include_dashboard=False,
        _metrics_export_port=opts.metrics_port,
    )
    try:
        if problem := shortfall(engine_demand(configs), ray.cluster_resources()):
            raise RuntimeError(f"the vLLM app cannot place its replicas: {problem}")
        serve.start(http_options={"host": "127.0.0.1", "port": opts.port})
        # Not waiting inside serve.run: a replica that can never be placed would hang it.
        serve._run(build_app(settings), name=APP, route_prefix="/", _blocking=False)
        url = f"http://127.0.0.1:{opts.port}"
        _wait_ready(url, APP, opts.ready_timeout)
        print(f"READY {url}", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
