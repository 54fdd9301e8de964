"""Scenarios for tests/test_vllm_health.py, run in the vLLM environment on a 1-CPU Ray cluster
of their own: python tests/vllm_health_scenarios.py OUT.json.

1. vllm_serve_config.yaml's args with two engines (one too many for one CPU) given to the app
   builder (what `serve run CONFIG` has Serve's controller call): it refuses.
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

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    result: dict = {}
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        # 1. The builder (what `serve run CONFIG` has Serve's controller call, and retry
        # three times before DEPLOY_FAILED) given the config file's args with two engines,
        # on this cluster: it refuses with the shortfall.
        from vllm_serving.app import build_app

        with open(os.path.join(ROOT, "vllm_serve_config.yaml")) as f:
            config = yaml.safe_load(f)
        args = dict(config["applications"][0]["args"], models=TWO)
        try:
            build_app(args)
            result["config_with_one_engine_too_many"] = "built"
        except RuntimeError as exc:
            result["config_with_one_engine_too_many"] = str(exc)
        print("refused:", result["config_with_one_engine_too_many"], flush=True)
        serve.start(http_options={"host": "127.0.0.1", "port": port})

        # 2. The same two engines deployed anyway.
        import vllm_serving.placement as placement

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
