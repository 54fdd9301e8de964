"""The response bodies, in OpenAI's shapes: text_completion objects (/v1/completions) and
chat.completion / chat.completion.chunk objects (/v1/chat/completions), as whole bodies or
server-sent-event chunks, plus this server's ``speculation`` statistics.

A choice is given as ``{"index": i, "text": str, "finish_reason": str | None}`` (chat chunks
also ``"role_first": bool``: the choice's first chunk names the role, as OpenAI's do). Finish
reasons are the engine's, mapped by FINISH_REASONS; "deadline" (the request's time ran out)
is not one of OpenAI's, and the openai client accepts it: it does not check response enums
unless built with _strict_response_validation=True."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

# The engine's finish reason -> the response's. "cancelled" only reaches a client when the
# server cancels (a gone client reads nothing).
FINISH_REASONS = {
    "eos": "stop",
    "stop": "stop",
    "length": "length",
    "cancelled": "stop",
    "deadline": "deadline",
}


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def new_chat_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _finish(reason: str | None) -> str | None:
    return FINISH_REASONS.get(reason, reason) if reason is not None else None


def _envelope(
    cid: str,
    obj: str,
    created: int,
    model: str,
    choices: list[dict],
    chunk: bool,
    usage: dict | None,
    speculation: dict | None,
) -> dict:
    body: dict[str, Any] = {
        "id": cid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None or not chunk:  # a whole body always has usage; chunks the last one
        body["usage"] = usage
    if speculation is not None:
        body["speculation"] = speculation
    return body


def completion_choices_body(
    cid: str,
    created: int,
    model: str,
    choices: list[dict],
    *,
    chunk: bool = False,
    usage: dict | None = None,
    speculation: dict | None = None,
) -> dict:
    """A text_completion object (a stream chunk has the same shape, texts being deltas)."""
    out = [
        {
            "index": c["index"],
            "text": c.get("text") or "",
            "logprobs": None,
            "finish_reason": _finish(c.get("finish_reason")),
        }
        for c in choices
    ]
    return _envelope(cid, "text_completion", created, model, out, chunk, usage, speculation)


def chat_body(
    cid: str,
    created: int,
    model: str,
    choices: list[dict],
    *,
    chunk: bool = False,
    usage: dict | None = None,
    speculation: dict | None = None,
) -> dict:
    """A chat.completion object, or (chunk) a chat.completion.chunk whose choices carry a
    ``delta``: the role in a choice's first chunk, the text when there is any (the last
    chunk of a choice, with its finish reason, usually has an empty delta)."""
    out = []
    for c in choices:
        text = c.get("text") or ""
        if chunk:
            first = bool(c.get("role_first"))
            delta = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            item: dict[str, Any] = {"index": c["index"], "delta": delta}
        else:
            item = {"index": c["index"], "message": {"role": "assistant", "content": text}}
        item["logprobs"] = None
        item["finish_reason"] = _finish(c.get("finish_reason"))
        out.append(item)
    obj = "chat.completion.chunk" if chunk else "chat.completion"
    return _envelope(cid, obj, created, model, out, chunk, usage, speculation)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
