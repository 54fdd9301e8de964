"""The serving benchmark's harness (jobs.bench_serve): the in-process engine generating the
prompts one after another against the Ray Serve endpoint with concurrent HTTP clients."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pipeline.data.prompts import encode
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.types import SamplingConfig
from pipeline.models.loading import ModelPair, load_pair


@dataclass(frozen=True)
class ServeBenchSettings:
    """What both sides share: models, the request's speculation field, sampling, budget."""

    target: str
    draft: str
    device: str
    dtype: str
    experts_implementation: str
    speculation: dict[str, Any]  # {"policy": name, **knobs}
    max_tokens: int
    temperature: float
    concurrency: int  # HTTP clients on the endpoint side
    replica_cpus: float  # CPUs per replica; also the in-process torch threads on CPU
    max_batch: int = 16  # the replica's batch (serving.settings.AppArgs.max_batch)


@dataclass(frozen=True)
class Side:
    label: str
    latencies: list[float]  # seconds per request
    tokens: int
    seconds: float  # wall time of the whole side
    errors: int
    texts: list[str | None]

    @property
    def requests_per_s(self) -> float:
        return len(self.latencies) / self.seconds

    def row(self) -> str:
        p50, p99 = (np.percentile(self.latencies, q) * 1e3 for q in (50, 99))
        tok_s = self.tokens / self.seconds
        return (
            f"{self.label:<28}{len(self.latencies):>9}{self.requests_per_s:>8.2f}"
            f"{tok_s:>9.1f}{p50:>9.0f}{p99:>9.0f}{self.errors:>8}"
        )


@dataclass(frozen=True)
class ServeBenchResult:
    settings: ServeBenchSettings
    url: str
    local: Side
    remote: Side

    @property
    def ratio(self) -> float:
        """Throughput (requests/s), endpoint over in-process."""
        return self.remote.requests_per_s / self.local.requests_per_s

    def metrics(self) -> dict[str, float]:
        lat = self.remote.latencies
        return {
            "local_req_s": self.local.requests_per_s,
            "endpoint_req_s": self.remote.requests_per_s,
            "ratio": self.ratio,
            "endpoint_errors": self.remote.errors,
            "endpoint_p50_ms": float(np.percentile(lat, 50) * 1e3),
            "endpoint_p99_ms": float(np.percentile(lat, 99) * 1e3),
        }


def bench_in_process(pair: ModelPair, texts: list[str], settings: ServeBenchSettings) -> Side:
    """The engine in this process, one prompt after another (tokenizing included)."""
    engine = SpeculativeEngine(pair)
    sampling = SamplingConfig(settings.temperature)
    spec = settings.speculation
    knobs = {k: v for k, v in spec.items() if k != "policy"}

    def one(seed: int, text: str):
        ids = encode(pair.tokenizer, text)
        return engine.generate(
            ids, make_policy(spec["policy"], **knobs), settings.max_tokens, sampling, seed=seed
        )

    one(0, texts[0])  # warm-up
    latencies, outputs = [], []
    started = time.perf_counter()
    for seed, text in enumerate(texts):
        t0 = time.perf_counter()
        outputs.append(one(seed, text))
        latencies.append(time.perf_counter() - t0)
    seconds = time.perf_counter() - started
    return Side(
        "in-process (sequential)",
        latencies,
        sum(len(g.tokens) for g in outputs),
        seconds,
        0,
        [g.text for g in outputs],
    )


def bench_endpoint(url: str, texts: list[str], settings: ServeBenchSettings) -> Side:
    """C client threads posting the prompts (each once) to /v1/completions."""
    import httpx

    def body(seed: int, text: str) -> dict:
        return {
            "prompt": text,
            "max_tokens": settings.max_tokens,
            "temperature": settings.temperature,
            "seed": seed,
            "speculation": settings.speculation,
        }

    def one(item: tuple[int, str]) -> tuple[float, dict | None]:
        t0 = time.perf_counter()
        try:
            r = httpx.post(f"{url}/v1/completions", json=body(*item), timeout=600)
            out = r.json() if r.status_code == 200 else None
            if out is None:
                print(f"request {item[0]}: HTTP {r.status_code} {r.text[:200]}")
        except httpx.HTTPError as exc:
            print(f"request {item[0]}: {type(exc).__name__}: {exc}")
            out = None
        return time.perf_counter() - t0, out

    one((0, texts[0]))  # warm-up
    started = time.perf_counter()
    with ThreadPoolExecutor(settings.concurrency) as pool:
        results = list(pool.map(one, enumerate(texts)))
    seconds = time.perf_counter() - started
    outs = [out for _, out in results]
    tokens = sum(o["usage"]["completion_tokens"] for o in outs if o)
    return Side(
        f"endpoint ({settings.concurrency} clients)",
        [t for t, _ in results],
        tokens,
        seconds,
        sum(o is None for o in outs),
        [o["choices"][0]["text"] if o else None for o in outs],
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_on_loopback() -> str:
    """Serve's proxy on a free port of the loopback in the connected Ray cluster; its URL."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


def app_args(
    target: str,
    draft: str,
    device: str,
    dtype: str,
    experts_implementation: str,
    replica_cpus: float,
    max_tokens: int,
    **extra: Any,
) -> dict[str, Any]:
    """``build_app`` arguments for a benchmark replica of these models (``extra``: any other
    ``serving.settings.AppArgs`` field)."""
    return {
        "target": target,
        "draft": draft,
        "device": device,
        "dtype": dtype,
        "experts_implementation": experts_implementation,
        "num_cpus": replica_cpus,
        "num_gpus": 1 if torch.cuda.is_available() else 0,
        "max_tokens_limit": max(1024, max_tokens),
        **extra,
    }


def deploy(
    args: dict[str, Any], name: str, url: str, deadline_s: float = 300.0, route_prefix: str = "/"
) -> None:
    """Run the app on Serve at ``route_prefix`` and wait until it answers /healthz there:
    serve.run returns when the deployment is up, which may be before the proxy routes to it."""
    import httpx
    from ray import serve

    from serving.app import build_app

    serve.run(build_app(args), name=name, route_prefix=route_prefix, blocking=False)
    health, deadline = f"{url}{route_prefix.rstrip('/')}/healthz", time.monotonic() + deadline_s
    while True:
        try:
            r = httpx.get(health, timeout=30, trust_env=False)
            if r.status_code == 200 and r.json().get("status") == "ok":
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{health} not healthy {deadline_s:.0f} s after deploying {name}")
        time.sleep(0.5)


def start_endpoint(settings: ServeBenchSettings) -> str:
    """Serve on a free local port in the connected Ray cluster; returns its URL."""
    url = serve_on_loopback()
    deploy(
        app_args(
            settings.target,
            settings.draft,
            settings.device,
            settings.dtype,
            settings.experts_implementation,
            settings.replica_cpus,
            settings.max_tokens,
            max_batch=settings.max_batch,
        ),
        "bench-serve",
        url,
    )
    return url


def run_serve_bench(
    texts: list[str],
    settings: ServeBenchSettings,
    url: str | None,
    ray_session: Callable[[], AbstractContextManager[Any]],
) -> ServeBenchResult:
    """The in-process side first (its model pair is freed before the endpoint starts), then the
    endpoint at ``url``, or, without one, an endpoint started here inside ``ray_session()``."""
    pair = load_pair(
        settings.target,
        settings.draft,
        settings.device,
        settings.dtype,
        settings.experts_implementation,
    )
    if pair.device.type == "cpu":
        torch.set_num_threads(max(1, int(settings.replica_cpus)))  # as many threads as a replica
    local = bench_in_process(pair, texts, settings)
    del pair
    if url is not None:
        url = url.rstrip("/")
        return ServeBenchResult(settings, url, local, bench_endpoint(url, texts, settings))
    from ray import serve

    with ray_session():
        url = start_endpoint(settings)
        try:
            remote = bench_endpoint(url, texts, settings)
        finally:
            serve.shutdown()
    return ServeBenchResult(settings, url, local, remote)


def format_serve_bench(result: ServeBenchResult, source: str) -> str:
    """A row per side, the throughput ratio and, at T=0, the prompts with identical text."""
    s, local, remote = result.settings, result.local, result.remote
    lines = [
        "",
        f"{len(local.texts)} {source} prompts x {s.max_tokens} tokens, "
        f"T={s.temperature:g}, speculation {json.dumps(s.speculation)}, "
        f"endpoint {result.url}",
        "",
    ]
    lines.append(
        f"{'':<28}{'requests':>9}{'req/s':>8}{'tok/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}"
    )
    lines += [
        local.row(),
        remote.row(),
        "",
        f"throughput, endpoint / in-process: {result.ratio:.2f}x",
    ]
    if s.temperature == 0:
        same = sum(a == b for a, b in zip(local.texts, remote.texts, strict=True))
        lines.append(f"identical greedy text: {same}/{len(local.texts)} prompts")
    return "\n".join(lines)
