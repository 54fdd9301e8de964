"""The serving sweep's harness (jobs.bench_serve_sweep): the endpoint measured the way serving
benchmarks measure one (vLLM's ``benchmark_serving``), over replica modes x client concurrency
x speculation settings, in one run.

A mode is one Serve app: ``single`` (``max_batch=1``: the replica advances its generations one
at a time, round robin) or ``batched`` (``max_batch=N``: continuous batching). The modes run one
after another on the same Serve instance (on 2 cores two replicas would share them). Within a
mode, for each concurrency C and each speculation setting, C clients post every prompt once as
streaming completions, client c taking prompts c, c + C, c + 2C, ...; the next request of a
client leaves when its last one ends. Per request the client records the latency (until
``[DONE]``), the time to first token (TTFT: until the first chunk with text) and the output
tokens (``usage`` on the last chunk). A cell reports completed requests per second and output
tokens per second over its wall time, and p50/p99 latency and TTFT over its completed requests.

A request fails (``errors``) on a non-200 answer, an error event in its stream, a stream without
``[DONE]``, a transport error or timeout, or a generation cut by its deadline. Clients talk to
the loopback only (proxy settings are ignored) and each cell sends exactly one request per
prompt, each bounded by ``max_tokens`` and the client's timeout.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from serving.bench import app_args, deploy, serve_on_loopback

MODES = ("single", "batched")


@dataclass(frozen=True)
class SweepSettings:
    target: str
    draft: str
    device: str
    dtype: str
    experts_implementation: str
    policies: tuple[dict[str, Any], ...]  # request `speculation` fields: {"policy": name, ...}
    concurrency: tuple[int, ...]
    modes: tuple[str, ...]  # of MODES, run in this order
    max_tokens: int
    temperature: float
    replica_cpus: float
    max_batch: int = 16  # the batched mode's
    timeout_s: float = 600.0  # per request, at the client and as the server's deadline

    def replica_args(self, mode: str) -> dict[str, Any]:
        # Serve must let every client's request onto the replica, or it (not max_batch) would
        # cap what the replica can batch; both modes get the same cap, like for like.
        ongoing = max(8, self.max_batch, *self.concurrency)
        return app_args(
            self.target,
            self.draft,
            self.device,
            self.dtype,
            self.experts_implementation,
            self.replica_cpus,
            self.max_tokens,
            max_batch=self.max_batch if mode == "batched" else 1,
            max_ongoing_requests=ongoing,
            request_timeout_s=self.timeout_s,
        )


def policy_label(spec: dict[str, Any]) -> str:
    """``{"policy": "fixed", "k": 4}`` -> ``fixed k=4``."""
    knobs = " ".join(f"{k}={v}" for k, v in spec.items() if k != "policy")
    return f"{spec['policy']} {knobs}".strip()


def metric_key(label: str) -> str:
    """A label as MLflow allows in a metric name: ``fixed k=4`` -> ``fixed_k_4``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_")


@dataclass(frozen=True)
class Outcome:
    """One streamed request, as its client saw it."""

    latency: float  # seconds until [DONE] (or the failure)
    ttft: float | None  # seconds until the first text; None without any
    tokens: int  # completion tokens (the last chunk's usage)
    error: str | None


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1e3) if values else float("nan")


@dataclass(frozen=True)
class Cell:
    mode: str
    concurrency: int
    policy: str  # policy_label
    seconds: float  # wall time of the cell
    outcomes: tuple[Outcome, ...]

    def row(self) -> dict[str, Any]:
        ok = [o for o in self.outcomes if o.error is None]
        lat = [o.latency for o in ok]
        ttft = [o.ttft for o in ok if o.ttft is not None]
        return {
            "mode": self.mode,
            "concurrency": self.concurrency,
            "policy": self.policy,
            "requests": len(self.outcomes),
            "errors": len(self.outcomes) - len(ok),
            "seconds": self.seconds,
            "req_s": len(ok) / self.seconds,
            "out_tok_s": sum(o.tokens for o in ok) / self.seconds,
            "out_tokens": sum(o.tokens for o in ok),
            "p50_ms": _pct(lat, 50),
            "p99_ms": _pct(lat, 99),
            "ttft_p50_ms": _pct(ttft, 50),
            "ttft_p99_ms": _pct(ttft, 99),
        }


@dataclass(frozen=True)
class SweepResult:
    settings: SweepSettings
    url: str
    prompts: int
    cells: tuple[Cell, ...]

    def rows(self) -> list[dict[str, Any]]:
        return [c.row() for c in self.cells]

    def ratios(self) -> list[dict[str, Any]]:
        """Batched over single per (concurrency, policy), where the run has both modes."""
        by = {(r["mode"], r["concurrency"], r["policy"]): r for r in self.rows()}
        out = []
        for (mode, c, policy), b in by.items():
            s = by.get(("single", c, policy))
            if mode != "batched" or s is None:
                continue
            out.append(
                {"concurrency": c, "policy": policy}
                | {
                    f"{k}_x": b[k] / s[k] if s[k] else float("nan")
                    for k in ("req_s", "out_tok_s", "p50_ms", "ttft_p50_ms")
                }
            )
        return out

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        keys = ("req_s", "out_tok_s", "p50_ms", "p99_ms", "ttft_p50_ms", "ttft_p99_ms", "errors")
        for r in self.rows():
            prefix = f"{r['mode']}.c{r['concurrency']}.{metric_key(r['policy'])}"
            out |= {f"{prefix}.{k}": float(r[k]) for k in keys}
        for r in self.ratios():
            prefix = f"ratio.c{r['concurrency']}.{metric_key(r['policy'])}"
            out |= {f"{prefix}.{k}": float(v) for k, v in r.items() if k.endswith("_x")}
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": asdict(self.settings),
            "url": self.url,
            "prompts": self.prompts,
            "rows": self.rows(),
            "ratios": self.ratios(),
        }


async def stream_one(client: Any, url: str, body: dict[str, Any]) -> Outcome:
    """One streaming completion: its latency, TTFT, output tokens, or what went wrong."""
    import httpx

    started = time.perf_counter()
    ttft, tokens, done, error = None, 0, False, None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:200]
                error = f"HTTP {r.status_code}: {text}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = f"stream error: {chunk['error'].get('message')}"
                        continue
                    choices = chunk.get("choices") or []
                    if ttft is None and any(c.get("text") for c in choices):
                        ttft = time.perf_counter() - started
                    if any(c.get("finish_reason") == "deadline" for c in choices):
                        error = "generation cut by its deadline"
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    if error is None and not done:
        error = "stream ended without [DONE]"
    return Outcome(time.perf_counter() - started, ttft, tokens, error)


def _body(settings: SweepSettings, seed: int, text: str, spec: dict[str, Any]) -> dict:
    return {
        "prompt": text,
        "max_tokens": settings.max_tokens,
        "stream": True,
        "temperature": settings.temperature,
        "seed": seed,
        "speculation": spec,
    }


async def run_cell(
    url: str, texts: list[str], spec: dict[str, Any], concurrency: int, settings: SweepSettings
) -> tuple[float, list[Outcome]]:
    """``concurrency`` clients posting every prompt once; (wall seconds, outcome per prompt)."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    outcomes: list[Outcome | None] = [None] * len(texts)
    async with httpx.AsyncClient(
        timeout=settings.timeout_s, limits=limits, trust_env=False
    ) as client:

        async def one_client(c: int) -> None:
            for i in range(c, len(texts), concurrency):
                outcomes[i] = await stream_one(client, url, _body(settings, i, texts[i], spec))

        started = time.perf_counter()
        await asyncio.gather(*(one_client(c) for c in range(concurrency)))
        seconds = time.perf_counter() - started
    return seconds, [o for o in outcomes if o is not None]


async def _warm_up(url: str, text: str, settings: SweepSettings) -> None:
    """One unmeasured request per setting (a cost-aware policy loads its artifacts on first
    use); a setting the server refuses stops the sweep before any cell is measured."""
    for spec in settings.policies:
        _, (outcome,) = await run_cell(url, [text], spec, 1, settings)
        if outcome.error is not None:
            raise ValueError(f"warm-up with speculation {json.dumps(spec)}: {outcome.error}")


def run_sweep(
    texts: list[str],
    settings: SweepSettings,
    ray_session: Callable[[], AbstractContextManager[Any]],
    report: Callable[[Cell], None] = lambda cell: None,
) -> SweepResult:
    """Every cell inside ``ray_session()``, mode after mode (each its own app on one Serve
    instance); ``report`` sees each cell as it ends."""
    from ray import serve

    cells: list[Cell] = []
    with ray_session():
        url = serve_on_loopback()
        try:
            for mode in settings.modes:
                name = f"sweep-{mode}"
                deploy(settings.replica_args(mode), name, url)
                asyncio.run(_warm_up(url, texts[0], settings))
                for concurrency in settings.concurrency:
                    for spec in settings.policies:
                        cell = run_cell(url, texts, spec, concurrency, settings)
                        seconds, outcomes = asyncio.run(cell)
                        cells.append(
                            Cell(mode, concurrency, policy_label(spec), seconds, tuple(outcomes))
                        )
                        report(cells[-1])
                serve.delete(name)
        finally:
            serve.shutdown()
    return SweepResult(settings, url, len(texts), tuple(cells))
