"""The request protocol without Ray or models: the prompt union and chat requests (each bad
input a 400 naming its item), the checks that need the model, chat rendering on the embedded
tokenizer (its template) and on one without a template (the documented fallback), the API-key
middleware on a real FastAPI app (also through the copy @serve.ingress freezes), and the
response bodies as the installed openai client parses them, over ASGI from a real app."""

from __future__ import annotations

import asyncio
import copy
import json

import httpx2
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.testclient import TestClient
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from pipeline.data.prompts import encode
from pipeline.models.loading import DEFAULT_DRAFT, DEFAULT_TARGET, load_tokenizer
from serving.auth import api_key, install_auth, set_api_key
from serving.chat import render_chat, render_chat_text
from serving.checks import check_lengths, check_token_ids, resolve_max_tokens
from serving.errors import RequestError, install_error_handlers
from serving.protocol import MAX_N, parse_chat_request, parse_request
from serving.responses import (
    chat_body,
    completion_choices_body,
    new_chat_id,
    new_completion_id,
    sse,
    usage,
)


def _refused(parse, body: dict) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse(body)
    assert info.value.status == 400
    return info.value


# --- /v1/completions: the prompt union, n, timeout_s ---------------------------------------


@pytest.mark.parametrize(
    ("prompt", "prompts", "params"),
    [
        ("hi", ["hi"], ["prompt"]),
        (["a", "b c"], ["a", "b c"], ["prompt[0]", "prompt[1]"]),
        ([5, 0, 7], [[5, 0, 7]], ["prompt"]),
        ([[1, 2], [3]], [[1, 2], [3]], ["prompt[0]", "prompt[1]"]),
    ],
    ids=["string", "strings", "token-ids", "lists-of-token-ids"],
)
def test_prompt_forms(prompt, prompts, params):
    req = parse_request({"prompt": prompt})
    assert req.prompts == prompts
    assert [req.prompt_param(i) for i in range(len(prompts))] == params


BAD_PROMPTS = [
    # prompt, param, keyword
    (5, "prompt", "expected a string, a list of strings"),
    (None, "prompt", "got NoneType"),
    ("", "prompt", "must not be empty"),
    ([], "prompt", "must not be empty"),
    (["a", ""], "prompt[1]", "must not be empty"),
    (["a", "b\ud800"], "prompt[1]", "surrogate"),
    (["a", 3], "prompt[1]", "like prompt[0]"),
    ([3, "a"], "prompt[1]", "token id"),
    ([1, True], "prompt[1]", "bool True"),
    ([True, 1], "prompt[0]", "bool True"),
    ([1, -2], "prompt[1]", ">= 0"),
    ([1, 2.0], "prompt[1]", "float"),
    ([[1], []], "prompt[1]", "must not be empty"),
    ([[1], [2, False]], "prompt[1][1]", "bool False"),
    ([[1], [2, -1]], "prompt[1][1]", ">= 0"),
    ([[1], 2], "prompt[1]", "like prompt[0]"),
    ([{"text": "a"}], "prompt[0]", "got dict"),
]


@pytest.mark.parametrize(("prompt", "param", "keyword"), BAD_PROMPTS)
def test_bad_prompts_name_the_item(prompt, param, keyword):
    err = _refused(parse_request, {"prompt": prompt})
    assert err.param == param
    assert err.message.startswith(f"{param}: ") and keyword in err.message, err.message


def test_missing_prompt():
    err = _refused(parse_request, {"max_tokens": 3})
    assert (err.param, err.message) == ("prompt", "'prompt' is required")


@pytest.mark.parametrize(
    ("body", "param", "keyword"),
    [
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"n": MAX_N + 1}, "n", f"less than or equal to {MAX_N}"),
        ({"n": 2.0}, "n", "valid integer"),
        ({"n": True}, "n", "valid integer"),
        ({"timeout_s": 0}, "timeout_s", "greater than 0"),
        ({"timeout_s": "5"}, "timeout_s", "valid number"),
        ({"stop": 3}, "stop", "a string or a list of strings"),
        ({"stop": ["a", None]}, "stop[1]", "expected a string"),
        ({"stop": list("abcde")}, "stop", "at most 4"),
        ({"logprobs": 2}, "logprobs", "not supported"),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
        ({"speculation": {"policy": 3}}, "speculation.policy", "valid string"),
        ({"promt": "x"}, "promt", "unsupported field 'promt'"),
    ],
)
def test_bad_completion_fields(body, param, keyword):
    err = _refused(parse_request, {"prompt": "x", **body})
    assert err.param == param and keyword in err.message, err.message


def test_completion_fields_accepted():
    req = parse_request(
        {
            "prompt": "x",
            "n": MAX_N,
            "timeout_s": 2,
            "stop": "\n",
            "seed": 3,
            "logit_bias": {},
            "best_of": 1,
            "echo": False,
        }
    )
    assert (req.n, req.timeout_s, req.stops, req.requested_max_tokens) == (MAX_N, 2.0, ["\n"], 16)
    assert parse_request({"prompt": "x"}).timeout_s is None


# --- /v1/chat/completions ------------------------------------------------------------------


def _chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "Hello"}], **fields}


def test_chat_request_forms():
    req = parse_chat_request(
        {
            "messages": [
                {"role": "system", "content": "Be terse."},
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "user", "content": "Hi", "name": "alice"},
                {"role": "assistant", "content": ""},
            ],
            "model": "specbound",
            "max_completion_tokens": 5,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "timeout_s": 1.5,
            "user": "u",
            # OpenAI's fields at their neutral values
            "logprobs": False,
            "top_logprobs": None,
            "frequency_penalty": 0,
            "presence_penalty": 0.0,
            "logit_bias": {},
            "response_format": {"type": "text"},
            "tools": [],
            "tool_choice": "none",
            "parallel_tool_calls": None,
        }
    )
    assert req.chat_messages == [
        {"role": "system", "content": "Be terse."},
        {"role": "developer", "content": "a\nb"},  # text parts joined with newlines
        {"role": "user", "content": "Hi", "name": "alice"},
        {"role": "assistant", "content": ""},
    ]
    assert (req.requested_max_tokens, req.max_tokens_param) == (5, "max_completion_tokens")
    assert (req.n, req.timeout_s, req.stream) == (2, 1.5, True)
    plain = parse_chat_request(_chat())
    assert plain.requested_max_tokens is None and plain.max_tokens_param == "max_tokens"
    assert parse_chat_request(_chat(max_tokens=7)).requested_max_tokens == 7
    both = parse_chat_request(_chat(max_tokens=7, max_completion_tokens=7))
    assert both.requested_max_tokens == 7


BAD_CHATS = [
    # body, param, keyword
    ({}, "messages", "'messages' is required"),
    ({"messages": []}, "messages", "at least one message"),
    ({"messages": "Hello"}, "messages", "valid list"),
    ({"messages": ["Hello"]}, "messages[0]", "valid dictionary"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "'messages[0].role' is required"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "'user'"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "is required"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "NoneType"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", "an empty list"),
    ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content", "surrogate"),
    (
        {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
        "messages[0].tool_calls",
        "unsupported field",
    ),
    (
        {"messages": [{"role": "user", "content": "x", "name": 3}]},
        "messages[0].name",
        "valid string",
    ),
    (
        {"messages": [{"role": "user", "content": ["x"]}]},
        "messages[0].content[0]",
        "content part object",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "a"},
                        {"type": "image_url", "image_url": {"url": "u"}},
                    ],
                }
            ]
        },
        "messages[0].content[1].type",
        "only 'text' parts",
    ),
    (
        {"messages": [{"role": "user", "content": [{"text": "a"}]}]},
        "messages[0].content[0].type",
        "'type' is missing",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content[0].text",
        "got nothing",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
        "messages[0].content[0].text",
        "int 1",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache": 1}]}]},
        "messages[0].content[0].cache",
        "unsupported field",
    ),
    (_chat(max_tokens=3, max_completion_tokens=4), "max_completion_tokens", "send one"),
    (_chat(max_tokens="3"), "max_tokens", "valid integer"),
    (_chat(logprobs=True), "logprobs", "not supported"),
    (_chat(top_logprobs=2), "top_logprobs", "not supported"),
    (_chat(tools=[{"type": "function"}]), "tools", "not supported"),
    (_chat(tool_choice="auto"), "tool_choice", "not supported"),
    (_chat(response_format={"type": "json_object"}), "response_format", "not supported"),
    (_chat(parallel_tool_calls=True), "parallel_tool_calls", "not supported"),
    (_chat(presence_penalty=1), "presence_penalty", "not supported"),
    (_chat(n=MAX_N + 1), "n", "less than or equal"),
    (_chat(timeout_s=-1), "timeout_s", "greater than 0"),
    (_chat(stop=[1]), "stop[0]", "expected a string"),
    (_chat(prompt="x"), "prompt", "unsupported field 'prompt'"),
    (_chat(functions=[]), "functions", "unsupported field"),
]


@pytest.mark.parametrize(("body", "param", "keyword"), BAD_CHATS)
def test_bad_chat_requests_name_the_field(body, param, keyword):
    err = _refused(parse_chat_request, body)
    assert err.param == param and keyword in err.message, err.message


# --- checks that need the model ------------------------------------------------------------


def test_token_ids_must_be_in_the_vocabulary():
    check_token_ids([0, 5, 299], 300, "prompt")
    with pytest.raises(RequestError) as info:
        check_token_ids([0, 300], 300, "prompt[2]")
    assert info.value.param == "prompt[2][1]"
    assert "token id 300 is out of range" in info.value.message
    assert "ids 0 to 299" in info.value.message


def test_lengths_name_the_request_fields():
    chat = parse_chat_request(_chat(max_completion_tokens=50))
    with pytest.raises(RequestError) as info:
        resolve_max_tokens(chat, 80, 100, 1000, 64, prompt_param="messages")
    assert info.value.param == "messages" and info.value.code == "context_length_exceeded"
    assert "max_completion_tokens is 50" in info.value.message
    assert resolve_max_tokens(chat, 50, 100, 1000, 64, prompt_param="messages") == 50
    # No limit in the request: the server's default, cut to what the context leaves.
    open_ended = parse_chat_request(_chat())
    assert resolve_max_tokens(open_ended, 10, 100, 1000, 64, "messages") == 64
    assert resolve_max_tokens(open_ended, 60, 100, 1000, 64, "messages") == 40
    assert resolve_max_tokens(open_ended, 60, 100, 20, 64, "messages") == 20
    with pytest.raises(RequestError, match="no room to generate"):
        resolve_max_tokens(open_ended, 100, 100, 1000, 64, "messages")
    with pytest.raises(RequestError) as info:
        check_lengths(5, 0, 100, 1000)
    assert info.value.param == "max_tokens"
    completion = parse_request({"prompt": ["a", "b"], "max_tokens": 8})
    with pytest.raises(RequestError) as info:
        resolve_max_tokens(completion, 0, 100, 1000, 64, completion.prompt_param(1))
    assert (info.value.param, info.value.message) == ("prompt[1]", "prompt[1] has no tokens")


# --- chat rendering ------------------------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Hello", "name": "alice"},
]


@pytest.fixture(scope="module")
def embedded_tokenizer():
    return load_tokenizer(DEFAULT_TARGET)


def test_render_chat_uses_the_embedded_template(embedded_tokenizer):
    tok = embedded_tokenizer
    assert tok.chat_template, "the embedded tokenizer lost its chat template"
    assert load_tokenizer(DEFAULT_DRAFT, "draft").chat_template == tok.chat_template
    text = render_chat_text(tok, MESSAGES)
    assert text == "### System\nBe terse.\n\n### User (alice)\nHello\n\n### Assistant\n"
    # The generation prompt (opening the assistant's turn) is what the template adds.
    bare = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert text == bare + "### Assistant\n"
    ids = render_chat(tok, MESSAGES)
    assert ids == encode(tok, text) and tok.decode(ids) == text
    assert tok.eos_token_id not in ids  # no special tokens: the tiny model knows none


def test_render_chat_falls_back_without_a_template(tokenizer):
    """``tokenizer`` (conftest), a real trained tokenizer, with its chat template removed."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = None
    text = render_chat_text(tokenizer, MESSAGES)
    assert text == "system: Be terse.\nuser (alice): Hello\nassistant:"
    assert render_chat(tokenizer, MESSAGES) == encode(tokenizer, text)


def test_a_template_that_refuses_is_a_400_naming_messages(embedded_tokenizer):
    tok = copy.deepcopy(embedded_tokenizer)
    tok.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(RequestError) as info:
        render_chat(tok, MESSAGES)
    assert (info.value.status, info.value.param) == (400, "messages")
    assert "roles must alternate" in info.value.message


# --- API keys ------------------------------------------------------------------------------


def _small_app(key_getter=None) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    install_auth(app, key_getter)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "me"}],
        }

    return app


def _frozen(app: FastAPI) -> FastAPI:
    """The copy @serve.ingress serves: the app pickled at decoration, as Serve does it."""
    from ray import cloudpickle
    from ray._common.serialization import pickle_dumps
    from ray.serve._private.utils import ensure_serialization_context

    ensure_serialization_context()
    frozen = cloudpickle.loads(pickle_dumps(app, error_msg="cannot pickle the app"))
    assert frozen is not app
    return frozen


@pytest.fixture
def process_key():
    """set_api_key's process-wide key, restored after the test."""
    before = api_key()
    yield set_api_key
    set_api_key(before)


def _check_401(response, message: str) -> None:
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert message in error["message"]


@pytest.mark.parametrize("via", ["process key", "key getter", "frozen copy"])
def test_api_key_required_when_set(process_key, via):
    if via == "key getter":
        app = _small_app(lambda: "s3cret")
    else:
        app = _small_app()
        if via == "frozen copy":
            app = _frozen(app)
        process_key("s3cret")  # as the replica's __init__ does, after the app exists
    client = TestClient(app)
    _check_401(client.get("/v1/models"), "missing API key")
    _check_401(client.get("/v1/models", headers={"Authorization": "Bearer nope"}), "invalid")
    _check_401(client.get("/v1/models", headers={"Authorization": "Basic s3cret"}), "missing")
    _check_401(client.get("/nowhere"), "missing")  # routes are not revealed either
    ok = client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "m"
    assert client.get("/v1/models", headers={"authorization": "bearer  s3cret"}).status_code == 200
    assert client.get("/healthz").status_code == 200  # probes carry no credentials


def test_no_key_no_auth(process_key):
    process_key(None)
    client = TestClient(_small_app())
    assert client.get("/v1/models").status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Bearer x"}).status_code == 200
    for bad in ("", "two words", "caf\u00e9"):
        with pytest.raises(ValueError, match="printable ASCII"):
            process_key(bad)


def test_openai_client_sends_the_key(process_key):
    process_key("s3cret")
    app = _small_app()

    async def go(key: str) -> list[str]:
        async with _openai(app, key) as client:
            return [m.id async for m in client.models.list()]

    assert asyncio.run(go("s3cret")) == ["m"]
    with pytest.raises(openai.AuthenticationError) as info:
        asyncio.run(go("wrong"))
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


# --- response bodies through the openai client ---------------------------------------------

SPEC = {"policy": "fixed", "knobs": {"k": 2}, "acceptance_rate": 0.5}
CHOICES = [
    {"index": 0, "text": "Hello", "finish_reason": "length"},
    {"index": 1, "text": "Wor", "finish_reason": "deadline"},
]
# A stream of two choices, interleaved as the lead's generation.stream sends them.
STREAM = [
    ({"index": 0, "text": "Hel", "finish_reason": None, "role_first": True}, None),
    ({"index": 1, "text": "Wor", "finish_reason": None, "role_first": True}, None),
    ({"index": 0, "text": "lo", "finish_reason": None, "role_first": False}, None),
    ({"index": 1, "text": "", "finish_reason": "deadline", "role_first": False}, None),
    ({"index": 0, "text": "", "finish_reason": "length", "role_first": False}, usage(3, 3)),
]


def _bodies_app() -> FastAPI:
    """Answers with the builders' bodies, whole or streamed as the server streams them."""
    app = FastAPI()

    async def answer(request: Request, chat: bool):
        build = chat_body if chat else completion_choices_body
        cid = new_chat_id() if chat else new_completion_id()
        if not (await request.json()).get("stream"):
            return JSONResponse(build(cid, 1, "m", CHOICES, usage=usage(3, 3), speculation=SPEC))

        def events():
            for choice, use in STREAM:
                last = use is not None
                yield sse(
                    build(
                        cid,
                        1,
                        "m",
                        [choice],
                        chunk=True,
                        usage=use,
                        speculation=SPEC if last else None,
                    )
                )
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await answer(request, chat=True)

    return app


def _openai(app: FastAPI, key: str = "k", strict: bool = False) -> openai.AsyncOpenAI:
    transport = httpx2.ASGITransport(app=app)
    return openai.AsyncOpenAI(
        api_key=key,
        base_url="http://test/v1",
        max_retries=0,
        http_client=httpx2.AsyncClient(transport=transport),
        _strict_response_validation=strict,
    )


async def _both(strict: bool = False):
    async with _openai(_bodies_app(), strict=strict) as client:
        text = await client.completions.create(model="m", prompt="x")
        chat = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}]
        )
        text_chunks = [
            c async for c in await client.completions.create(model="m", prompt="x", stream=True)
        ]
        chat_chunks = [
            c
            async for c in await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], stream=True
            )
        ]
    return text, chat, text_chunks, chat_chunks


def test_openai_client_parses_the_bodies():
    text, chat, text_chunks, chat_chunks = asyncio.run(_both())
    assert isinstance(text, Completion) and text.id.startswith("cmpl-")
    assert [(c.index, c.text, c.finish_reason) for c in text.choices] == [
        (0, "Hello", "length"),
        (1, "Wor", "deadline"),
    ]
    assert text.usage.total_tokens == 6 and text.model_extra["speculation"] == SPEC
    assert isinstance(chat, ChatCompletion) and chat.id.startswith("chatcmpl-")
    assert chat.object == "chat.completion"
    assert [
        (c.index, c.message.role, c.message.content, c.finish_reason) for c in chat.choices
    ] == [(0, "assistant", "Hello", "length"), (1, "assistant", "Wor", "deadline")]
    assert chat.usage.completion_tokens == 3 and chat.model_extra["speculation"] == SPEC

    def joined(chunks, get) -> dict[int, str]:
        out: dict[int, str] = {}
        for chunk in chunks:
            for c in chunk.choices:
                out[c.index] = out.get(c.index, "") + (get(c) or "")
        return out

    assert joined(text_chunks, lambda c: c.text) == {0: "Hello", 1: "Wor"}
    assert joined(chat_chunks, lambda c: c.delta.content) == {0: "Hello", 1: "Wor"}
    assert all(isinstance(c, ChatCompletionChunk) for c in chat_chunks)
    roles = [(c.choices[0].index, c.choices[0].delta.role) for c in chat_chunks]
    assert roles == [(0, "assistant"), (1, "assistant"), (0, None), (1, None), (0, None)]
    for chunks in (text_chunks, chat_chunks):
        finishes = [(c.choices[0].index, c.choices[0].finish_reason) for c in chunks]
        assert finishes[3:] == [(1, "deadline"), (0, "length")]
        assert [c.usage for c in chunks[:-1]] == [None] * 4
        assert chunks[-1].usage.total_tokens == 6
        assert chunks[-1].model_extra["speculation"] == SPEC


def test_bodies_validate_against_the_openai_types():
    """Strictly validated (pydantic, not the client's lenient construction), every body
    matches OpenAI's types, except that "deadline" is not one of OpenAI's finish reasons: the
    client accepts it only because it does not validate responses by default."""
    ok = [{**c, "finish_reason": "stop"} for c in CHOICES]
    Completion.model_validate(completion_choices_body("cmpl-1", 1, "m", ok, usage=usage(1, 2)))
    ChatCompletion.model_validate(chat_body("chatcmpl-1", 1, "m", ok, usage=usage(1, 2)))
    for choice, _ in STREAM[:3]:
        ChatCompletionChunk.model_validate(chat_body("chatcmpl-1", 1, "m", [choice], chunk=True))
    with pytest.raises(ValidationError, match="finish_reason"):
        Completion.model_validate(completion_choices_body("c", 1, "m", CHOICES, usage=None))
    with pytest.raises(openai.APIResponseValidationError):
        asyncio.run(_both(strict=True))


def test_retrained_tokenizers_keep_the_committed_chat_template():
    """jobs.train_tiny sets the template the committed checkpoints carry."""
    from pipeline.models.loading import REPO_ROOT
    from pipeline.tiny.training import CHAT_TEMPLATE

    for name in ("target", "draft"):
        config = json.loads((REPO_ROOT / "models" / name / "tokenizer_config.json").read_text())
        assert config["chat_template"] == CHAT_TEMPLATE, name


def test_the_last_step_s_lookahead_must_fit_the_context_too():
    """A step may draft and verify up to `lookahead` positions past max_tokens (fixed k = 8:
    8); prompt + max_tokens + lookahead must fit the context, and the message says why."""
    check_lengths(2000, 40, 2048, 1024, lookahead=8)  # 2048 exactly
    with pytest.raises(RequestError) as info:
        check_lengths(2001, 40, 2048, 1024, lookahead=8)
    message = info.value.message
    assert "context of 2048 tokens less the 8 positions" in message, message
    assert info.value.param == "prompt" and info.value.code == "context_length_exceeded"
    open_ended = parse_chat_request({"messages": [{"role": "user", "content": "x"}]})
    assert resolve_max_tokens(open_ended, 60, 100, 1000, 64, "messages", lookahead=8) == 32


def test_a_request_naming_no_policy_is_served_without_the_artifacts_too():
    from pipeline.decode.policies.artifacts import load_artifacts
    from serving.speculation import DEFAULT_POLICY, default_spec

    assert default_spec(load_artifacts()) == (DEFAULT_POLICY, {})
    assert default_spec(load_artifacts(), 0.0) == ("throughput", {})
    assert default_spec(load_artifacts(), 0.7) == ("specdec", {})  # chosen per temperature
    assert default_spec(None) == ("fixed", {"k": 4})  # no 500 for a request that asked nothing
