"""Scenarios for tests/test_vllm_health.py, run in the vLLM environment on a 1-CPU Ray cluster
of their own: python tests/vllm_health_scenarios.py OUT.json.

1. vllm_serve_config.yaml with two engines (one too many for one CPU) deployed the way
   `serve run CONFIG` deploys a config file: the controller calls the builder, which refuses.
2. The same two engines deployed anyway (the check switched off in this process): the ingress
   reports one model not placeable while the other starts and then runs, and a request for the
   unplaced one gets its 503 at once."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
APP = "specbound-vllm"
TWO = [{"name": "plain-a", "speculation": "none"}, {"name": "plain-b", "speculation": "none"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(what: str, until, timeout_s: float, every_s: float = 0.5):
    ends = time.monotonic() + timeout_s
    while time.monotonic() < ends:
        if (got := until()) is not None:
            return got
        time.sleep(every_s)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


def main(out: str) -> None:
    import httpx
    import ray
    from ray import serve
    from ray.serve._private import api as private_api
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    result: dict = {}
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        # 1. A config file, deployed as `serve run CONFIG` does (scripts.py: serve_start with
        # the file's options, then deploy_apps): the builder runs in the cluster and refuses.
        with open(os.path.join(ROOT, "vllm_serve_config.yaml")) as f:
            config = yaml.safe_load(f)
        config["http_options"]["port"] = port
        config["applications"][0]["args"]["models"] = TWO
        schema = ServeDeploySchema.model_validate(config)
        client = private_api.serve_start(
            http_options=schema.http_options.model_dump(),
            proxy_location=schema.proxy_location,
            grpc_options=gRPCOptions(**schema.grpc_options.model_dump()),
        )
        client.deploy_apps(schema, _blocking=False)

        def failed():
            status = serve.status().applications.get(APP)
            if status is not None and status.status in ("DEPLOY_FAILED", "RUNNING"):
                return {"status": str(status.status.value), "message": status.message}
            return None

        result["config_with_one_engine_too_many"] = wait("the config's build", failed, 300)
        print("refused:", result["config_with_one_engine_too_many"], flush=True)
        serve.delete(APP)

        # 2. The same two engines deployed anyway.
        import vllm_serving.placement as placement
        from vllm_serving.app import build_app

        placement.cluster_capacity = lambda: None
        serve._run(
            build_app({"models": TWO, "request_timeout_s": 60}),
            name=APP,
            route_prefix="/",
            _blocking=False,
        )
        http = httpx.Client(base_url=url, timeout=30, trust_env=False)

        def healthz():
            try:
                r = http.get("/healthz")
            except httpx.TransportError:
                return None
            if r.headers.get("content-type", "").startswith("application/json"):
                return {"status_code": r.status_code, "body": r.json()}
            return None

        def one_unplaced():
            h = healthz()
            if h is None or "models" not in h["body"]:
                return None
            states = {m: s["state"] for m, s in h["body"]["models"].items()}
            return h if "not_placeable" in states.values() else None

        h = wait("a model reported not placeable", one_unplaced, 300)
        result["healthz_while_one_is_unplaced"] = h
        print("healthz:", json.dumps(h), flush=True)
        models = h["body"]["models"]
        unplaced = next(m for m, s in models.items() if s["state"] == "not_placeable")
        placed = next(m for m in models if m != unplaced)
        result["placed"], result["unplaced"] = placed, unplaced

        def ask(model: str, max_tokens: int = 4) -> dict:
            start = time.monotonic()
            r = http.post(
                "/v1/completions",
                json={"model": model, "prompt": "def f(x):", "max_tokens": max_tokens},
            )
            took = time.monotonic() - start
            return {"status_code": r.status_code, "body": r.json(), "seconds": took}

        result["request_to_unplaced"] = ask(unplaced)
        if models[placed]["state"] == "starting":
            result["request_to_starting"] = ask(placed)

        def placed_runs():
            h = healthz()
            ok = h is not None and h["body"]["models"][placed]["state"] == "running"
            return h if ok else None

        wait("the placed engine running", placed_runs, 480, every_s=2)
        result["request_to_placed"] = ask(placed)
        result["healthz_after"] = healthz()
        result["models"] = http.get("/v1/models").json()
        print("after:", json.dumps(result["healthz_after"]), flush=True)
    finally:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
