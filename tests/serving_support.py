"""What the endpoint tests share: a port held until Serve's proxy binds it, waiting for a
healthy app, the in-process model pair on one torch thread, and plain greedy decoding as the
independent reference."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from pipeline.data.references import greedy_continuation
from pipeline.models.loading import load_pair


@contextmanager
def held_port() -> Iterator[int]:
    """A free port on 127.0.0.1, bound (not listening) until released. The Serve proxy binds
    with SO_REUSEADDR and SO_REUSEPORT, so it can share this bind; any other process binding
    without SO_REUSEPORT (every port-0 pick, every plain server) gets EADDRINUSE, so nothing
    takes the port between the pick and the proxy's bind."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def wait_healthy(base: str, deadline_s: float) -> None:
    """Poll /healthz until the app answers: serve.run returns when the deployment is up, which
    may be before the proxy routes to it. The deadline is a liveness bound only."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            r = httpx.get(f"{base}/healthz", timeout=30)
            if r.status_code == 200 and r.json().get("status") == "ok":
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{base} not healthy after {deadline_s}s"
        time.sleep(0.5)


@contextmanager
def one_thread_pair() -> Iterator:
    """The in-process reference, on one torch thread like a replica (num_cpus=1): with two,
    OpenMP spin-waits make it crawl whenever anything else runs on this 2-core machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield load_pair(device="cpu")
    finally:
        torch.set_num_threads(threads)


def ids(pair, text: str) -> list[int]:
    return pair.tokenizer(text, add_special_tokens=False)["input_ids"]


def plain_greedy(pair, text: str, n: int) -> tuple[list[int], str]:
    """The independent reference: plain greedy decoding with the target (a direct loop with a
    KV cache, no engine, no policy), stopped at EOS; its tokens and text."""
    tokens = greedy_continuation(pair.target, ids(pair, text), n, pair.tokenizer.eos_token_id)
    return tokens, pair.tokenizer.decode(tokens)


@contextmanager
def serve_apps(apps: list[tuple[str, str, dict]], init_ray) -> Iterator[str]:
    """A fresh local Ray cluster (``init_ray()`` starts it) with Serve on a free loopback port
    and each (name, route prefix, build_app args) app running and healthy; the base URL. On
    CPU even where a GPU exists: greedy text is compared with the fp32 CPU reference."""
    import ray
    from ray import serve

    from serving.app import build_app

    init_ray()
    try:
        with held_port() as port:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            base = f"http://127.0.0.1:{port}"
            for name, prefix, args in apps:
                app = build_app({"num_gpus": 0, "device": "cpu", **args})
                serve.run(app, name=name, route_prefix=prefix, blocking=False)
            for _, prefix, _ in apps:
                wait_healthy(base + prefix.rstrip("/"), 300)
        yield base
    finally:
        serve.shutdown()
        ray.shutdown()
