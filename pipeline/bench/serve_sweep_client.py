"""The serving sweep's clients: streamed completions posted the way serving benchmarks post
them (vLLM's ``benchmark_serving``), each timed from the client's side.

Per request the client records the latency (until ``[DONE]``), the time to first token (TTFT:
until the first chunk with text) and the output tokens (``usage`` on the last chunk). A
request fails (``error``) on a non-200 answer, an error event in its stream, a stream without
``[DONE]``, a transport error or timeout, or a generation cut by its deadline. Clients talk to
the loopback only (proxy settings are ignored).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Outcome:
    """One streamed request, as its client saw it."""

    latency: float  # seconds until [DONE] (or the failure)
    ttft: float | None  # seconds until the first text; None without any
    tokens: int  # completion tokens (the last chunk's usage)
    error: str | None


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


async def run_cell(
    url: str, bodies: list[dict[str, Any]], concurrency: int, timeout_s: float
) -> tuple[float, list[Outcome]]:
    """``concurrency`` clients posting every body once, client c taking bodies c, c + C,
    c + 2C, ...; a client's next request leaves when its last one ends. (wall seconds, the
    outcome per body)."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    outcomes: list[Outcome | None] = [None] * len(bodies)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, trust_env=False) as client:

        async def one_client(c: int) -> None:
            for i in range(c, len(bodies), concurrency):
                outcomes[i] = await stream_one(client, url, bodies[i])

        started = time.perf_counter()
        await asyncio.gather(*(one_client(c) for c in range(concurrency)))
        seconds = time.perf_counter() - started
    return seconds, [o for o in outcomes if o is not None]
