"""The Serve endpoint over real HTTP on the embedded models: the openai client (completion and
stream), greedy output equal to the library's, /v1/models and /healthz, a matrix of bad inputs
(each a 4xx JSON error naming the problem), a bounded load test, and a replica killed under
load with retrying clients losing nothing. Also, without Ray: the incremental decoder equals
SpeculativeEngine.generate() and serve_config.yaml is a valid Serve config."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import yaml

from pipeline.data.prompts import load_prompts
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.registry import POLICIES, make_policy
from pipeline.decode.types import SamplingConfig
from pipeline.models.loading import REPO_ROOT, load_pair
from tests.test_policy_registry import out_of_range, wrong_type

APP_NAME = "specbound-test"
MAX_TOKENS_LIMIT = 256
PROMPTS = ["class Stack:\n    def push(self, item):\n        ", "The quick brown fox"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pair():
    """The in-process reference, on one torch thread like a replica (num_cpus=1): with two,
    OpenMP spin-waits make it crawl whenever anything else runs on this 2-core machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield load_pair(device="cpu")
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server() -> str:
    """A fresh local Ray cluster with the app on a free port; its base URL."""
    import ray
    from ray import serve

    from jobs.cli import init_ray
    from serving.app import build_app

    port = _free_port()
    init_ray(num_cpus=2)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # On CPU even where a GPU exists: greedy text is compared with the fp32 CPU reference.
        app = build_app({"max_tokens_limit": MAX_TOKENS_LIMIT, "num_cpus": 1, "num_gpus": 0,
                         "device": "cpu"})  # fmt: skip
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/healthz", timeout=60).status_code == 200
        yield base
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=120)


def _post(server: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{server}/v1/completions", json=body, timeout=timeout)


# --- without Ray ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "knobs", "temperature", "stop"),
    [
        ("fixed", {"k": 4}, 0.0, None),
        ("tree", {}, 0.0, ["\n\n", "return"]),
        ("fixed", {"k": 2}, 1.0, ["  "]),
    ],
)
def test_incremental_decoder_equals_generate(pair, policy, knobs, temperature, stop):
    engine = SpeculativeEngine(pair)
    sampling = SamplingConfig(temperature, 0.9 if temperature else 1.0)
    for text in [*PROMPTS, load_prompts("humaneval", 1)[0].text]:
        ids = pair.tokenizer(text, add_special_tokens=False)["input_ids"]
        ref = engine.generate(ids, make_policy(policy, **knobs), 24, sampling, seed=5, stop=stop)
        gen = engine.stream(ids, make_policy(policy, **knobs), 24, sampling, 5, stop)
        deltas = list(gen.deltas())
        assert "".join(deltas) == gen.result.text == ref.text
        assert gen.result.tokens == ref.tokens
        assert gen.result.finish_reason == ref.finish_reason
        assert all(deltas) and all(not (s and s in "".join(deltas)) for s in stop or [])


def test_serve_config_is_a_valid_serve_config():
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeDeploySchema

    from serving.app import DEPLOYMENT_NAME, build_app

    config = ServeDeploySchema.model_validate(
        yaml.safe_load((REPO_ROOT / "serve_config.yaml").read_text())
    )
    (application,) = config.applications
    assert application.import_path == "serving.app:build_app"
    (deployment,) = application.deployments
    assert deployment.name == DEPLOYMENT_NAME
    assert deployment.ray_actor_options.num_gpus == 1 == application.args["num_gpus"]
    scaling = deployment.autoscaling_config
    assert scaling["min_replicas"] <= scaling["max_replicas"] and scaling["max_replicas"] > 1
    # What `serve run` does with the import path and args (no replica is started).
    call_user_app_builder_with_args_if_necessary(build_app, application.args)
    # `serve run serving.app:build_app key=value` passes strings.
    build_app({"max_tokens_limit": "64", "num_cpus": "0.5", "device": "cpu"})
    with pytest.raises(ValueError, match="devcie"):
        build_app({"devcie": "cpu"})


# --- over HTTP ------------------------------------------------------------------------------


@pytest.mark.slow
def test_models_and_healthz(server):
    health = httpx.get(f"{server}/healthz", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    models = httpx.get(f"{server}/v1/models", timeout=30).json()
    assert models["object"] == "list"
    (model,) = models["data"]
    assert model["id"] == "specbound" and model["object"] == "model"
    assert "fixed" in model["policies"] and model["context_length"] == 2048


@pytest.mark.slow
def test_openai_client_completion_and_stream(client):
    model = client.models.list().data[0].id
    kwargs = {"model": model, "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0}
    done = client.completions.create(**kwargs)
    text = done.choices[0].text
    assert text and done.choices[0].finish_reason in ("stop", "length")
    assert done.usage.completion_tokens > 0
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    stats = done.model_extra["speculation"]
    assert stats["policy"] == "fixed" and stats["knobs"] == {"k": 4} and stats["steps"] >= 1
    assert stats["verify_ms"] > 0 and stats["unique_experts_per_step"] >= 4

    # Greedy decoding is lossless, so another policy streams the same text.
    tree = {"speculation": {"policy": "tree", "depth": 3}}
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body=tree))
    assert len(chunks) > 2  # deltas, not one blob
    assert "".join(c.choices[0].text for c in chunks) == text
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    last = chunks[-1]
    assert last.choices[0].finish_reason == done.choices[0].finish_reason
    assert last.usage.completion_tokens == done.usage.completion_tokens
    assert last.model_extra["speculation"]["policy"] == "tree"


@pytest.mark.slow
def test_raw_stream_is_openai_sse(server):
    body = {"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "usage" in chunks[-1] and "speculation" in chunks[-1]


@pytest.mark.slow
def test_stop_string_ends_text_and_stream_alike(client):
    kwargs = {"model": "specbound", "prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0,
              "stop": ["return", "xyz"]}  # fmt: skip
    done = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert done.choices[0].finish_reason == "stop" == chunks[-1].choices[0].finish_reason
    assert "return" not in done.choices[0].text
    assert "".join(c.choices[0].text for c in chunks) == done.choices[0].text


@pytest.mark.slow
@pytest.mark.parametrize(
    ("policy", "knobs"), [("fixed", {"k": 4}), ("tree", {"depth": 3, "branch": 2, "gamma": 6})]
)
def test_greedy_over_http_equals_library_greedy(server, pair, policy, knobs):
    engine = SpeculativeEngine(pair)
    for prompt in [*PROMPTS, *(p.text for p in load_prompts("humaneval", 2))]:
        ids = pair.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ref = engine.generate(ids, make_policy("ar"), 32, stop_at_eos=True)
        body = {"prompt": prompt, "max_tokens": 32, "temperature": 0,
                "speculation": {"policy": policy, **knobs}}  # fmt: skip
        r = _post(server, body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["text"].encode() == ref.text.encode()
        assert out["usage"]["completion_tokens"] == len(ref.tokens)
        assert out["usage"]["prompt_tokens"] == len(ids)
        assert out["speculation"]["policy"] == policy


@pytest.mark.slow
def test_client_disconnect_stops_the_generation(server):
    before = httpx.get(f"{server}/healthz", timeout=30).json()["generations"]
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS_LIMIT, "temperature": 0,
            "stream": True, "speculation": {"policy": "ar"}}  # fmt: skip
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")  # the first delta: it is running
    deadline = time.monotonic() + 30
    while True:
        now = httpx.get(f"{server}/healthz", timeout=30).json()["generations"]
        if now["cancelled"] > before["cancelled"]:
            break
        assert now["completed"] == before["completed"], "the abandoned generation ran to the end"
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.mark.slow
def test_sampling_with_a_seed_is_reproducible(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 7}
    first, second = _post(server, body).json(), _post(server, body).json()
    assert first["choices"][0]["text"] == second["choices"][0]["text"]


LONG_PROMPT = " ".join(str(i) for i in range(3000))  # > 2048 tokens

BAD_INPUTS = [
    # id, body (bytes: sent as is), status, keyword in the message, param
    ("malformed-json", b'{"prompt": "x", "max_tokens": ', 400, "not valid JSON", None),
    ("not-an-object", b"[1, 2]", 400, "JSON object", None),
    ("empty-body", b"", 400, "empty", None),
    ("nan", b'{"prompt": "x", "temperature": NaN}', 400, "NaN", None),
    ("invalid-utf8", b'{"prompt": "\xff\xfe abc"}', 400, "UTF-8", None),
    ("missing-prompt", {"max_tokens": 4}, 400, "'prompt' is required", "prompt"),
    ("empty-prompt", {"prompt": ""}, 400, "must not be empty", "prompt"),
    ("prompt-int", {"prompt": 5}, 400, "valid string", "prompt"),
    ("lone-surrogate", b'{"prompt": "a\\ud800b"}', 400, "surrogate", "prompt"),
    ("max-tokens-string", {"prompt": "x", "max_tokens": "5"}, 400, "valid integer", "max_tokens"),
    ("max-tokens-float", {"prompt": "x", "max_tokens": 5.5}, 400, "valid integer", "max_tokens"),
    ("max-tokens-zero", {"prompt": "x", "max_tokens": 0}, 400, ">= 1", "max_tokens"),
    ("max-tokens-negative", {"prompt": "x", "max_tokens": -1}, 400, ">= 1", "max_tokens"),
    ("max-tokens-over-limit", {"prompt": "x", "max_tokens": 100000}, 400,
     f"<= {MAX_TOKENS_LIMIT}", "max_tokens"),
    ("prompt-too-long", {"prompt": LONG_PROMPT, "max_tokens": 16}, 400, "context of 2048",
     "prompt"),
    ("temperature-negative", {"prompt": "x", "temperature": -1}, 400, "greater than or equal",
     "temperature"),
    ("top-p-zero", {"prompt": "x", "top_p": 0}, 400, "greater than 0", "top_p"),
    ("top-p-two", {"prompt": "x", "top_p": 2}, 400, "less than or equal to 1", "top_p"),
    ("stream-string", {"prompt": "x", "stream": "yes"}, 400, "valid boolean", "stream"),
    ("stop-int", {"prompt": "x", "stop": 3}, 400, "stop", "stop"),
    ("too-many-stops", {"prompt": "x", "stop": list("abcde")}, 400, "at most 4", "stop"),
    ("unknown-field", {"prompt": "x", "promt": "y"}, 400, "unsupported field 'promt'", "promt"),
    ("unsupported-openai-field", {"prompt": "x", "logprobs": 3}, 400,
     "logprobs: not supported", "logprobs"),
    ("wrong-model", {"prompt": "x", "model": "gpt-4"}, 404, "'gpt-4' does not exist", "model"),
    ("unknown-policy", {"prompt": "x", "speculation": {"policy": "magic"}}, 400,
     "unknown policy 'magic'", "speculation"),
    ("speculation-not-object", {"prompt": "x", "speculation": "fixed"}, 400, "speculation",
     "speculation"),
    ("fixed-k-zero", {"prompt": "x", "speculation": {"policy": "fixed", "k": 0}}, 400,
     "k must be >= 1", "speculation"),
    ("fixed-k-huge", {"prompt": "x", "speculation": {"policy": "fixed", "k": 10000}}, 400,
     "'k' = 10000 is too large", "speculation.k"),
    ("fixed-k-float", {"prompt": "x", "speculation": {"policy": "fixed", "k": 2.5}}, 400,
     "'k' must be an integer", "speculation.k"),
    ("unknown-knob", {"prompt": "x", "speculation": {"policy": "fixed", "kk": 3}}, 400,
     "'kk'", "speculation"),
    ("knob-named-like-a-parameter", {"prompt": "x", "speculation": {"policy": "fixed",
     "name": "tree"}}, 400, "unknown knob 'name'", "speculation.name"),
    ("knob-list", {"prompt": "x", "speculation": {"policy": "tree", "depth": [3]}}, 400,
     "'depth' must be a number", "speculation.depth"),
    ("oversized-body", {"prompt": "x" * (1 << 20)}, 413, "limit", None),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "status", "keyword", "param"),
    [b[1:] for b in BAD_INPUTS],
    ids=[b[0] for b in BAD_INPUTS],
)
def test_bad_input_is_a_4xx_json_error(server, body, status, keyword, param):
    if isinstance(body, bytes):
        r = httpx.post(f"{server}/v1/completions", content=body, timeout=60,
                       headers={"content-type": "application/json"})  # fmt: skip
    else:
        r = _post(server, body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert keyword in error["message"], error
    assert "Traceback" not in r.text
    if param is not None:
        assert error["param"] == param


REGISTRY_KNOBS = [(name, k) for name, cls in POLICIES.items() for k in cls.knobs]


@pytest.mark.slow
def test_every_registered_policy_s_knobs_are_validated_over_http(server):
    """For every knob of every registered policy: a value of the wrong type (a float where an
    int is due...) and a value outside the declared range get a 400 naming the knob, never a
    500 or a generation. ecospec's depth 2.5 once reached range() mid-generation."""
    for name, knob in REGISTRY_KNOBS:
        # (value, what the message names, the param when it is the knob's own field)
        cases = [(wrong_type(knob), knob.name, f"speculation.{knob.name}")]
        bad = out_of_range(knob)
        if bad is not None:
            cases.append((bad, knob.title or knob.name, None))
        for value, named, param in cases:
            r = _post(
                server,
                {"prompt": "x", "max_tokens": 2, "speculation": {"policy": name, knob.name: value}},
                timeout=60,
            )
            assert r.status_code == 400, (name, knob.name, value, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert named in error["message"], (name, knob.name, error)
            assert error["param"].startswith("speculation"), error
            if param is not None:
                assert error["param"] == param, error


@pytest.mark.slow
def test_every_listed_policy_answers_or_fails_cleanly(server):
    """Cost-aware policies need artifacts (an expert predictor...) that a server may lack:
    then a 500 JSON error that names the policy, never a crash."""
    names = httpx.get(f"{server}/v1/models", timeout=30).json()["data"][0]["policies"]
    for name in names:
        r = _post(server, {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
                           "speculation": {"policy": name}})  # fmt: skip
        if r.status_code != 200:
            assert r.status_code == 500, r.text
            assert f"policy '{name}' is unavailable" in r.json()["error"]["message"]
        else:
            assert r.json()["speculation"]["policy"] == name


def test_unexpected_exception_is_a_500_json_error_without_traceback():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from serving.errors import install_error_handlers

    api = FastAPI()
    install_error_handlers(api)

    @api.get("/boom")
    async def boom():
        raise RuntimeError("secret internals")

    r = TestClient(api, raise_server_exceptions=False).get("/boom")
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "internal server error", "type": "server_error",
                                  "param": None, "code": None}}  # fmt: skip
    assert "secret" not in r.text and "Traceback" not in r.text


@pytest.mark.slow
def test_unknown_route_and_method_are_json_errors(server):
    missing = httpx.get(f"{server}/v1/nothing", timeout=30)
    assert missing.status_code == 404 and "no route" in missing.json()["error"]["message"]
    wrong = httpx.get(f"{server}/v1/completions", timeout=30)
    assert wrong.status_code == 405 and wrong.json()["error"]["message"]


@pytest.mark.slow
def test_normal_request_after_bad_inputs(server):
    r = _post(server, {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]


def _percentiles(latencies: list[float]) -> tuple[float, float]:
    return float(np.percentile(latencies, 50)), float(np.percentile(latencies, 99))


@pytest.mark.slow
def test_load_concurrent_clients(server, record_property):
    clients, total = 8, 32
    bodies = [{"prompt": PROMPTS[i % 2], "max_tokens": 16, "temperature": 1.0, "seed": i}
              for i in range(total)]  # fmt: skip

    def one(body: dict) -> tuple[int, float]:
        started = time.perf_counter()
        r = _post(server, body, timeout=180)
        return r.status_code, time.perf_counter() - started

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, bodies))
    wall = time.perf_counter() - started
    errors = [status for status, _ in results if status != 200]
    assert not errors, errors
    p50, p99 = _percentiles([t for _, t in results])
    line = (f"load: {total} requests, {clients} clients, max_tokens 16: {total / wall:.2f} req/s, "
            f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, 0 errors")  # fmt: skip
    print(f"\n{line}")
    record_property("load", line)


def _replica_actor_names() -> list[str]:
    import ray

    from serving.app import DEPLOYMENT_NAME

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::") and DEPLOYMENT_NAME in a["name"]
            and APP_NAME in a["name"]]  # fmt: skip


@pytest.mark.slow
def test_killed_replica_loses_no_retried_request(server, record_property):
    import ray

    (old,) = _replica_actor_names()
    total, clients, deadline_s = 16, 8, 90
    attempts = [0] * total

    def with_retries(i: int) -> str:
        body = {"prompt": PROMPTS[i % 2], "max_tokens": 16, "temperature": 0}
        deadline = time.monotonic() + deadline_s
        backoff = 0.25
        while True:
            attempts[i] += 1
            try:
                r = _post(server, body, timeout=60)
                if r.status_code == 200:
                    return r.json()["choices"][0]["text"]
                assert r.status_code >= 500, r.text  # a client error would be a real bug
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"request {i} still failing after {deadline_s}s"
            time.sleep(backoff)
            backoff = min(backoff * 2, 4.0)

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(with_retries, i) for i in range(total)]
        time.sleep(1.0)  # requests in flight and queued at the replica
        in_flight = sum(not f.done() for f in futures)
        ray.kill(ray.get_actor(old, namespace="serve"), no_restart=True)
        killed_at = time.monotonic()
        texts = [f.result() for f in futures]
    recovered_s = time.monotonic() - killed_at
    assert in_flight > 0
    expected = {p: _post(server, {"prompt": p, "max_tokens": 16, "temperature": 0}).json()
                for p in PROMPTS}  # fmt: skip
    assert texts == [expected[PROMPTS[i % 2]]["choices"][0]["text"] for i in range(total)]
    (new,) = _replica_actor_names()
    assert new != old  # the controller replaced the killed replica
    retried = sum(a > 1 for a in attempts)
    line = (f"replica killed with {in_flight} requests outstanding: {retried} retried, all "
            f"{total} succeeded, {recovered_s:.1f}s after the kill")  # fmt: skip
    print(f"\n{line}")
    record_property("failover", line)
    assert retried > 0  # the kill did hit requests
