"""ServingMetrics end to end: a real local Ray cluster, a model-free Serve deployment that
records through ServingMetrics, and the Prometheus text scraped from the node's Ray metrics
agent, where every series must show up with the recorded values (names with Ray's ``ray_``
prefix, Serve's deployment/application labels, labels bounded to known values).

Timing: values reach the agent at Ray's metrics report interval (lowered to 1 s here); the
scrape polls until every expected sample is there, with a generous liveness bound. Then, to see
the gauges kept alive past the agent's lifetime of an unreported gauge (about 20 s), it polls
until a gauge set once, after them, has aged out (bounded: past the deadline it fails saying
the agent no longer drops one)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
from ray.serve.metrics import Gauge

from pipeline.decode.types import StepRecord
from serving.metrics import ServingMetrics, scrape_metrics, start_ray_with_metrics

APP = "metrics-test"
SCRAPE_DEADLINE_S = 60
GAUGE_LIFETIME_S = 20
SET_ONCE = "specbound_test_set_once"  # a gauge the recorder sets once, never again

Labels = dict[str, str]
Samples = list[tuple[str, Labels, float]]


def scrape(url: str) -> Samples:
    """Every sample on the endpoint: (name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sum over the series of ``name`` whose labels include ``labels`` (None: none)."""
    found = [v for n, ls, v in samples if n == name and labels.items() <= ls.items()]
    return sum(found) if found else None


def until_gone(url: str, name: str, labels: Labels, deadline_s: float) -> float:
    """Scrape until ``name`` has no sample with ``labels``; the seconds that took. Past the
    deadline, a failure that says why the caller needed it gone."""
    started = time.monotonic()
    while value(scrape(url), name, **labels) is not None:
        waited = time.monotonic() - started
        assert waited < deadline_s, (
            f"{name}, set once, was still exported {waited:.0f} s later: the agent no longer "
            f"drops a gauge that is not reported (lifetime ~{GAUGE_LIFETIME_S} s), so this "
            "test cannot see whether ServingMetrics keeps its gauges alive"
        )
        time.sleep(1)
    return time.monotonic() - started


def until_exported(
    url: str, check: Callable[[Samples], None], deadline_s: float = SCRAPE_DEADLINE_S
) -> None:
    """Scrape until ``check(samples)`` passes (values arrive once per report interval, and a
    scrape may land between two parts of one report); past the deadline, its failure stands.
    The deadline is a liveness bound only."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            check(scrape(url))
            return
        except (AssertionError, TypeError):  # TypeError: a comparison with a missing value
            if time.monotonic() > deadline:
                raise
        time.sleep(1)


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A fresh local cluster reporting metrics every second, without Serve's HTTP proxy; the
    metrics agent's Prometheus URL."""
    import ray
    from ray import serve

    url = start_ray_with_metrics(num_cpus=1)
    try:
        serve.start(proxy_location="Disabled")
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.slow
def test_metrics_reach_prometheus(cluster: str) -> None:
    from ray import serve

    # Defined here and using only importable modules: the replica unpickles it by value
    # (workers cannot import this test module).
    def _step(drafted: int, accepted: int, experts: list[int]) -> StepRecord:
        return StepRecord(
            drafted=drafted,
            verified=drafted + 1,
            accepted=accepted,
            new_tokens=accepted + 1,
            unique_experts=experts,
            t_draft_ms=100.0,
            t_verify_ms=200.0,
            draft_forwards=drafted,
        )

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Recorder:
        def __init__(self) -> None:
            self.metrics = ServingMetrics()
            self.once = Gauge(SET_ONCE, description="set once, then left to age out")

        def record(self) -> None:
            m = self.metrics
            m.request("completions", 200, 0.3)
            m.request("/v1/completions", 200, 0.7)  # a path names its route
            m.request("completions", 400, 0.001)
            m.request("chat", 200, 0.02)
            m.request("/v1/completions/../../secret?x=1", 404, 0.002)  # free text -> "other"
            steps = [_step(4, 3, [6, 8]), _step(4, 1, [10, 12])]  # u_bar 7 and 11
            m.generation(
                "fixed",
                steps,
                prompt_tokens=5,
                completion_tokens=6,
                finish_reason="length",
                ttft_s=0.2,
            )
            # Autoregressive: nothing drafted, so no drafted increment, no acceptance rate.
            m.generation("ar", [_step(0, 0, [3, 5])], 2, 1, "eos", None)
            m.generation("no-such-policy", [], 1, 1, "whatever", None)
            m.queue(3)
            m.stalled(True)
            self.once.set(1.0, {})  # after ServingMetrics' gauges: it ages out no sooner

    handle = serve.run(Recorder.bind(), name=APP, route_prefix=None)
    handle.record.remote().result(timeout_s=60)

    app = {"application": APP}
    ours = {"application": APP, "policy": "fixed"}

    def check(s: Samples) -> None:
        requests = "ray_specbound_requests_total"
        assert value(s, requests, route="completions", status="200", **app) == 2
        assert value(s, requests, route="completions", status="400", **app) == 1
        assert value(s, requests, route="chat", status="200", **app) == 1
        assert value(s, requests, route="other", status="404", **app) == 1
        latency = "ray_specbound_request_latency_seconds"
        assert value(s, f"{latency}_count", route="completions", status="200", **app) == 2
        # Ray rebuilds histograms from bucket counts: a sum is only known within its buckets.
        assert (
            0.25 + 0.5
            <= value(s, f"{latency}_sum", route="completions", status="200", **app)
            <= 0.5 + 1.0
        )
        assert (
            value(s, f"{latency}_bucket", route="completions", status="200", le="0.5", **app) == 1
        )
        # Serve labels the series with the replica's deployment.
        assert value(s, requests, deployment="Recorder", **app) == 5

        generations = "ray_specbound_generations_total"
        assert value(s, generations, policy="fixed", finish_reason="length", **app) == 1
        assert value(s, generations, policy="ar", finish_reason="eos", **app) == 1
        assert value(s, generations, policy="other", finish_reason="other", **app) == 1
        totals = {
            "prompt_tokens": 5,
            "completion_tokens": 6,
            "drafted_tokens": 8,
            "accepted_tokens": 4,
            "verification_steps": 2,
            "verified_positions": 10,
            "draft_seconds": 0.2,
            "verify_seconds": 0.4,
            "unique_experts": 18,
        }
        for name, expected in totals.items():
            assert value(s, f"ray_specbound_{name}_total", **ours) == pytest.approx(expected), name
        assert value(s, "ray_specbound_drafted_tokens_total", policy="ar", **app) is None
        assert value(s, "ray_specbound_verification_steps_total", policy="ar", **app) == 1

        experts = "ray_specbound_unique_experts_per_verification"
        assert value(s, f"{experts}_count", **ours) == 2
        assert 6 + 8 <= value(s, f"{experts}_sum", **ours) <= 8 + 12  # 7 and 11
        assert value(s, f"{experts}_bucket", le="8.0", **ours) == 1
        assert value(s, f"{experts}_bucket", le="12.0", **ours) == 2
        assert value(s, "ray_specbound_unique_experts_total", policy="ar", **app) == 4
        acceptance = "ray_specbound_acceptance_rate"
        assert value(s, f"{acceptance}_count", **ours) == 1
        assert value(s, f"{acceptance}_bucket", le="0.4", **ours) == 0
        assert value(s, f"{acceptance}_bucket", le="0.5", **ours) == 1
        assert value(s, f"{acceptance}_count", policy="ar", **app) is None
        ttft = "ray_specbound_time_to_first_token_seconds"
        assert value(s, f"{ttft}_bucket", le="0.25", **ours) == 1
        assert value(s, f"{ttft}_bucket", le="0.1", **ours) == 0
        assert value(s, f"{ttft}_count", policy="ar", **app) is None

        assert value(s, "ray_specbound_queue_depth", **app) == 3
        assert value(s, "ray_specbound_stalled", **app) == 1
        assert value(s, f"ray_{SET_ONCE}", **app) == 1

    # The helper the endpoint's tests use: a counter, a histogram by base name, a gauge.
    names = [
        "ray_specbound_requests_total",
        "ray_specbound_acceptance_rate",
        "ray_specbound_stalled",
    ]
    assert "ray_specbound_acceptance_rate_bucket{" in scrape_metrics(names, 60, cluster)
    with pytest.raises(TimeoutError, match="ray_specbound_nothing"):
        scrape_metrics(["ray_specbound_nothing"], timeout_s=0, url=cluster)
    until_exported(cluster, check)
    # The agent drops a gauge series not reported for its lifetime (~20 s): once the gauge set
    # once (after ServingMetrics' gauges were first set) is gone, theirs would be gone too had
    # they not been set again. ServingMetrics keeps setting them; counters and histograms
    # never expire.
    until_gone(cluster, f"ray_{SET_ONCE}", app, GAUGE_LIFETIME_S + SCRAPE_DEADLINE_S)
    s = scrape(cluster)
    assert value(s, "ray_specbound_queue_depth", **app) == 3
    assert value(s, "ray_specbound_stalled", **app) == 1
    assert value(s, "ray_specbound_requests_total", route="completions", **app) == 3
    assert value(s, "ray_specbound_acceptance_rate_count", **ours) == 1
