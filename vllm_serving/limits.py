"""What one request may ask of a model id of the vLLM app (``ModelLimits``: from its engine's
``max_model_len`` and its speculation, stated in ``GET /v1/models`` as ``metadata.limits``)
and the checks of a request body against them, before any engine replica sees it
(docs/serving_vllm.md, "Request limits"). A request past a limit, or with a field of the
wrong type (``"max_tokens": true``, which vLLM's parser reads as 1), is a RequestError (400)
whose message names the field and the limit, and whose ``code`` is the limit's name.

The prompt bound counts characters: no token of the embedded target is over 49 characters,
so a prompt over CHARS_PER_TOKEN per token of max_model_len cannot fit; vLLM counts the
tokens of shorter ones. The limits from ray.serve.llm's model cards, the body's reading, the
error words and the middleware that applies the checks are in vllm_serving.refusals.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.vllm_spec.request_args import (
    MAX_DRAFT_ARG,
    REQUEST_ARGS,
    SPECULATION_ARG,
    SPECULATION_VALUES,
    check_request_args,
)
from serving.errors import RequestError
from serving.fields import FieldError, check_prompt, param_name

MAX_N = 16  # choices per prompt, as the research endpoint (serving.protocol.MAX_N)
MAX_CHOICES = 16  # choices per request: n x prompts (serving.settings' max_choices)
OUTPUT_CONTEXTS = 8  # max_output_tokens = OUTPUT_CONTEXTS x max_model_len
CHARS_PER_TOKEN = 64  # max_prompt_chars = CHARS_PER_TOKEN x max_model_len
COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default (and for null)
# The settings whose engines run the cost-aware scheduler, which reads vllm_xargs.
SCHEDULED = ("ours", "ours-eagle3")

# Integer and number fields of vLLM's request models (0.32), checked strictly: its parser
# takes true for 1, "5" for 5 and 4.0 for 4.
_INTEGERS = ("n", "max_tokens", "seed", "top_k", "min_tokens", "prompt_logprobs")
INTEGER_FIELDS = {
    "completions": (*_INTEGERS, "truncate_prompt_tokens", "logprobs"),
    "chat": (*_INTEGERS, "truncate_prompt_tokens", "max_completion_tokens", "top_logprobs"),
}
_PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
NUMBER_FIELDS = ("temperature", "top_p", "min_p", *_PENALTIES)


@dataclass(frozen=True)
class ModelLimits:
    """One model id's limits: its engine's context and its speculation (setting and K)."""

    name: str
    max_model_len: int
    speculation: str = "none"
    k: int = 0  # the longest draft (num_speculative_tokens)

    @property
    def max_tokens(self) -> int:
        return self.max_model_len

    @property
    def max_output_tokens(self) -> int:
        return OUTPUT_CONTEXTS * self.max_model_len

    @property
    def max_prompt_chars(self) -> int:
        return CHARS_PER_TOKEN * self.max_model_len

    @property
    def max_body_bytes(self) -> int:
        return MAX_CHOICES * 4 * self.max_prompt_chars + (1 << 20)

    @property
    def scheduled(self) -> bool:
        """Its engine runs the cost-aware scheduler, which honours vllm_xargs."""
        return self.speculation in SCHEDULED and self.k > 0

    def describe(self) -> dict[str, Any]:
        """The limits as GET /v1/models states them."""
        xargs = (
            {SPECULATION_ARG: list(SPECULATION_VALUES), MAX_DRAFT_ARG: [0, self.k]}
            if self.scheduled
            else {}
        )
        return {
            "max_model_len": self.max_model_len,
            "max_n": MAX_N,
            "max_choices": MAX_CHOICES,
            "max_tokens": self.max_tokens,
            "max_output_tokens": self.max_output_tokens,
            "max_prompt_chars": self.max_prompt_chars,
            "max_body_bytes": self.max_body_bytes,
            "vllm_xargs": xargs,
        }


def show(value: Any) -> str:
    """A client's value as JSON, shortened: ``true``, ``"5"``, ``4.0``."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _refuse(message: str, param: str | None, code: str | None = "invalid_value") -> RequestError:
    return RequestError(message, param, code=code)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_types(route: str, body: Mapping[str, Any]) -> None:
    """Integer fields hold JSON integers (not booleans, strings or 4.0), number fields JSON
    numbers; null is left to vLLM (its default)."""
    for field in INTEGER_FIELDS[route]:
        value = body.get(field)
        if value is not None and not _is_int(value):
            raise _refuse(f"{field} must be an integer, got {show(value)}", field, "invalid_type")
    for field in NUMBER_FIELDS:
        value = body.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise _refuse(f"{field} must be a number, got {show(value)}", field, "invalid_type")


def _prompts(body: Mapping[str, Any]) -> list[str | list[int]]:
    """A completion's prompts (a string or token ids each), checked as the research endpoint
    checks them (serving.fields.check_prompt: no booleans for token ids, no empty prompt)."""
    if body.get("prompt") is None:
        if body.get("prompt_embeds") is not None:
            raise _refuse("prompt_embeds are not served here; send prompt", "prompt_embeds")
        raise _refuse("'prompt' is required", "prompt", "missing")
    try:
        prompt = check_prompt(body["prompt"])
    except FieldError as exc:
        param = param_name(("prompt", *exc.path))
        raise _refuse(f"{param}: {exc}", param, "invalid_type") from None
    single = isinstance(prompt, str) or _is_int(prompt[0])
    return [prompt] if single else list(prompt)  # type: ignore[list-item]


def _chat_chars(body: Mapping[str, Any]) -> int:
    """The characters of a chat request's messages (their text content, parts included)."""
    messages = body.get("messages")
    if messages is None:
        raise _refuse("'messages' is required", "messages", "missing")
    if not isinstance(messages, list) or not messages:
        got = "an empty array" if messages == [] else show(messages)
        raise _refuse(f"messages must be a non-empty array of messages, got {got}", "messages")
    chars = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _refuse(
                f"messages[{i}] must be a message object, got {show(message)}",
                f"messages[{i}]",
                "invalid_type",
            )
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(
                len(part["text"])
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
    return chars


def _max_tokens(route: str, body: Mapping[str, Any], limits: ModelLimits) -> tuple[int, str, str]:
    """(the most tokens one choice may make, the field naming it, how that was found)."""
    if route == "chat":
        given, other = body.get("max_completion_tokens"), body.get("max_tokens")
        if given is not None and other is not None and given != other:
            raise _refuse(
                f"max_completion_tokens {given} differs from max_tokens {other}; send one of them",
                "max_completion_tokens",
            )
        field = "max_completion_tokens" if given is not None else "max_tokens"
        value = given if given is not None else other
        if value is None:
            return limits.max_model_len, "max_tokens", "absent: up to max_model_len"
    else:
        field, value = "max_tokens", body.get("max_tokens")
        if value is None:
            return COMPLETION_DEFAULT_MAX_TOKENS, field, "absent: vLLM's default"
    least = 0 if route == "completions" and body.get("echo") is True else 1
    if value < least:
        raise _refuse(f"{field} must be at least {least}, got {value}", field)
    if value > limits.max_tokens:
        raise _refuse(
            f"{field} must be at most {limits.max_tokens} (max_tokens: the model's "
            f"max_model_len), got {value}",
            field,
            "max_tokens",
        )
    return value, field, ""


def check_xargs(body: Mapping[str, Any], limits: ModelLimits) -> None:
    """``vllm_xargs``: only the per-request speculation keys, on a model whose scheduler reads
    them, with values from pipeline.vllm_spec.request_args."""
    xargs = body.get("vllm_xargs")
    if xargs is None:
        return
    if not isinstance(xargs, dict):
        raise _refuse(
            f"vllm_xargs must be a JSON object, got {show(xargs)}", "vllm_xargs", "invalid_type"
        )
    for key in xargs:
        if key not in REQUEST_ARGS:
            raise _refuse(
                f"vllm_xargs.{key} is not a key this app takes; the keys are "
                f"{', '.join(REQUEST_ARGS)}",
                f"vllm_xargs.{key}",
            )
    for key in xargs:
        if not limits.scheduled:
            raise _refuse(
                f"vllm_xargs.{key}: the model {limits.name!r} (speculation "
                f"{limits.speculation}) fixes its speculation when its engine starts; a "
                f"request chooses it on models with speculation {' or '.join(SCHEDULED)}",
                f"vllm_xargs.{key}",
            )
    problems = check_request_args(xargs, limits.k)
    if problems:
        param, message = problems[0]
        key = param.removeprefix("vllm_xargs.")
        raise _refuse(f"{message}, got {show(xargs.get(key))}", param)


def check_request(route: str, body: Mapping[str, Any], limits: ModelLimits) -> None:
    """Refuse (RequestError) a request over its model's limits or with a field of the wrong
    type; the rest is vLLM's to check."""
    check_types(route, body)
    n = body.get("n")
    n = 1 if n is None else n
    if n < 1:
        raise _refuse(f"n must be at least 1, got {n}", "n")
    if n > MAX_N:
        raise _refuse(f"n must be at most {MAX_N} (max_n), got {n}", "n", "max_n")
    if route == "completions":
        prompts = _prompts(body)
    else:
        chars = _chat_chars(body)
        if chars > limits.max_prompt_chars:
            raise _prompt_too_long("messages", f"{chars} characters of text", limits)
        prompts = []
    choices = n * max(len(prompts), 1)
    if choices > MAX_CHOICES:
        raise _refuse(
            f"n x prompts is {n} x {len(prompts)} = {choices} choices, over the limit of "
            f"{MAX_CHOICES} (max_choices)",
            "prompt",
            "max_choices",
        )
    max_tokens, field, how = _max_tokens(route, body, limits)
    total = choices * max_tokens
    if total > limits.max_output_tokens:
        shape = f"n x max_tokens is {n} x {max_tokens}"
        if len(prompts) > 1:
            shape = f"n x prompts x max_tokens is {n} x {len(prompts)} x {max_tokens}"
        if how:
            shape += f" ({field} {how})"
        fits = limits.max_output_tokens // choices
        raise _refuse(
            f"{shape} = {total} tokens, over the limit of {limits.max_output_tokens} "
            f"(max_output_tokens); ask for at most {fits} tokens per choice",
            field,
            "max_output_tokens",
        )
    for i, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            if len(prompt) > limits.max_prompt_chars:
                raise _prompt_too_long(param, f"{len(prompt)} characters", limits)
        elif len(prompt) + max_tokens > limits.max_model_len:
            raise _refuse(
                f"{param} has {len(prompt)} tokens; with {field} {max_tokens} that is more "
                f"than the model's max_model_len of {limits.max_model_len} tokens",
                param,
                "context_length_exceeded",
            )
    check_xargs(body, limits)


def _prompt_too_long(param: str, size: str, limits: ModelLimits) -> RequestError:
    return _refuse(
        f"{param} is {size}, over the limit of {limits.max_prompt_chars} (max_prompt_chars: "
        f"{CHARS_PER_TOKEN} per token of max_model_len {limits.max_model_len})",
        param,
        "context_length_exceeded",
    )
