"""Serving benchmark: the Ray Serve endpoint with C concurrent clients against the in-process
engine generating the same prompts one after another, in one run: requests/s, generated
tokens/s, p50/p99 request latency, and the endpoint / in-process throughput ratio. Same models,
policy, sampling and token budget on both sides; for greedy decoding it also counts the
prompts whose text is identical on both sides.

The in-process side runs first with as many torch threads as a replica gets CPUs
(--replica-cpus), then the script starts its own local Ray cluster and Serve app on a free port
(or uses a running endpoint given with --url: then the model arguments must match it).

    python -m jobs.bench_serve                                  # 16 HumanEval prompts, 8 clients
    python -m jobs.bench_serve --limit 32 --concurrency 16 --max-tokens 64
    python -m jobs.bench_serve --url http://127.0.0.1:8000 --speculation '{"policy": "tree"}'
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from jobs.cli import add_model_args, init_ray, parser, run
from pipeline.engine import SamplingConfig, SpeculativeEngine
from pipeline.models import load_pair
from pipeline.policies import make_policy
from pipeline.prompts import load_prompts
from pipeline.tracking import tracked_run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("jobs.bench_serve", __doc__)
    add_model_args(p, experts=False)
    p.add_argument("--source", default="humaneval", help="humaneval or a JSONL prompt file")
    p.add_argument("--limit", type=int, default=16, help="number of prompts")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens per request")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent HTTP clients")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--speculation", default='{"policy": "fixed", "k": 4}',
                   help="the request's speculation field as JSON: policy and knobs")  # fmt: skip
    p.add_argument("--url", default=None, help="a running endpoint (else one is started here)")
    p.add_argument("--replica-cpus", type=float, default=1.0,
                   help="CPUs per replica; also the in-process torch threads on CPU")  # fmt: skip
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray cluster")
    args = p.parse_args(argv)
    if args.limit < 1 or args.max_tokens < 1 or args.concurrency < 1:
        p.error("--limit, --max-tokens and --concurrency must be >= 1")
    try:
        spec = json.loads(args.speculation)
    except json.JSONDecodeError as exc:
        p.error(f"--speculation is not JSON: {exc}")
    if not isinstance(spec, dict) or "policy" not in spec:
        p.error('--speculation must be a JSON object with a "policy", e.g. {"policy": "ar"}')
    args.spec = spec
    return args


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
        return (f"{self.label:<28}{len(self.latencies):>9}{self.requests_per_s:>8.2f}"
                f"{tok_s:>9.1f}{p50:>9.0f}{p99:>9.0f}{self.errors:>8}")  # fmt: skip


def bench_in_process(pair, texts: list[str], args) -> Side:
    """The engine in this process, one prompt after another (tokenizing included)."""
    engine = SpeculativeEngine(pair)
    sampling = SamplingConfig(args.temperature)
    knobs = {k: v for k, v in args.spec.items() if k != "policy"}

    def one(seed: int, text: str):
        ids = pair.tokenizer(text, add_special_tokens=False)["input_ids"]
        return engine.generate(ids, make_policy(args.spec["policy"], **knobs), args.max_tokens,
                               sampling, seed=seed)  # fmt: skip

    one(0, texts[0])  # warm-up
    latencies, outputs = [], []
    started = time.perf_counter()
    for seed, text in enumerate(texts):
        t0 = time.perf_counter()
        outputs.append(one(seed, text))
        latencies.append(time.perf_counter() - t0)
    seconds = time.perf_counter() - started
    return Side("in-process (sequential)", latencies, sum(len(g.tokens) for g in outputs),
                seconds, 0, [g.text for g in outputs])  # fmt: skip


def bench_endpoint(url: str, texts: list[str], args) -> Side:
    """C client threads posting the prompts (each once) to /v1/completions."""
    import httpx

    def body(seed: int, text: str) -> dict:
        return {"prompt": text, "max_tokens": args.max_tokens, "temperature": args.temperature,
                "seed": seed, "speculation": args.spec}  # fmt: skip

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
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(one, enumerate(texts)))
    seconds = time.perf_counter() - started
    outs = [out for _, out in results]
    tokens = sum(o["usage"]["completion_tokens"] for o in outs if o)
    return Side(f"endpoint ({args.concurrency} clients)", [t for t, _ in results], tokens,
                seconds, sum(o is None for o in outs),
                [o["choices"][0]["text"] if o else None for o in outs])  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_endpoint(args) -> str:
    from ray import serve

    from serving.app import build_app

    init_ray(num_cpus=args.num_cpus)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app({"target": args.target, "draft": args.draft, "device": args.device,
                     "dtype": args.dtype, "num_cpus": args.replica_cpus,
                     "num_gpus": 1 if torch.cuda.is_available() else 0,
                     "max_tokens_limit": max(1024, args.max_tokens)})  # fmt: skip
    serve.run(app, name="bench-serve", route_prefix="/", blocking=False)
    return f"http://127.0.0.1:{port}"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    texts = [p.text for p in load_prompts(args.source, args.limit)]
    pair = load_pair(args.target, args.draft, args.device, args.dtype)
    if pair.device.type == "cpu":
        torch.set_num_threads(max(1, int(args.replica_cpus)))  # as many threads as a replica
    local = bench_in_process(pair, texts, args)
    del pair
    started_here = args.url is None
    url = start_endpoint(args) if started_here else args.url.rstrip("/")
    try:
        remote = bench_endpoint(url, texts, args)
    finally:
        if started_here:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    ratio = remote.requests_per_s / local.requests_per_s
    print(f"\n{len(texts)} {args.source} prompts x {args.max_tokens} tokens, "
          f"T={args.temperature:g}, speculation {json.dumps(args.spec)}, "
          f"endpoint {url}\n")  # fmt: skip
    print(f"{'':<28}{'requests':>9}{'req/s':>8}{'tok/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'errors':>8}")  # fmt: skip
    print(local.row())
    print(remote.row())
    print(f"\nthroughput, endpoint / in-process: {ratio:.2f}x")
    if args.temperature == 0:
        same = sum(a == b for a, b in zip(local.texts, remote.texts, strict=True))
        print(f"identical greedy text: {same}/{len(texts)} prompts")
    metrics = {"local_req_s": local.requests_per_s, "endpoint_req_s": remote.requests_per_s,
               "ratio": ratio, "endpoint_errors": remote.errors,
               "endpoint_p50_ms": float(np.percentile(remote.latencies, 50) * 1e3),
               "endpoint_p99_ms": float(np.percentile(remote.latencies, 99) * 1e3)}  # fmt: skip
    with tracked_run("bench_serve", params={k: v for k, v in vars(args).items() if k != "spec"}
                     ) as tracked:  # fmt: skip
        tracked.log_metrics(metrics)
    return metrics


if __name__ == "__main__":
    run(main)
