"""The Serve endpoint over real HTTP on the embedded models: the openai client (completion and
stream), greedy output of every registered policy equal to plain greedy decoding, sampling that
follows seed and top_p, /v1/models and /healthz, a matrix of bad inputs (each a 4xx JSON error
naming the problem), a bounded load test whose seeded texts are the library's for each seed,
and a replica killed under load with retrying clients losing nothing. Also, without Ray: the
incremental decoder against plain greedy decoding (and its own decoded tokens), cancellation
between steps, and serve_config.yaml as a Serve config.

Timing: no assertion depends on how fast the machine is. The port is held until the proxy
binds it; the disconnect test runs a generation far longer than a disconnect takes to arrive;
the replica is killed while a streamed generation is known to be running; deadlines are
liveness bounds, generous enough for a loaded 2-core machine."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import yaml

from pipeline.data.domains import load_prompts
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.artifacts import load_artifacts
from pipeline.decode.policies.registry import POLICIES, make_policy
from pipeline.decode.types import SamplingConfig
from pipeline.models.loading import REPO_ROOT
from serving.speculation import default_spec
from tests.serving_support import ids as _ids
from tests.serving_support import one_thread_pair, serve_apps
from tests.serving_support import plain_greedy as _plain_greedy
from tests.test_policy_registry import out_of_range, wrong_type

APP_NAME = "specbound-test"
# Large enough that a max_tokens generation runs for seconds (the disconnect test).
MAX_TOKENS_LIMIT = 1024
PROMPTS = ["class Stack:\n    def push(self, item):\n        ", "The quick brown fox"]
TINY_TOP_P = 1e-9  # keeps only the most likely token: sampling becomes greedy decoding


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """OpenAI's stop rule: the text before the first stop string; whether one occurred."""
    cuts = [text.find(s) for s in stops if s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


@pytest.fixture(scope="module")
def pair():
    with one_thread_pair() as p:
        yield p


@pytest.fixture(scope="module")
def server() -> str:
    """A fresh local Ray cluster with the app on a free port; its base URL."""
    from jobs.cli import init_ray

    apps = [(APP_NAME, "/", {"max_tokens_limit": MAX_TOKENS_LIMIT, "num_cpus": 1})]
    with serve_apps(apps, lambda: init_ray(num_cpus=2)) as base:
        yield base


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=120)


def _post(server: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{server}/v1/completions", json=body, timeout=timeout)


def _timed_post(server: str, body: dict) -> tuple[dict, float]:
    """The 200 response body and the request's wall time at the client (ms)."""
    started = time.perf_counter()
    r = _post(server, body)
    elapsed_ms = (time.perf_counter() - started) * 1e3
    assert r.status_code == 200, r.text
    return r.json(), elapsed_ms


def _check_stats(stats: dict, completion_tokens: int, spec, elapsed_ms: float) -> None:
    """What the engine guarantees of a response's statistics (means are rounded to 4 places):
    every step commits its accepted tokens plus one, so at least one token, and no step starts
    once max_tokens are in; a step verifies drafted + 1 positions, each choosing top_k experts
    per MoE layer, so a layer's union holds between top_k and min(E, top_k (drafted + 1))
    experts (the mean of that bound over steps is at most the bound at the mean drafted, the
    bound being concave); the timed forwards run inside the request."""
    steps, eps = stats["steps"], 1e-3
    assert 1 <= steps <= completion_tokens, stats
    assert stats["tokens_per_step"] == pytest.approx(stats["accepted_per_step"] + 1, abs=eps)
    assert steps * stats["tokens_per_step"] >= completion_tokens - steps * eps, stats
    assert 0 <= stats["accepted_per_step"] <= stats["drafted_per_step"] + eps, stats
    high = min(spec.num_experts, spec.top_k * (stats["drafted_per_step"] + 1))
    assert spec.top_k - eps <= stats["unique_experts_per_step"] <= high + eps, stats
    assert stats["verify_ms"] > 0 and stats["draft_ms"] >= 0, stats
    assert stats["draft_ms"] + stats["verify_ms"] <= elapsed_ms, (stats, elapsed_ms)


# --- without Ray ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "knobs", "sampling", "stop"),
    [
        ("fixed", {"k": 4}, SamplingConfig(0.0), None),
        ("tree", {}, SamplingConfig(0.0), ["\n\n", "return"]),
        ("fixed", {"k": 2}, SamplingConfig(1.0, TINY_TOP_P), ["  "]),
        ("fixed", {"k": 2}, SamplingConfig(1.0, 0.9), ["  "]),
    ],
    ids=["greedy-fixed", "greedy-tree-stops", "tiny-top-p-stop", "sampled-stop"],
)
def test_incremental_decoder_against_plain_greedy(pair, policy, knobs, sampling, stop):
    """The streamed deltas join to the result's text; that text is the result's own tokens
    decoded and cut at the first stop string (so no delta ever held text a stop string later
    removed: deltas cannot be taken back); and where the output is greedy (T = 0, or a top_p
    that keeps one token) the tokens are plain greedy decoding's, the text its text cut at the
    first stop. A sampled run has no independent reference beyond its own tokens."""
    engine, tok = SpeculativeEngine(pair), pair.tokenizer
    stops, n = stop or [], 24
    greedy = sampling.greedy or sampling.top_p == TINY_TOP_P
    stopped_somewhere = False
    for text in [*PROMPTS, load_prompts("humaneval", 1)[0].text]:
        gen = engine.stream(_ids(pair, text), make_policy(policy, **knobs), n, sampling, 5, stop)
        deltas = list(gen.deltas())
        result = gen.result
        assert all(deltas) and "".join(deltas) == result.text
        assert not any(s in result.text for s in stops)
        own_text, stopped = _cut(tok.decode(result.tokens), stops)
        assert result.text == own_text
        assert (result.finish_reason == "stop") == stopped, result.finish_reason
        stopped_somewhere |= stopped
        if not stopped:
            ends_at_eos = result.tokens[-1] == tok.eos_token_id
            assert len(result.tokens) == n or ends_at_eos
            assert result.finish_reason == ("eos" if ends_at_eos else "length")
        if greedy:
            ref_tokens, ref_text = _plain_greedy(pair, text, n)
            assert result.tokens == ref_tokens[: len(result.tokens)]
            assert result.text == _cut(ref_text, stops)[0]
            if not stopped:
                assert result.tokens == ref_tokens
    if stop and greedy:
        assert stopped_somewhere, "no prompt reached a stop string: the hold-back went untested"


def test_a_cancelled_stream_stops_before_its_next_step(pair):
    """``cancelled()`` is polled before every step: once it is true no further step runs, the
    generation ends "cancelled", and the deltas still join to its text (the mechanism behind
    the endpoint's client-disconnect handling, without its timing)."""
    engine = SpeculativeEngine(pair)
    gen = engine.stream(_ids(pair, PROMPTS[0]), make_policy("fixed", k=2), 64)
    polls, cancel = [0], [False]

    def cancelled() -> bool:
        polls[0] += 1
        return cancel[0]

    deltas = gen.deltas(cancelled)
    first = next(deltas)
    steps_run = polls[0]  # one poll before each step that ran
    cancel[0] = True
    rest = list(deltas)
    result = gen.result
    assert result.finish_reason == "cancelled"
    assert len(result.steps) == steps_run and polls[0] == steps_run + 1
    assert len(result.tokens) == sum(s.new_tokens for s in result.steps) < 64
    assert "".join([first, *rest]) == result.text


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
def test_auth_is_off_by_default(server):
    """Without `api_key` the server takes any or no Authorization header (the robust tests
    run one with a key)."""
    for headers in ({}, {"Authorization": "Bearer anything"}):
        r = httpx.get(f"{server}/v1/models", headers=headers, timeout=30)
        assert r.status_code == 200, r.text


@pytest.mark.slow
def test_openai_client_completion_and_stream(client, pair):
    model = client.models.list().data[0].id
    kwargs = {"model": model, "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0}
    started = time.perf_counter()
    done = client.completions.create(**kwargs)
    elapsed_ms = (time.perf_counter() - started) * 1e3
    text = done.choices[0].text
    ref_tokens, ref_text = _plain_greedy(pair, PROMPTS[0], 24)
    assert text == ref_text and done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == len(ref_tokens)
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    stats = done.model_extra["speculation"]
    assert stats["policy"] == "throughput" and stats["knobs"] == {}  # the default
    assert 0 < stats["drafted_per_step"] <= 12  # it speculates on code, at most max_k a step
    _check_stats(stats, done.usage.completion_tokens, pair.spec, elapsed_ms)

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
def test_stop_string_ends_text_and_stream_alike(client, pair):
    kwargs = {
        "model": "specbound",
        "prompt": PROMPTS[0],
        "max_tokens": 32,
        "temperature": 0,
        "stop": ["return", "xyz"],
    }
    done = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert done.choices[0].finish_reason == "stop" == chunks[-1].choices[0].finish_reason
    expected, stopped = _cut(_plain_greedy(pair, PROMPTS[0], 32)[1], ["return", "xyz"])
    assert stopped and done.choices[0].text == expected
    assert "".join(c.choices[0].text for c in chunks) == done.choices[0].text


@pytest.mark.slow
def test_client_disconnect_stops_the_generation(server):
    """The abandoned generation is counted cancelled, never completed. Timing margin, not a
    race: it would run MAX_TOKENS_LIMIT plain steps (about 10 s on this 2-core machine, 256
    take 3 s) while the disconnect reaches the replica in milliseconds; that a cancelled
    generation runs no further step is test_a_cancelled_stream_stops_before_its_next_step."""
    before = httpx.get(f"{server}/healthz", timeout=30).json()["generations"]
    body = {
        "prompt": PROMPTS[0],
        "max_tokens": MAX_TOKENS_LIMIT,
        "temperature": 0,
        "stream": True,
        "speculation": {"policy": "ar"},
    }
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")  # the first delta: it is running
    deadline = time.monotonic() + 120  # liveness only
    while True:
        now = httpx.get(f"{server}/healthz", timeout=30).json()["generations"]
        if now["cancelled"] > before["cancelled"]:
            break
        assert now["completed"] == before["completed"], "the abandoned generation ran to the end"
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.mark.slow
def test_sampling_follows_seed_and_top_p(server, pair):
    """A server that ignored temperature, seed or top_p would fail: the same seed reproduces
    the text, and it is the library's sample for that seed; different seeds give different
    texts (here, for these seeds: a fixed outcome, not a chance); a top_p that keeps only the
    most likely token turns sampling into greedy decoding."""
    engine, ids = SpeculativeEngine(pair), _ids(pair, PROMPTS[0])

    def http(seed: int, top_p: float) -> str:
        body = {
            "prompt": PROMPTS[0],
            "max_tokens": 16,
            "temperature": 1.0,
            "top_p": top_p,
            "seed": seed,
        }
        r = _post(server, body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    texts = {}
    for seed in (1, 2, 3):
        texts[seed] = http(seed, 0.9)
        # The server's default policy (the request names none), decoded by the library.
        mode = SamplingConfig(1.0, 0.9)
        name, knobs = default_spec(load_artifacts(), mode.temperature)
        priced = load_artifacts().for_sampling(mode)  # the prices of the request's mode
        library = engine.generate(ids, make_policy(name, priced, **knobs), 16, mode, seed=seed)
        assert texts[seed] == library.text, seed
    assert http(1, 0.9) == texts[1]
    assert len(set(texts.values())) > 1, texts
    greedy = _plain_greedy(pair, PROMPTS[0], 16)[1]
    assert greedy not in texts.values()
    assert [http(seed, TINY_TOP_P) for seed in (1, 2)] == [greedy, greedy]


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
    ("prompt-int", {"prompt": 5}, 400, "expected a string", "prompt"),
    ("lone-surrogate", b'{"prompt": "a\\ud800b"}', 400, "surrogate", "prompt"),
    ("max-tokens-string", {"prompt": "x", "max_tokens": "5"}, 400, "valid integer", "max_tokens"),
    ("max-tokens-float", {"prompt": "x", "max_tokens": 5.5}, 400, "valid integer", "max_tokens"),
    ("max-tokens-zero", {"prompt": "x", "max_tokens": 0}, 400, ">= 1", "max_tokens"),
    ("max-tokens-negative", {"prompt": "x", "max_tokens": -1}, 400, ">= 1", "max_tokens"),
    (
        "max-tokens-over-limit",
        {"prompt": "x", "max_tokens": 100000},
        400,
        f"<= {MAX_TOKENS_LIMIT}",
        "max_tokens",
    ),
    (
        "prompt-too-long",
        {"prompt": LONG_PROMPT, "max_tokens": 16},
        400,
        "context of 2048",
        "prompt",
    ),
    (
        "temperature-negative",
        {"prompt": "x", "temperature": -1},
        400,
        "greater than or equal",
        "temperature",
    ),
    ("top-p-zero", {"prompt": "x", "top_p": 0}, 400, "greater than 0", "top_p"),
    ("top-p-two", {"prompt": "x", "top_p": 2}, 400, "less than or equal to 1", "top_p"),
    ("stream-string", {"prompt": "x", "stream": "yes"}, 400, "valid boolean", "stream"),
    ("stop-int", {"prompt": "x", "stop": 3}, 400, "stop", "stop"),
    ("too-many-stops", {"prompt": "x", "stop": list("abcde")}, 400, "at most 4", "stop"),
    ("unknown-field", {"prompt": "x", "promt": "y"}, 400, "unsupported field 'promt'", "promt"),
    (
        "unsupported-openai-field",
        {"prompt": "x", "logprobs": 3},
        400,
        "logprobs: not supported",
        "logprobs",
    ),
    ("wrong-model", {"prompt": "x", "model": "gpt-4"}, 404, "'gpt-4' does not exist", "model"),
    (
        "unknown-policy",
        {"prompt": "x", "speculation": {"policy": "magic"}},
        400,
        "unknown policy 'magic'",
        "speculation",
    ),
    (
        "speculation-not-object",
        {"prompt": "x", "speculation": "fixed"},
        400,
        "speculation",
        "speculation",
    ),
    (
        "fixed-k-zero",
        {"prompt": "x", "speculation": {"policy": "fixed", "k": 0}},
        400,
        "k must be >= 1",
        "speculation",
    ),
    (
        "fixed-k-huge",
        {"prompt": "x", "speculation": {"policy": "fixed", "k": 10000}},
        400,
        "'k' = 10000 is too large",
        "speculation.k",
    ),
    (
        "fixed-k-float",
        {"prompt": "x", "speculation": {"policy": "fixed", "k": 2.5}},
        400,
        "'k' must be an integer",
        "speculation.k",
    ),
    (
        "unknown-knob",
        {"prompt": "x", "speculation": {"policy": "fixed", "kk": 3}},
        400,
        "'kk'",
        "speculation",
    ),
    (
        "knob-named-like-a-parameter",
        {"prompt": "x", "speculation": {"policy": "fixed", "name": "tree"}},
        400,
        "unknown knob 'name'",
        "speculation.name",
    ),
    (
        "knob-list",
        {"prompt": "x", "speculation": {"policy": "tree", "depth": [3]}},
        400,
        "'depth' must be a number",
        "speculation.depth",
    ),
    ("oversized-body", {"prompt": "x" * (1 << 20)}, 413, "limit", None),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "status", "keyword", "param"),
    [b[1:] for b in BAD_INPUTS],
    ids=[b[0] for b in BAD_INPUTS],
)
def test_bad_input_is_a_4xx_json_error(server, body, status, keyword, param):
    if isinstance(body, bytes):
        r = httpx.post(
            f"{server}/v1/completions",
            content=body,
            timeout=60,
            headers={"content-type": "application/json"},
        )
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


# Knobs sent through the speculation field beside every policy's defaults.
HTTP_KNOB_CASES = [("fixed", {"k": 4}), ("tree", {"depth": 3, "branch": 2, "gamma": 6})]


@pytest.mark.slow
def test_every_listed_policy_answers_with_plain_greedy_text(server, pair):
    """Every policy the server lists at its defaults, the cost-aware ones (ecospec,
    ecospec-global, marginal, cascade) on the artifacts committed under models/, and the
    HTTP_KNOB_CASES, answers 200 at T = 0 with plain greedy decoding's text, its token counts
    and consistent statistics: a broken artifact loader is a failure here, not a tolerated
    500."""
    names = httpx.get(f"{server}/v1/models", timeout=30).json()["data"][0]["policies"]
    assert set(names) == set(POLICIES)
    for prompt in PROMPTS:
        ref_tokens, ref_text = _plain_greedy(pair, prompt, 16)
        for name, knobs in [*((name, {}) for name in names), *HTTP_KNOB_CASES]:
            out, elapsed_ms = _timed_post(
                server,
                {
                    "prompt": prompt,
                    "max_tokens": 16,
                    "temperature": 0,
                    "speculation": {"policy": name, **knobs},
                },
            )
            assert out["speculation"]["policy"] == name
            assert out["choices"][0]["text"].encode() == ref_text.encode(), (name, knobs, prompt)
            assert out["usage"]["completion_tokens"] == len(ref_tokens), (name, knobs)
            assert out["usage"]["prompt_tokens"] == len(_ids(pair, prompt)), (name, knobs)
            _check_stats(out["speculation"], len(ref_tokens), pair.spec, elapsed_ms)


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
    assert r.json() == {
        "error": {
            "message": "internal server error",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
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
def test_load_concurrent_clients(server, pair, record_property):
    """32 seeded T = 1 requests from 8 concurrent clients, so the replica decodes them
    continuously batched: every one answers 200 with the library's text for its seed, the
    server's default policy decoded alone in-process (a policy that decides from its own
    generation draws in a batch what it draws alone: tests/test_batched_decoding.py)."""
    clients, total = 8, 32
    bodies = [
        {"prompt": PROMPTS[i % 2], "max_tokens": 16, "temperature": 1.0, "seed": i}
        for i in range(total)
    ]

    def one(body: dict) -> tuple[int, float, str]:
        started = time.perf_counter()
        r = _post(server, body, timeout=180)
        text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
        return r.status_code, time.perf_counter() - started, text

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, bodies))
    wall = time.perf_counter() - started
    errors = [(status, text) for status, _, text in results if status != 200]
    assert not errors, errors
    engine = SpeculativeEngine(pair)
    for body, (_, _, text) in zip(bodies, results, strict=True):
        mode = SamplingConfig(body["temperature"])
        name, knobs = default_spec(load_artifacts(), mode.temperature)  # the requests name none
        assert name != "batch", "`batch` plans with its neighbours: name another policy here"
        library = engine.generate(
            _ids(pair, body["prompt"]),
            make_policy(name, load_artifacts().for_sampling(mode), **knobs),
            body["max_tokens"],
            mode,
            seed=body["seed"],
        )
        assert text == library.text, (body, text, library.text)
    p50, p99 = _percentiles([t for _, t, _ in results])
    line = (
        f"load: {total} requests, {clients} clients, max_tokens 16: {total / wall:.2f} req/s, "
        f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, 0 errors"
    )
    print(f"\n{line}")
    record_property("load", line)


def _replica_actor_names() -> list[str]:
    import ray

    from serving.app import DEPLOYMENT_NAME

    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::")
        and DEPLOYMENT_NAME in a["name"]
        and APP_NAME in a["name"]
    ]


class _StreamFailed(Exception):
    """A streamed completion that did not end with its final chunk and [DONE]."""


def _stream_text(server: str, body: dict, on_first_delta) -> str:
    """A streamed completion's text; ``on_first_delta()`` runs when the first text arrives.
    A non-200, an error event or a stream cut before its final chunk and [DONE] raises."""
    parts: list[str] = []
    finished = done = False
    with httpx.stream(
        "POST", f"{server}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        if r.status_code != 200:
            raise _StreamFailed(f"status {r.status_code}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise _StreamFailed(chunk["error"]["message"])
            parts.append(chunk["choices"][0]["text"])
            if len(parts) == 1:
                on_first_delta()
            finished = finished or chunk["choices"][0]["finish_reason"] is not None
    if not (finished and done):
        raise _StreamFailed("stream cut short")
    return "".join(parts)


@pytest.mark.slow
def test_killed_replica_loses_no_retried_request(server, pair, record_property):
    """The replica is killed while a streamed generation is known to run on it (its first
    delta has arrived, and its 256 plain steps take seconds, the kill milliseconds), with
    other requests queued behind it: that stream fails and every request, retried by its
    client until it succeeds, returns plain greedy decoding's text; a new replica serves.
    Deadlines are liveness bounds (a replica restart loads the models)."""
    import ray

    (old,) = _replica_actor_names()
    total, clients, deadline_s, probe_tokens = 16, 8, 300, 256
    attempts = [0] * total

    def with_retries(body: dict, count: list[int], i: int, first=None) -> str:
        deadline = time.monotonic() + deadline_s
        backoff = 0.25
        while True:
            count[i] += 1
            try:
                if first is not None and count[i] == 1:
                    return _stream_text(server, body, first)
                r = _post(server, body, timeout=120)
                if r.status_code == 200:
                    return r.json()["choices"][0]["text"]
                assert r.status_code >= 500, r.text  # a client error would be a real bug
            except (httpx.TransportError, _StreamFailed):
                pass
            assert time.monotonic() < deadline, f"request still failing after {deadline_s}s"
            time.sleep(backoff)
            backoff = min(backoff * 2, 4.0)

    in_flight: list[int] = []
    killed_at: list[float] = []

    def kill() -> None:  # the probe's generation is running on the replica now
        in_flight.append(sum(not f.done() for f in futures))
        ray.kill(ray.get_actor(old, namespace="serve"), no_restart=True)
        killed_at.append(time.monotonic())

    probe = {
        "prompt": PROMPTS[0],
        "max_tokens": probe_tokens,
        "temperature": 0,
        "speculation": {"policy": "ar"},
    }
    probe_attempts = [0]
    with ThreadPoolExecutor(clients) as pool:
        futures = [
            pool.submit(
                with_retries,
                {"prompt": PROMPTS[i % 2], "max_tokens": 16, "temperature": 0},
                attempts,
                i,
            )
            for i in range(total)
        ]
        probe_text = with_retries(probe, probe_attempts, 0, first=kill)
        texts = [f.result() for f in futures]
    recovered_s = time.monotonic() - killed_at[0]
    assert probe_attempts[0] > 1  # the stream running at the kill failed, then a retry passed
    assert probe_text == _plain_greedy(pair, PROMPTS[0], probe_tokens)[1]
    expected = [_plain_greedy(pair, p, 16)[1] for p in PROMPTS]
    assert texts == [expected[i % 2] for i in range(total)]
    (new,) = _replica_actor_names()
    assert new != old  # the controller replaced the killed replica
    retried = sum(a > 1 for a in attempts)
    line = (
        f"replica killed with {in_flight[0]} of {total} requests and a stream outstanding: "
        f"{retried} retried, all succeeded, {recovered_s:.1f}s after the kill"
    )
    print(f"\n{line}")
    record_property("failover", line)
