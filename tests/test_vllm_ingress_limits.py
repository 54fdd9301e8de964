"""The vLLM app's request limits and error words (vllm_serving.limits, vllm_serving.refusals),
without Serve or vLLM: the checks directly, then the middleware in front of a plain FastAPI
app. The real app's answers to the same requests are in tests/test_vllm_app.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from pipeline.vllm_spec import request_args
from serving.errors import RequestError
from vllm_serving import limits as L
from vllm_serving import refusals as R
from vllm_serving.settings import DEFAULT_K, SPECULATION

ROOT = Path(__file__).resolve().parents[1]
OURS = L.ModelLimits("specbound", 1024, "ours", 4)
FIXED = L.ModelLimits("k2", 1024, "draft_model", 2)
PLAIN = L.ModelLimits("plain", 1024, "none", 0)
MODELS = {m.name: m for m in (OURS, FIXED, PLAIN)}
COMPLETION = {"model": "specbound", "prompt": "def f(x):", "max_tokens": 4}
CHAT = {"model": "specbound", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def refused(route: str, body: dict, limits: L.ModelLimits = OURS) -> RequestError:
    with pytest.raises(RequestError) as info:
        L.check_request(route, body, limits)
    return info.value


# -- the limits and where they come from ------------------------------------------------------


def test_limits_follow_max_model_len_and_speculation():
    assert OURS.describe() == {
        "max_model_len": 1024,
        "max_n": 16,
        "max_choices": 16,
        "max_tokens": 1024,
        "max_output_tokens": 8 * 1024,
        "max_prompt_chars": 64 * 1024,
        "max_body_bytes": 16 * 4 * 64 * 1024 + (1 << 20),
        "vllm_xargs": {"speculation": ["on", "off"], "max_draft_tokens": [0, 4]},
    }
    assert FIXED.describe()["vllm_xargs"] == {} == PLAIN.describe()["vllm_xargs"]
    assert set(L.SCHEDULED) <= set(SPECULATION)
    assert L.MAX_N == 16  # as the research endpoint's
    json.dumps(OURS.describe())  # /v1/models carries it as JSON


def test_model_limits_from_ray_model_cards_and_the_apps_speculation():
    cards = {
        "specbound": {"metadata": {"max_request_context_length": 2048}},
        "plain": {"metadata": {"max_request_context_length": 512}},
    }
    speculation = {"specbound": {"speculation": "ours", "k": DEFAULT_K["ours"]}}
    got = R.model_limits(cards, speculation)
    assert got["specbound"] == L.ModelLimits("specbound", 2048, "ours", DEFAULT_K["ours"])
    assert got["plain"] == L.ModelLimits("plain", 512, "none", 0)
    with pytest.raises(ValueError, match="no max_model_len"):
        R.model_limits({"x": {"metadata": {}}}, None)


def test_the_prompt_character_bound_is_safe_for_the_embedded_target():
    """No prompt this bound refuses fits the context: no token of the target's vocabulary is
    longer than CHARS_PER_TOKEN characters (counted as vLLM counts max_chars_per_token)."""
    vocab = json.loads((ROOT / "models" / "target" / "tokenizer.json").read_text())["model"]
    longest = max(len(token) for token in vocab["vocab"])
    assert longest <= L.CHARS_PER_TOKEN, longest


# -- the body ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"", "it is empty"),
        (b"  \n", "it is empty"),
        (b"{not json", "not valid JSON: Expecting property name"),
        (b"[1, 2]", "got an array"),
        (b'"text"', "got a string"),
        (b"null", "got null"),
        (b"3", "got a number"),
        (b'{"n": NaN}', "NaN is not valid JSON"),
        (b"\xff\xfe{}", "not valid UTF-8"),
    ],
)
def test_a_body_that_is_not_a_json_object(raw, words):
    with pytest.raises(RequestError) as info:
        R.parse_body(raw)
    assert info.value.message.startswith("the body must be a JSON object")
    assert words in info.value.message and info.value.status == 400


def test_the_model():
    assert R.resolve_model({"model": "k2"}, MODELS) is FIXED
    assert R.resolve_model({}, {"specbound": OURS}) is OURS  # the only one
    with pytest.raises(RequestError, match="model is required: this app serves k2, plain"):
        R.resolve_model({}, MODELS)
    with pytest.raises(RequestError) as info:
        R.resolve_model({"model": "nope"}, MODELS)
    err = info.value
    assert (err.status, err.kind, err.code, err.param) == (
        404,
        "not_found_error",
        "model_not_found",
        "model",
    )
    assert '"nope"' in err.message and "specbound" in err.message
    with pytest.raises(RequestError, match="model must be a string, got 3"):
        R.resolve_model({"model": 3}, MODELS)


# -- types: a boolean is not an integer -------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "field", "value", "words"),
    [
        ("completions", "max_tokens", True, "max_tokens must be an integer, got true"),
        ("completions", "max_tokens", "5", 'max_tokens must be an integer, got "5"'),
        ("completions", "max_tokens", 4.0, "max_tokens must be an integer, got 4.0"),
        ("completions", "n", False, "n must be an integer, got false"),
        ("completions", "seed", True, "seed must be an integer, got true"),
        ("completions", "logprobs", True, "logprobs must be an integer, got true"),
        ("chat", "max_completion_tokens", True, "max_completion_tokens must be an integer"),
        ("chat", "n", True, "n must be an integer, got true"),
        ("chat", "top_logprobs", True, "top_logprobs must be an integer"),
        ("chat", "temperature", True, "temperature must be a number, got true"),
        ("completions", "top_p", "1", 'top_p must be a number, got "1"'),
    ],
)
def test_integer_and_number_fields_take_only_json_numbers(route, field, value, words):
    body = {**(COMPLETION if route == "completions" else CHAT), field: value}
    err = refused(route, body)
    assert err.message == words or err.message.startswith(words)
    assert (err.param, err.code, err.status) == (field, "invalid_type", 400)


def test_chat_logprobs_is_a_boolean_and_nulls_are_vllms_defaults():
    L.check_request("chat", {**CHAT, "logprobs": True, "seed": None, "n": None}, OURS)
    L.check_request("completions", {**COMPLETION, "max_tokens": None, "seed": 7}, OURS)


# -- the limits -------------------------------------------------------------------------------


def test_n():
    assert refused("completions", {**COMPLETION, "n": 0}).message == "n must be at least 1, got 0"
    err = refused("chat", {**CHAT, "n": 17})
    assert err.message == "n must be at most 16 (max_n), got 17"
    assert (err.param, err.code) == ("n", "max_n")
    L.check_request("chat", {**CHAT, "n": 16}, OURS)


def test_max_tokens_per_choice():
    err = refused("completions", {**COMPLETION, "max_tokens": 5000})
    assert err.message == (
        "max_tokens must be at most 1024 (max_tokens: the model's max_model_len), got 5000"
    )
    assert (err.param, err.code) == ("max_tokens", "max_tokens")
    err = refused("chat", {**CHAT, "max_tokens": None, "max_completion_tokens": 0})
    assert err.message == "max_completion_tokens must be at least 1, got 0"
    assert refused("completions", {**COMPLETION, "max_tokens": -1}).param == "max_tokens"
    # echo with max_tokens 0 scores the prompt (vLLM generates nothing)
    L.check_request("completions", {**COMPLETION, "max_tokens": 0, "echo": True}, OURS)
    err = refused("chat", {**CHAT, "max_tokens": 3, "max_completion_tokens": 5})
    assert "differs from max_tokens 3" in err.message


def test_n_times_max_tokens():
    L.check_request("completions", {**COMPLETION, "n": 8, "max_tokens": 1024}, OURS)
    err = refused("completions", {**COMPLETION, "n": 9, "max_tokens": 1024})
    assert err.message == (
        "n x max_tokens is 9 x 1024 = 9216 tokens, over the limit of 8192 (max_output_tokens); "
        "ask for at most 910 tokens per choice"
    )
    assert (err.param, err.code) == ("max_tokens", "max_output_tokens")
    # chat without a token limit: vLLM's cap is max_model_len minus the prompt
    err = refused("chat", {**CHAT, "max_tokens": None, "n": 9})
    assert "9 x 1024 (max_tokens absent: up to max_model_len)" in err.message
    err = refused("chat", {**CHAT, "max_tokens": None, "max_completion_tokens": 1000, "n": 9})
    assert err.param == "max_completion_tokens"
    L.check_request("chat", {**CHAT, "max_tokens": None, "n": 8}, OURS)
    # a completion without max_tokens makes vLLM's default, 16 tokens
    L.check_request("completions", {**COMPLETION, "max_tokens": None, "n": 16}, OURS)


def test_prompts_times_n():
    body = {**COMPLETION, "prompt": ["a", "b", "c", "d"], "n": 4, "max_tokens": 500}
    L.check_request("completions", body, OURS)
    err = refused("completions", {**body, "n": 5})
    assert "n x prompts is 5 x 4 = 20 choices, over the limit of 16 (max_choices)" in err.message
    err = refused("completions", {**body, "max_tokens": 600})
    assert "n x prompts x max_tokens is 4 x 4 x 600 = 9600 tokens" in err.message
    # token ids are one prompt; a list of them is several
    L.check_request("completions", {**COMPLETION, "prompt": [1, 2, 3], "n": 16}, OURS)
    err = refused("completions", {**COMPLETION, "prompt": [[1]] * 17})
    assert err.code == "max_choices"


def test_prompt_length():
    L.check_request("completions", {**COMPLETION, "prompt": "x" * 65536}, OURS)
    err = refused("completions", {**COMPLETION, "prompt": "x" * 65537})
    assert err.message == (
        "prompt is 65537 characters, over the limit of 65536 (max_prompt_chars: 64 per "
        "token of max_model_len 1024)"
    )
    assert (err.param, err.code) == ("prompt", "context_length_exceeded")
    err = refused("completions", {**COMPLETION, "prompt": ["ok", "x" * 70000]})
    assert err.param == "prompt[1]"
    messages = [{"role": "user", "content": "x" * 40000}, {"role": "user", "content": "y" * 30000}]
    err = refused("chat", {**CHAT, "messages": messages})
    assert err.param == "messages" and "70000 characters of text" in err.message
    parts = [{"role": "user", "content": [{"type": "text", "text": "x" * 70000}]}]
    assert refused("chat", {**CHAT, "messages": parts}).param == "messages"
    # token ids: exact, with max_tokens (vLLM's default 16 when absent)
    L.check_request("completions", {**COMPLETION, "prompt": [5] * 1020}, OURS)
    err = refused("completions", {**COMPLETION, "prompt": [5] * 1021})
    assert err.message == (
        "prompt has 1021 tokens; with max_tokens 4 that is more than the model's "
        "max_model_len of 1024 tokens"
    )
    body = {**COMPLETION, "prompt": [5] * 1010, "max_tokens": None}
    assert refused("completions", body).code == "context_length_exceeded"


@pytest.mark.parametrize(
    ("prompt", "param", "words"),
    [
        (None, "prompt", "'prompt' is required"),
        ("", "prompt", "must not be empty"),
        ([], "prompt", "must not be empty"),
        ([1, True], "prompt[1]", "expected a token id (integer), got bool True"),
        (["a", 3], "prompt[1]", "all prompts of one kind"),
        ({"text": "a"}, "prompt", "expected a string"),
    ],
)
def test_bad_prompts_are_named(prompt, param, words):
    body = {**COMPLETION, "prompt": prompt}
    err = refused("completions", body)
    assert err.param == param and words in err.message


def test_bad_messages_are_named():
    assert refused("chat", {"model": "specbound"}).message == "'messages' is required"
    assert "got an empty array" in refused("chat", {**CHAT, "messages": []}).message
    assert refused("chat", {**CHAT, "messages": ["hi"]}).param == "messages[0]"


# -- per-request speculation ------------------------------------------------------------------


def test_vllm_xargs_speculation_keys():
    for xargs in (
        {"speculation": "off"},
        {"speculation": "on", "max_draft_tokens": 4},
        {"max_draft_tokens": 0},
        {},
    ):
        L.check_request("completions", {**COMPLETION, "vllm_xargs": xargs}, OURS)
    assert request_args.REQUEST_ARGS == (L.SPECULATION_ARG, L.MAX_DRAFT_ARG)


@pytest.mark.parametrize(
    ("xargs", "param", "words"),
    [
        ({"speculation": "maybe"}, "vllm_xargs.speculation", "must be one of 'on', 'off'"),
        ({"speculation": True}, "vllm_xargs.speculation", "got true"),
        ({"max_draft_tokens": 5}, "vllm_xargs.max_draft_tokens", "from 0 to 4, got 5"),
        ({"max_draft_tokens": -1}, "vllm_xargs.max_draft_tokens", "from 0 to 4, got -1"),
        ({"max_draft_tokens": True}, "vllm_xargs.max_draft_tokens", "got true"),
        ({"max_draft_tokens": 2.0}, "vllm_xargs.max_draft_tokens", "got 2.0"),
        ({"max_draft_tokens": "2"}, "vllm_xargs.max_draft_tokens", 'got "2"'),
        ({"draft": 2}, "vllm_xargs.draft", "not a key this app takes"),
        ("off", "vllm_xargs", "vllm_xargs must be a JSON object"),
    ],
)
def test_bad_vllm_xargs(xargs, param, words):
    err = refused("completions", {**COMPLETION, "vllm_xargs": xargs})
    assert err.param == param and words in err.message and err.status == 400


@pytest.mark.parametrize("model", [FIXED, PLAIN])
def test_vllm_xargs_on_a_model_without_the_scheduler(model):
    err = refused("chat", {**CHAT, "vllm_xargs": {"speculation": "off"}}, model)
    assert err.param == "vllm_xargs.speculation"
    assert f"speculation {model.speculation}) fixes its speculation" in err.message


# -- vLLM's and Ray Serve's errors in the client's words --------------------------------------


@pytest.mark.parametrize(
    ("raw", "message", "param"),
    [
        (
            "max_tokens must be at least 1, got -1. (parameter=max_tokens, value=-1)",
            "max_tokens must be at least 1, got -1.",
            "max_tokens",
        ),
        (
            "Message: max_tokens must be at least 1, got -1. (parameter=max_tokens, value=-1) "
            "(Request ID: 9f2c), Internal exception: ray.llm._internal.serve.core ... "
            "(Request ID: 9f2c), original exception: BadRequestError",
            "max_tokens must be at least 1, got -1.",
            "max_tokens",
        ),
        (
            "temperature must be in [0, 2], got 3.0.",
            "temperature must be in [0, 2], got 3.0.",
            "temperature",
        ),
        (
            "n must be at most 16384, got 20000. To increase this limit, set the "
            "VLLM_MAX_N_SEQUENCES environment variable.",
            "n must be at most 16384, got 20000.",
            "n",
        ),
        (
            "Token id 999999 is out of vocabulary (parameter=prompt)",
            "Token id 999999 is out of vocabulary",
            "prompt",
        ),
        ("Token id 999999 is out of vocabulary", "Token id 999999 is out of vocabulary", "prompt"),
        (
            "This model's maximum context length is 1024 tokens. (parameter=input_tokens, "
            "value=2000)",
            "This model's maximum context length is 1024 tokens.",
            "prompt",
        ),
        ("Internal Server Error (Request ID: 1)", "Internal Server Error", None),
        (
            'Traceback (most recent call last):\n  File "x.py"',
            "the engine refused the request",
            None,
        ),
        ("", "the engine refused the request", None),
        ("no route GET /v1/nothing", "no route GET /v1/nothing", None),
    ],
)
def test_clean_message(raw, message, param):
    assert R.clean_message(raw) == (message, param)


def test_clean_message_names_the_chat_prompt_messages():
    raw = "prompt too long (parameter=input_text, value=99999)"
    assert R.clean_message(raw, chat=True) == ("prompt too long", "messages")


def test_error_kinds():
    assert [R.kind_of(s) for s in (400, 404, 408, 413, 429, 500, 504)] == [
        "invalid_request_error",
        "not_found_error",
        "timeout_error",
        "invalid_request_error",
        "rate_limit_error",
        "server_error",
        "timeout_error",
    ]


# -- the middleware in front of a plain app ---------------------------------------------------


@pytest.fixture
def client():
    app = FastAPI()
    seen: list[dict] = []

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def generate(request: Request) -> dict:
        body = await request.json()
        seen.append(body)
        return {"ok": True}

    @app.post("/other")
    async def other(request: Request) -> dict:
        return {"raw": (await request.body()).decode()}

    R.install_limits(app)
    R.set_models(MODELS)
    with TestClient(app) as c:
        c.seen = seen
        yield c
    R.set_models({})


def test_middleware_hands_a_good_body_on_unchanged(client):
    r = client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200 and client.seen == [COMPLETION]
    r = client.post("/v1/chat/completions", json={**CHAT, "model": "plain"})
    assert r.status_code == 200
    # other routes pass untouched, whatever their body
    assert client.post("/other", content=b"not json").json() == {"raw": "not json"}


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "words"),
    [
        ("/v1/completions", b"{not json", 400, None, "the body must be a JSON object"),
        ("/v1/completions", b"", 400, None, "the body must be a JSON object; it is empty"),
        ("/v1/completions", {**COMPLETION, "max_tokens": True}, 400, "max_tokens", "integer"),
        ("/v1/completions", {**COMPLETION, "model": "nope"}, 404, "model", '"nope"'),
        ("/v1/chat/completions", {**CHAT, "n": 17}, 400, "n", "max_n"),
        (
            "/v1/chat/completions",
            {**CHAT, "vllm_xargs": {"max_draft_tokens": 9}},
            400,
            "vllm_xargs.max_draft_tokens",
            "from 0 to 4",
        ),
    ],
)
def test_middleware_refuses_in_openais_shape(client, caplog, path, body, status, param, words):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        r = client.post(path, headers={"Content-Type": "application/json"}, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert client.seen == []  # refused before the route
    lines = [rec for rec in caplog.records if rec.name == "ray.serve"]
    assert len(lines) == 1 and lines[0].exc_info is None
    assert f"client error {status} POST {path}" in lines[0].getMessage()


def test_middleware_refuses_a_body_over_its_limit(client):
    too_big = OURS.max_body_bytes + 1
    r = client.post("/v1/completions", content=b" " * too_big)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert "max_body_bytes" in r.json()["error"]["message"]
