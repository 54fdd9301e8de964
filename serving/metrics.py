"""Prometheus metrics of the serving replicas, recorded through Ray Serve's metrics API.

Every name here is exported by each node's Ray metrics agent with Ray's ``ray_`` prefix
(``specbound_requests`` -> ``ray_specbound_requests_total``: counters gain ``_total``,
histograms ``_bucket``/``_sum``/``_count``), and inside a replica Serve adds the
``deployment``, ``replica`` and ``application`` labels. The agent's endpoint is
``prometheus_url()``; recorded values reach it at Ray's metrics report interval
(``metrics_report_interval_ms``, 10 s by default). Ray's agent rebuilds histograms from
bucket counts, so a histogram's ``_sum`` is approximate (each value counts as its bucket's
midpoint); exact totals and means come from the counters (e.g. mean unique experts per
verification = unique_experts / verification_steps). The agent drops a gauge series ~2 report
intervals after its last report, and a worker reports a gauge only when it is set, so the
gauges here are set again every few seconds while the replica lives.

Labels stay few and bounded, so a misbehaving client cannot blow up the series count: policy
names come from the policy registry (plugins registered on the replica included), routes
from the server's fixed set, the status is the HTTP code and the finish reason one of the
engine's; anything else is recorded as "other".
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterable

import ray
from ray.serve.metrics import Counter, Gauge, Histogram

from pipeline.decode.policies.registry import POLICIES
from pipeline.decode.types import StepRecord

PREFIX = "specbound_"
OTHER = "other"
ROUTES = frozenset({"completions", "chat", "models", "healthz"})
# A route may also be given as its path.
PATHS = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/models": "models",
    "/healthz": "healthz",
}
# The engine's reasons ("cancelled": the client went away, "deadline": the request's time ran
# out) and "error" for a generation that failed.
FINISH_REASONS = frozenset({"length", "eos", "stop", "cancelled", "deadline", "error"})

LATENCY_BUCKETS_S = [
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
]
ACCEPTANCE_BUCKETS = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]
# Mean unique experts per MoE layer in one verification pass: from 1 (every position routed to
# the same experts) up to the layer's expert count (tens to a few hundred).
EXPERT_BUCKETS = [
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
    12.0,
    16.0,
    24.0,
    32.0,
    48.0,
    64.0,
    96.0,
    128.0,
    192.0,
    256.0,
]
# Well under the agent's gauge lifetime (2 report intervals: 20 s by default).
GAUGE_REFRESH_S = 5.0


def bounded(value: str, allowed: Iterable[str]) -> str:
    """``value`` if it is one of ``allowed``, else "other" (a label never carries free text)."""
    return value if value in allowed else OTHER


def prometheus_url(node_index: int = 0) -> str:
    """The Prometheus endpoint of a live node's Ray metrics agent, the head first (this process
    must be connected to the cluster). Every node has its own; a local cluster has one."""
    nodes = sorted(
        (n for n in ray.nodes() if n["Alive"]),
        key=lambda n: "node:__internal_head__" not in n["Resources"],
    )
    node = nodes[node_index]
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


def start_ray_with_metrics(num_cpus: int | None = None, report_interval_ms: int = 1000) -> str:
    """A fresh local Ray cluster whose processes report metrics every ``report_interval_ms``
    (Ray's default, 10 s, makes a test wait that long for each value); its Prometheus URL."""
    ray.init(
        address="local",
        num_cpus=num_cpus,
        log_to_driver=True,
        _system_config={"metrics_report_interval_ms": report_interval_ms},
    )
    return prometheus_url()


def scrape_metrics(
    names: Iterable[str],
    timeout_s: float = 60,
    url: str | None = None,
    contains: Iterable[str] = (),
) -> str:
    """The Prometheus text of ``url`` (default: this cluster's first node) once every one of
    ``names`` has a sample (a histogram's base name matches its _bucket/_count/_sum series)
    and the text holds every string of ``contains`` (labels: a replica exports its samples
    every few seconds, so the newest may lag); TimeoutError naming the missing ones after
    ``timeout_s``."""
    url = url or prometheus_url()
    wanted = set(names)
    deadline = time.monotonic() + timeout_s
    while True:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        found = {
            line.split("{", 1)[0].split(" ", 1)[0]
            for line in text.splitlines()
            if line and not line.startswith("#")
        }
        missing = {n for n in wanted if not found & {n, n + "_bucket", n + "_total"}}
        missing |= {s for s in contains if s not in text}
        if not missing:
            return text
        if time.monotonic() > deadline:
            raise TimeoutError(f"no samples of {sorted(missing)} at {url} after {timeout_s}s")
        time.sleep(1)


class ServingMetrics:
    """One replica's metrics; build it in the replica's ``__init__`` (the Serve context is
    what adds the deployment and replica labels). Thread-safe: generations may be recorded
    from the decoding thread while the event loop records requests. A daemon thread keeps the
    gauges' series alive (``close()`` stops it)."""

    def __init__(self, gauge_refresh_s: float = GAUGE_REFRESH_S) -> None:
        def counter(name: str, doc: str, *tags: str) -> Counter:
            return Counter(PREFIX + name, description=doc, tag_keys=tags)

        def histogram(name: str, doc: str, buckets: list, *tags: str) -> Histogram:
            return Histogram(PREFIX + name, description=doc, boundaries=buckets, tag_keys=tags)

        self.requests = counter("requests", "HTTP requests answered", "route", "status")
        self.latency = histogram(
            "request_latency_seconds",
            "Time from request arrival to the end of the response",
            LATENCY_BUCKETS_S,
            "route",
            "status",
        )
        self.generations = counter(
            "generations", "Generations ended, by finish reason", "policy", "finish_reason"
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of generations", "policy")
        self.completion_tokens = counter("completion_tokens", "Tokens generated", "policy")
        self.drafted = counter("drafted_tokens", "Tokens the draft proposed", "policy")
        self.accepted = counter("accepted_tokens", "Draft tokens the target accepted", "policy")
        self.steps = counter(
            "verification_steps", "Target verification passes (engine steps)", "policy"
        )
        self.verified = counter(
            "verified_positions", "Positions in verification passes, the root included", "policy"
        )
        self.draft_seconds = counter("draft_seconds", "Time spent drafting", "policy")
        self.verify_seconds = counter("verify_seconds", "Time spent verifying", "policy")
        # Counter and histogram: the exact mean, and the distribution.
        self.experts_sum = counter(
            "unique_experts",
            "Sum over verification passes of the mean unique experts per MoE layer",
            "policy",
        )
        self.unique_experts = histogram(
            "unique_experts_per_verification",
            "Mean over MoE layers of the unique experts one verification pass routes to",
            EXPERT_BUCKETS,
            "policy",
        )
        self.acceptance = histogram(
            "acceptance_rate",
            "Accepted / drafted tokens of one generation",
            ACCEPTANCE_BUCKETS,
            "policy",
        )
        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Time from request arrival to the first generated text",
            LATENCY_BUCKETS_S,
            "policy",
        )
        self.queue_depth = Gauge(
            PREFIX + "queue_depth", description="Generations in flight on the decoding thread"
        )
        self.stalled_flag = Gauge(
            PREFIX + "stalled", description="1 while the decoding thread is stalled, else 0"
        )
        # Last value of each gauge, set again by the refresher; both series exist from the start.
        self._gauges: dict[str, tuple[Gauge, float]] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.queue(0)
        self.stalled(False)
        threading.Thread(
            target=self._refresh, args=(gauge_refresh_s,), daemon=True, name="metrics-gauges"
        ).start()

    def request(self, route: str, status: int, latency_s: float) -> None:
        tags = {"route": bounded(PATHS.get(route, route), ROUTES), "status": str(int(status))}
        self.requests.inc(1, tags)
        self.latency.observe(max(float(latency_s), 0.0), tags)

    def generation(
        self,
        policy: str,
        steps: list[StepRecord],
        prompt_tokens: int,
        completion_tokens: int,
        finish_reason: str,
        ttft_s: float | None,
    ) -> None:
        """One ended generation (any finish reason, "error" included) and its step records."""
        tags = {"policy": bounded(policy, POLICIES)}  # registered plugins included
        self.generations.inc(1, {**tags, "finish_reason": bounded(finish_reason, FINISH_REASONS)})
        drafted = sum(s.drafted for s in steps)
        accepted = sum(s.accepted for s in steps)
        totals = [
            (self.prompt_tokens, prompt_tokens),
            (self.completion_tokens, completion_tokens),
            (self.drafted, drafted),
            (self.accepted, accepted),
            (self.steps, len(steps)),
            (self.verified, sum(s.verified for s in steps)),
            (self.draft_seconds, sum(s.t_draft_ms for s in steps) / 1000),
            (self.verify_seconds, sum(s.t_verify_ms for s in steps) / 1000),
        ]
        for metric, value in totals:
            if value > 0:  # Ray refuses increments <= 0; a zero changes nothing anyway
                metric.inc(value, tags)
        routed = [s.u_bar for s in steps if s.unique_experts]  # a dense target routes nothing
        for u in routed:
            self.unique_experts.observe(u, tags)
        if sum(routed) > 0:
            self.experts_sum.inc(sum(routed), tags)
        if drafted > 0:  # autoregressive decoding has no acceptance rate
            self.acceptance.observe(accepted / drafted, tags)
        if ttft_s is not None:
            self.ttft.observe(max(float(ttft_s), 0.0), tags)

    def queue(self, depth: int) -> None:
        self._set(self.queue_depth, int(depth))

    def stalled(self, flag: bool) -> None:
        self._set(self.stalled_flag, 1 if flag else 0)

    def close(self) -> None:
        """Stop refreshing the gauges (their series then age out of the agent)."""
        self._closed.set()

    def _set(self, gauge: Gauge, value: float) -> None:
        with self._lock:
            self._gauges[gauge.info["name"]] = (gauge, value)
            gauge.set(value, {})

    def _refresh(self, period_s: float) -> None:
        while not self._closed.wait(period_s):
            with self._lock:
                for gauge, value in self._gauges.values():
                    gauge.set(value, {})
