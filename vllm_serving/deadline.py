"""A request's deadline on the vLLM app: a stream past it ends with a chunk whose choices say
``finish_reason: "deadline"`` and then ``[DONE]``; closing the stream cancels the call to the
engine replica, and vLLM aborts the request (it stops generating for it). A whole response
past it is a 504 in OpenAI's error shape. A stream whose source ends without ``[DONE]`` (its
engine replica died) ends with an error event instead of passing for a complete text."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

FINISH_REASON = "deadline"


LOST = (
    "data: "
    + json.dumps(
        {
            "error": {
                "message": "the engine replica serving this stream stopped before it ended; "
                "retry the request",
                "type": "server_error",
                "param": None,
                "code": "replica_lost",
            }
        }
    )
    + "\n\n"
)


def deadline_chunk(last: dict[str, Any] | None, chat: bool, n: int) -> str:
    """The closing chunk: one finish per choice, in the stream's own id and object."""
    last = last or {}
    if chat:
        choices = [{"index": i, "delta": {}, "finish_reason": FINISH_REASON} for i in range(n)]
    else:
        choices = [{"index": i, "text": "", "finish_reason": FINISH_REASON} for i in range(n)]
    chunk = {
        "id": last.get("id", "deadline"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": last.get("created", int(time.time())),
        "model": last.get("model", ""),
        "choices": choices,
    }
    return f"data: {json.dumps(chunk)}\n\n"


def _last_json(packet: Any) -> dict[str, Any] | None:
    """The last ``data: {...}`` object of an SSE packet (a packet may hold several)."""
    text = packet.decode() if isinstance(packet, bytes) else str(packet)
    for line in reversed(text.splitlines()):
        if line.startswith("data: {"):
            try:
                return json.loads(line[6:])
            except json.JSONDecodeError:
                return None
    return None


async def guarded(
    packets: AsyncIterator[Any], ends_at: float, chat: bool, n: int
) -> AsyncIterator[Any]:
    """``packets`` until the stream ends or ``ends_at`` (loop time) passes."""
    loop = asyncio.get_running_loop()
    last: dict[str, Any] | None = None
    done = False
    try:
        while True:
            try:
                packet = await asyncio.wait_for(anext(packets), ends_at - loop.time())
            except StopAsyncIteration:
                if not done:
                    # The engine replica went away mid-stream (killed, restarted): say so, so
                    # that a client sees an error it can retry rather than a short text.
                    yield LOST
                return
            parsed = _last_json(packet)
            last = parsed or last
            done = done or "[DONE]" in (packet.decode() if isinstance(packet, bytes) else packet)
            yield packet
    except TimeoutError:
        if not done:
            yield deadline_chunk(last, chat, n)
            yield "data: [DONE]\n\n"
    finally:
        aclose = getattr(packets, "aclose", None)
        if aclose is not None:
            await aclose()
