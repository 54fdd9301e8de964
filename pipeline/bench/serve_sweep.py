"""The serving sweep's harness (jobs.bench_serve_sweep): served systems x prompt sources x client
concurrency, in one run, interleaved: for each source and each concurrency every system's
cell runs before the next concurrency, so a drift of the machine touches all alike.

A system is one (mode, policy) pair:
- ``single`` / ``batched``: the research endpoint (serving.app, this environment's Ray
  cluster) with ``max_batch=1`` (one generation at a time, round robin) or ``max_batch=N``
  (continuous batching), a request's ``speculation`` field choosing the policy; the modes are
  apps of one Serve instance, side by side under their own route prefixes;
- ``vllm``: the vLLM app (vllm_serving, in the vLLM environment and a Ray cluster of its own),
  every speculation setting one of its model ids (one engine replica each), the request's
  ``model`` choosing it.

In a cell, C clients post every prompt of the source once as streaming completions
(pipeline.bench.serve_sweep_client). A cell reports completed requests per second and output
tokens per second over its wall time, p50/p99 latency and TTFT over its completed requests, and
errors.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from pipeline.bench.serve import app_args, deploy, serve_on_loopback
from pipeline.bench.serve_sweep_client import Outcome, run_cell
from pipeline.bench.serve_sweep_compare import comparisons

MODES = ("single", "batched")
VLLM = "vllm"


@dataclass(frozen=True)
class SweepSettings:
    target: str
    draft: str
    device: str
    dtype: str
    experts_implementation: str
    policies: tuple[dict[str, Any], ...]  # request `speculation` fields: {"policy": name, ...}
    concurrency: tuple[int, ...]
    modes: tuple[str, ...]  # of MODES
    max_tokens: int
    temperature: float
    replica_cpus: float
    max_batch: int = 16  # the batched mode's
    timeout_s: float = 600.0  # per request, at the client and as the server's deadline
    # The vLLM app's model ids (vllm_serving.settings.ServedModel fields); none: not run.
    vllm_models: tuple[dict[str, Any], ...] = ()

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

    def vllm_args(self) -> dict[str, Any]:
        """The vLLM app's settings: one engine replica per model id, each let take every
        client's request at once (like the endpoint's replicas), the same deadline."""
        most = max(self.concurrency)
        return {
            "target": self.target,
            "draft": self.draft,
            "models": list(self.vllm_models),
            "kv_cache_gib": 1,  # several engines side by side in 24 GiB
            "max_num_seqs": max(16, most),
            "max_ongoing_requests": max(8, most),
            "target_ongoing_requests": max(8, most),
            "request_timeout_s": self.timeout_s,
        }


def policy_label(spec: dict[str, Any]) -> str:
    """``{"policy": "fixed", "k": 4}`` -> ``fixed k=4``."""
    knobs = " ".join(f"{k}={v}" for k, v in spec.items() if k != "policy")
    return f"{spec['policy']} {knobs}".strip()


def metric_key(label: str) -> str:
    """A label as MLflow allows in a metric name: ``fixed k=4`` -> ``fixed_k_4``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_")


@dataclass(frozen=True)
class System:
    """Where a cell's requests go and what they carry besides the prompt."""

    mode: str
    policy: str
    path: str  # below the sweep's base URL of this mode
    fields: dict[str, Any] = field(default_factory=dict)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1e3) if values else float("nan")


@dataclass(frozen=True)
class Cell:
    mode: str
    concurrency: int
    policy: str  # policy_label, or the vLLM app's model id
    seconds: float  # wall time of the cell
    outcomes: tuple[Outcome, ...]
    source: str = ""

    def row(self) -> dict[str, Any]:
        ok = [o for o in self.outcomes if o.error is None]
        lat = [o.latency for o in ok]
        ttft = [o.ttft for o in ok if o.ttft is not None]
        return {
            "source": self.source,
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
    prompts: int  # per source
    cells: tuple[Cell, ...]

    def rows(self) -> list[dict[str, Any]]:
        return [c.row() for c in self.cells]

    def ratios(self) -> list[dict[str, Any]]:
        """Batched over single per (source, concurrency, policy), where the run has both."""
        by = {(r["source"], r["mode"], r["concurrency"], r["policy"]): r for r in self.rows()}
        out = []
        for (src, mode, c, policy), b in by.items():
            s = by.get((src, "single", c, policy))
            if mode != "batched" or s is None:
                continue
            out.append(
                {"source": src, "concurrency": c, "policy": policy}
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
            prefix = f"{r['source']}.{r['mode']}.c{r['concurrency']}.{metric_key(r['policy'])}"
            out |= {f"{prefix}.{k}": float(r[k]) for k in keys}
        for r in self.ratios():
            prefix = f"{r['source']}.ratio.c{r['concurrency']}.{metric_key(r['policy'])}"
            out |= {f"{prefix}.{k}": float(v) for k, v in r.items() if k.endswith("_x")}
        for r in comparisons(self.rows()):
            prefix = f"{r['source']}.vllm_vs.c{r['concurrency']}"
            out |= {f"{prefix}.{k}": float(v) for k, v in r.items() if k.endswith("_x")}
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": asdict(self.settings),
            "url": self.url,
            "prompts": self.prompts,
            "rows": self.rows(),
            "ratios": self.ratios(),
            "comparisons": comparisons(self.rows()),
        }


def systems(settings: SweepSettings) -> list[System]:
    out = [
        System(mode, policy_label(spec), f"/{mode}", {"speculation": spec})
        for mode in settings.modes
        for spec in settings.policies
    ]
    # vLLM streams usage only when asked; the endpoint always sends it on the last chunk.
    usage = {"stream_options": {"include_usage": True}}
    for m in settings.vllm_models:
        out.append(System(VLLM, m["name"], "", {"model": m["name"], **usage}))
    return out


def _bodies(settings: SweepSettings, texts: list[str], system: System) -> list[dict[str, Any]]:
    base = {"max_tokens": settings.max_tokens, "stream": True, "temperature": settings.temperature}
    return [{"prompt": t, "seed": i, **base, **system.fields} for i, t in enumerate(texts)]


async def _warm_up(urls: dict[str, str], text: str, settings: SweepSettings) -> None:
    """One unmeasured request per system (a cost-aware policy loads its artifacts on first
    use); a setting the server refuses stops the sweep before any cell is measured."""
    for system in systems(settings):
        url = urls[system.mode] + system.path
        bodies = _bodies(settings, [text], system)
        _, (outcome,) = await run_cell(url, bodies, 1, settings.timeout_s)
        if outcome.error is not None:
            raise ValueError(f"warm-up of {system.mode} {system.policy}: {outcome.error}")


def _enter_in_background(stack: ExitStack, manager: AbstractContextManager[Any]) -> Future:
    """``manager`` entered on a thread of its own; ``stack`` exits it once it has entered, also
    when what runs meanwhile fails (a start that failed has nothing to exit)."""
    pool = ThreadPoolExecutor(1)
    started = pool.submit(manager.__enter__)

    def leave() -> None:
        pool.shutdown()
        if started.exception() is None:
            manager.__exit__(None, None, None)

    stack.callback(leave)
    return started


def run_sweep(
    sources: dict[str, list[str]],
    settings: SweepSettings,
    ray_session: Callable[[], AbstractContextManager[Any]],
    report: Callable[[Cell], None] = lambda cell: None,
    vllm_app: Callable[..., AbstractContextManager[Any]] | None = None,
) -> SweepResult:
    """Every cell, interleaved; ``report`` sees each cell as it ends. The endpoint's modes run
    inside ``ray_session()``, the vLLM app (when the settings have vLLM models) inside
    ``vllm_app(settings.vllm_args())``, which yields an object with its ``url``."""
    from ray import serve

    cells: list[Cell] = []
    with ExitStack() as stack:
        urls: dict[str, str] = {}
        vllm_started = None
        if settings.vllm_models:
            if vllm_app is None:
                from pipeline.bench.vllm_app_launcher import vllm_app
            # One engine replica (1 CPU bundle) per model id, all resident while one is
            # measured: the cluster counts a logical CPU for each of them. It starts (a minute
            # and more, mostly waiting on its processes) while the endpoint deploys.
            cpus = max(2, len(settings.vllm_models))
            app = vllm_app(settings.vllm_args(), num_cpus=cpus)
            vllm_started = _enter_in_background(stack, app)
        if settings.modes:
            stack.enter_context(ray_session())
            base = serve_on_loopback()
            stack.callback(serve.shutdown)
            for mode in settings.modes:
                deploy(settings.replica_args(mode), f"sweep-{mode}", base, route_prefix=f"/{mode}")
                urls[mode] = base
        if vllm_started is not None:
            urls[VLLM] = vllm_started.result().url
        first = next(iter(sources.values()))[0]
        asyncio.run(_warm_up(urls, first, settings))
        for source, texts in sources.items():
            for concurrency in settings.concurrency:
                for system in systems(settings):
                    url = urls[system.mode] + system.path
                    bodies = _bodies(settings, texts, system)
                    seconds, outcomes = asyncio.run(
                        run_cell(url, bodies, concurrency, settings.timeout_s)
                    )
                    cell = Cell(
                        system.mode, concurrency, system.policy, seconds, tuple(outcomes), source
                    )
                    cells.append(cell)
                    report(cell)
    prompts = len(next(iter(sources.values())))
    where = " ".join(f"{k}={v}" for k, v in urls.items())
    return SweepResult(settings, where, prompts, tuple(cells))
