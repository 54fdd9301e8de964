"""No request can take a replica down, over real HTTP against a running Serve app (API-key auth
on): the request that once pinned a replica for minutes is refused naming its knobs; the worst
request the step limits still allow is ended by its deadline while a second client's ordinary
request is served within a stated bound, and the replica's memory stays within a stated bound;
a client that goes away stops its work within a step; a replica whose decode loop is stuck
fails its health check and Serve replaces it; deleting the app while generations run returns
within the shutdown budget. The API surface: the openai client against the chat route (plain
and streaming, n = 2), token-id and list prompts; Ray's metrics scraped from Prometheus.

Timing: the bounds asserted are liveness bounds, generous for a loaded 2-core machine, each
derived from the deployment's settings below; the measured figures are printed."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pipeline.decode.policies.registry import make_policy
from pipeline.decode.step_limits import StepLimitError, StepLimits, check_step_limits
from tests.serving_support import one_thread_pair, plain_greedy, serve_apps, wait_healthy

pytestmark = pytest.mark.slow

APP = "specbound-robust"
STALL_APP = "specbound-stall"
API_KEY = "sk-test-robust"
REQUEST_TIMEOUT_S = 12.0  # the robust app's deadline per request
SHUTDOWN_TIMEOUT_S = 5.0
STALL_TIMEOUT_S = 3.0  # the stall app's limit on one step
LONG_PROMPT = "class Stack:\n    def push(self, item):\n        "  # >= 256 greedy tokens, no EOS
SHORT_PROMPT = "The quick brown fox"
# The deepest branch-2 tree the default step limits allow, gamma at its range's top: one level
# deeper is refused (asserted below).
WORST = {"policy": "tree", "depth": 52, "branch": 2, "gamma": 64}
ORDINARY_BOUND_S = 30.0  # a 16-token greedy request next to WORST (one WORST step per step)
MEMORY_BOUND_MB = 512.0  # replica RSS growth while WORST runs


@pytest.fixture(scope="module")
def pair():
    with one_thread_pair() as p:
        yield p


@pytest.fixture(scope="module")
def server() -> str:
    """A local Ray cluster (metrics exported for scraping) with two apps: the robust one at /
    (auth on, a short deadline) and one that loads the stalling test policy at /stall."""
    from serving.metrics import start_ray_with_metrics

    apps = [
        (
            APP,
            "/",
            {
                "api_key": API_KEY,
                "request_timeout_s": REQUEST_TIMEOUT_S,
                "shutdown_timeout_s": SHUTDOWN_TIMEOUT_S,
                "num_cpus": 1,
            },
        ),
        (
            STALL_APP,
            "/stall",
            {
                "policy_modules": ["tests.stall_policy"],
                "num_cpus": 0.5,
                "request_timeout_s": 5,
                "shutdown_timeout_s": 2,
                "stall_timeout_s": STALL_TIMEOUT_S,
            },
        ),
    ]
    with serve_apps(apps, lambda: start_ray_with_metrics(num_cpus=2)) as base:
        yield base


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(base: str, body: dict, timeout: float = 120, path: str = "/v1/completions"):
    return httpx.post(f"{base}{path}", json=body, headers=AUTH, timeout=timeout)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _replicas(app: str) -> list[str]:
    import ray

    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::") and f"{app}#" in a["name"]
    ]


def test_api_key_auth(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(
            f"{server}/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers=headers,
            timeout=60,
        )
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert "Traceback" not in r.text
    assert httpx.get(f"{server}/v1/models", timeout=60).status_code == 401
    assert httpx.get(f"{server}/v1/models", headers=AUTH, timeout=60).status_code == 200
    assert httpx.get(f"{server}/healthz", timeout=60).status_code == 200  # probes stay open


def test_the_request_that_pinned_a_replica_is_refused_naming_its_knobs(server):
    body = {
        "prompt": "def f(x):\n",
        "max_tokens": 8,
        "speculation": {"policy": "tree", "branch": 64, "depth": 64, "gamma": 64},
    }
    started = time.monotonic()
    r = _post(server, body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "speculation" and error["code"] == "step_limit_exceeded"
    assert "depth" in error["message"] and "branch" in error["message"], error
    assert time.monotonic() - started < 30


def test_worst_is_the_largest_tree_the_limits_allow():
    check_step_limits(
        make_policy("tree", **{k: v for k, v in WORST.items() if k != "policy"}), StepLimits()
    )
    with pytest.raises(StepLimitError):
        check_step_limits(make_policy("tree", depth=53, branch=2, gamma=64), StepLimits())


def _rss_mb(base: str) -> float:
    return float(httpx.get(f"{base}/healthz", timeout=30).json()["rss_mb"])


def test_worst_request_ends_by_its_deadline_and_others_are_served(server, pair):
    """WORST with max_tokens 1024 and n = 16 (the server's max_choices) on a prompt whose
    greedy continuation has no EOS for hundreds of tokens: every generation is ended by the
    deadline (finish reason "deadline") within REQUEST_TIMEOUT_S plus one step; a second
    client's 16-token request sent while it runs completes within ORDINARY_BOUND_S with plain
    greedy text; the replica's RSS grows < MEMORY_BOUND_MB."""
    baseline = _rss_mb(server)
    peak = [baseline]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_mb(server))
            time.sleep(0.25)

    worst = {
        "prompt": LONG_PROMPT,
        "max_tokens": 1024,
        "temperature": 0,
        "n": 16,
        "speculation": WORST,
    }
    with ThreadPoolExecutor(2) as pool:
        watcher = pool.submit(watch)
        started = time.monotonic()
        worst_future = pool.submit(_post, server, worst, 120)
        while httpx.get(f"{server}/healthz", timeout=30).json()["in_flight"] < 1:
            assert time.monotonic() - started < 60, "the worst request never started"
            time.sleep(0.1)
        sent = time.monotonic()
        r = _post(server, {"prompt": SHORT_PROMPT, "max_tokens": 16, "temperature": 0}, 120)
        ordinary_s = time.monotonic() - sent
        worst_r = worst_future.result()
        worst_s = time.monotonic() - started
        stop.set()
        watcher.result()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == plain_greedy(pair, SHORT_PROMPT, 16)[1]
    assert worst_r.status_code == 200, worst_r.text
    out = worst_r.json()
    assert len(out["choices"]) == 16
    reference = plain_greedy(pair, LONG_PROMPT, 1024)[1]
    for choice in out["choices"]:
        assert choice["finish_reason"] == "deadline", choice["finish_reason"]
        assert choice["text"] and reference.startswith(choice["text"])
    grown = peak[0] - baseline
    print(
        f"\nworst allowed request ({WORST}, max_tokens 1024, n 16): ended by its deadline after "
        f"{worst_s:.1f} s ({out['usage']['completion_tokens']} tokens); ordinary 16-token "
        f"request beside it {ordinary_s:.1f} s; replica RSS +{grown:.0f} MB "
        f"(from {baseline:.0f} MB)"
    )
    assert worst_s < REQUEST_TIMEOUT_S + 15  # one WORST step and the response: seconds
    assert ordinary_s < ORDINARY_BOUND_S
    assert grown < MEMORY_BOUND_MB


def test_a_client_that_leaves_stops_its_work_within_a_step(server):
    worst = {
        "prompt": LONG_PROMPT,
        "max_tokens": 1024,
        "temperature": 0,
        "speculation": WORST,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{server}/v1/completions", json=worst, headers=AUTH, timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break  # the generation is running: leave
    left = time.monotonic()
    while httpx.get(f"{server}/healthz", timeout=30).json()["in_flight"]:
        assert time.monotonic() - left < 10, "the generation outlived its client"
        time.sleep(0.1)
    print(f"\nclient gone: generation stopped {time.monotonic() - left:.2f} s later")


def _chat_ids(pair, messages) -> list[int]:
    from serving.chat import render_chat

    return render_chat(pair.tokenizer, messages)


def _greedy_from_ids(pair, ids: list[int], n: int) -> str:
    from pipeline.data.references import greedy_continuation

    tokens = greedy_continuation(pair.target, ids, n, pair.tokenizer.eos_token_id)
    return pair.tokenizer.decode(tokens)


def test_openai_client_chat_plain_streaming_and_n(client, pair):
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def add(a, b):"},
    ]
    expected = _greedy_from_ids(pair, _chat_ids(pair, messages), 12)
    out = client.chat.completions.create(
        model="specbound", messages=messages, max_tokens=12, temperature=0, n=2
    )
    assert out.object == "chat.completion" and len(out.choices) == 2
    assert [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        assert choice.message.role == "assistant"
        assert choice.message.content == expected
    parts: dict[int, list[str]] = {0: [], 1: []}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(
        model="specbound", messages=messages, max_tokens=12, temperature=0, n=2, stream=True
    ):
        for c in chunk.choices:
            parts[c.index].append(c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert {i: "".join(p) for i, p in parts.items()} == {0: expected, 1: expected}
    assert set(finish) == {0, 1}
    # Sampling with n = 2 and one seed: two different draws, reproducible.
    draws = [
        [
            c.message.content
            for c in client.chat.completions.create(
                model="specbound",
                messages=messages,
                max_tokens=12,
                temperature=1,
                n=2,
                seed=7,
            ).choices
        ]
        for _ in range(2)
    ]
    assert draws[0] == draws[1]
    assert draws[0][0] != draws[0][1]


def test_token_id_and_list_prompts(client, pair):
    ids = pair.tokenizer(LONG_PROMPT, add_special_tokens=False)["input_ids"]
    expected = plain_greedy(pair, LONG_PROMPT, 8)[1]
    out = client.completions.create(model="specbound", prompt=ids, max_tokens=8, temperature=0)
    assert out.choices[0].text == expected
    short = plain_greedy(pair, SHORT_PROMPT, 8)[1]
    out = client.completions.create(
        model="specbound", prompt=[LONG_PROMPT, SHORT_PROMPT], max_tokens=8, temperature=0, n=2
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [expected, expected, short, short]
    short_ids = pair.tokenizer(SHORT_PROMPT, add_special_tokens=False)["input_ids"]
    out = client.completions.create(
        model="specbound", prompt=[ids, short_ids], max_tokens=8, temperature=0
    )
    assert [c.text for c in out.choices] == [expected, short]
    with pytest.raises(openai.BadRequestError, match="prompt"):
        client.completions.create(model="specbound", prompt=[ids, [10**9]], max_tokens=2)


def test_metrics_reach_prometheus(server):
    from serving.metrics import scrape_metrics

    names = (
        "ray_specbound_requests_total",
        "ray_specbound_drafted_tokens_total",
        "ray_specbound_accepted_tokens_total",
        "ray_specbound_unique_experts_per_verification",
    )
    labels = ('policy="tree"', 'route="completions"', 'route="chat"')
    text = scrape_metrics(names, timeout_s=90, contains=labels)
    assert all(label in text for label in labels)


def test_a_stalled_decode_loop_gets_the_replica_replaced(server):
    """A request whose policy never returns pins the stall app's decoding thread: /healthz
    answers 503 once the step outlives STALL_TIMEOUT_S, Serve's health check fails, and the
    controller replaces the replica, which then serves."""
    base = f"{server}/stall"
    (old,) = _replicas(STALL_APP)
    stuck = threading.Thread(
        target=lambda: _swallow(
            lambda: httpx.post(
                f"{base}/v1/completions",
                json={"prompt": "x", "max_tokens": 4, "speculation": {"policy": "stall"}},
                timeout=20,
            )
        ),
        daemon=True,
    )
    stuck.start()
    started = time.monotonic()
    while True:
        r = _swallow(lambda: httpx.get(f"{base}/healthz", timeout=10))
        if r is not None and r.status_code == 503:
            assert r.json()["status"] == "stalled"
            break
        assert time.monotonic() - started < 60, "the stall was never reported"
        time.sleep(0.2)
    while _replicas(STALL_APP) in ([old], []):
        assert time.monotonic() - started < 180, "the stalled replica was not replaced"
        time.sleep(0.5)
    wait_healthy(base, 300)
    replaced_s = time.monotonic() - started
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=120)
    assert r.status_code == 200, r.text
    print(f"\nstalled replica replaced and serving {replaced_s:.1f} s after the stuck request")


def _swallow(fn):
    try:
        return fn()
    except httpx.HTTPError:
        return None


def test_deleting_the_app_mid_generation_is_bounded(server):
    """Last: Serve drains (each request ends by its deadline), then cancels what is left;
    serve.delete returns within the deployment's graceful shutdown budget."""
    from ray import serve

    worst = {"prompt": LONG_PROMPT, "max_tokens": 1024, "temperature": 0, "speculation": WORST}
    pending = threading.Thread(
        target=lambda: _swallow(lambda: _post(server, worst, 120)), daemon=True
    )
    pending.start()
    started = time.monotonic()
    while httpx.get(f"{server}/healthz", timeout=30).json()["in_flight"] < 1:
        assert time.monotonic() - started < 60
        time.sleep(0.1)
    started = time.monotonic()
    serve.delete(APP)
    took = time.monotonic() - started
    print(f"\napp deleted with a generation running: {took:.1f} s")
    assert took < REQUEST_TIMEOUT_S + SHUTDOWN_TIMEOUT_S + 30
