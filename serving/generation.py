"""A validated request's generations run on the decoding thread, and their responses: one
generation per (prompt, choice), all submitted at once so that they advance together (and
alongside other requests'), answered as one body or one event stream whose chunks carry the
choice index, as OpenAI's API does for n > 1 and prompt lists."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pipeline.decode.stats import speculation_stats
from pipeline.decode.types import Generation, SamplingConfig
from serving.errors import RequestError, error_body
from serving.responses import chat_body, completion_choices_body, sse, usage
from serving.worker import DecodeTask, DecodeWorker

log = logging.getLogger("ray.serve")


@dataclass
class Choice:
    """One generation of a request: choice ``index`` continues prompt ``prompt`` (its ids)."""

    index: int
    prompt: int
    prompt_ids: list[int]
    seed: int


@dataclass
class Job:
    """A validated request, ready to decode."""

    kind: str  # "completion" or "chat"
    cid: str
    created: int
    model: str
    choices: list[Choice]
    make_policy: Callable[[], Any]  # a fresh policy per generation (policies adapt per step)
    policy_name: str
    knobs: dict[str, Any]
    max_tokens: int
    sampling: SamplingConfig
    stops: list[str]
    deadline: float  # time.monotonic() instant
    first_text_at: float | None = None  # when the first text of any choice arrived (TTFT)

    def prompt_tokens(self) -> int:
        seen = {c.prompt: len(c.prompt_ids) for c in self.choices}  # each prompt counted once
        return sum(seen.values())


async def run(worker: DecodeWorker, job: Job) -> AsyncIterator[tuple[int, str | Generation]]:
    """(choice index, text delta) as the generations advance, then (index, Generation) for
    each; an exception from the decoding thread is raised here. If the consumer goes away
    (a client disconnect closes this generator), every generation stops at its next step."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    tasks = []
    for choice in job.choices:

        def deliver(item: Any, index: int = choice.index) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (index, item))

        tasks.append(
            DecodeTask(
                choice.prompt_ids,
                job.make_policy(),
                job.max_tokens,
                job.sampling,
                choice.seed,
                job.stops,
                job.deadline,
                deliver,
                job.cid,
            )
        )
    try:
        for task in tasks:
            try:
                worker.submit(task)
            except RuntimeError:  # the worker is closing
                raise _shutting_down() from None
        pending = len(tasks)
        while pending:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, Generation):
                pending -= 1
            elif not item:
                continue
            elif job.first_text_at is None:
                job.first_text_at = time.monotonic()
            yield index, item
    finally:
        for task in tasks:
            task.cancel.set()


def _stats(job: Job, results: dict[int, Generation]) -> dict:
    steps = [s for i in sorted(results) for s in results[i].steps]
    return speculation_stats(job.policy_name, job.knobs, steps)


def _body(
    job: Job,
    choices: list[dict],
    *,
    chunk: bool,
    usage_: dict | None = None,
    speculation: dict | None = None,
) -> dict:
    build = chat_body if job.kind == "chat" else completion_choices_body
    return build(
        job.cid, job.created, job.model, choices, chunk=chunk, usage=usage_, speculation=speculation
    )


def _shutting_down() -> RequestError:
    return RequestError(
        "the replica is shutting down; retry the request",
        status=503,
        code="shutting_down",
        kind="server_error",
    )


def _check_not_shut_down(worker: DecodeWorker, result: Generation) -> None:
    if result.finish_reason == "cancelled" and worker.closing:
        raise _shutting_down()


async def respond(worker: DecodeWorker, job: Job) -> tuple[dict, dict[int, Generation]]:
    """The whole response body, and the generations by choice index."""
    results: dict[int, Generation] = {}
    # aclosing: the generations are cancelled as soon as this ends, however it ends.
    async with contextlib.aclosing(run(worker, job)) as items:
        async for index, item in items:
            if isinstance(item, Generation):
                _check_not_shut_down(worker, item)
                results[index] = item
    choices = [
        {"index": i, "text": results[i].text, "finish_reason": results[i].finish_reason}
        for i in sorted(results)
    ]
    completion = sum(len(g.tokens) for g in results.values())
    return _body(
        job,
        choices,
        chunk=False,
        usage_=usage(job.prompt_tokens(), completion),
        speculation=_stats(job, results),
    ), results


async def stream(
    worker: DecodeWorker, job: Job, done: Callable[[dict[int, Generation], int], None]
) -> AsyncIterator[str]:
    """Server-sent events: text deltas per choice, each choice's last chunk with its finish
    reason, usage and speculation statistics on the last one, then [DONE]. ``done`` gets the
    generations that ended and the status the stream amounts to (200; 499 when the client
    went away; the error's status) when it ends, however it ends (metrics)."""
    results: dict[int, Generation] = {}
    started: set[int] = set()
    status = 499  # unless it runs to the end or fails: the client went away
    try:
        async with contextlib.aclosing(run(worker, job)) as items:
            async for index, item in items:
                choice: dict[str, Any] = {"index": index, "role_first": index not in started}
                started.add(index)
                if not isinstance(item, Generation):
                    yield sse(
                        _body(job, [{**choice, "text": item, "finish_reason": None}], chunk=True)
                    )
                    continue
                _check_not_shut_down(worker, item)
                results[index] = item
                last = len(results) == len(job.choices)
                tokens = sum(len(g.tokens) for g in results.values())
                yield sse(
                    _body(
                        job,
                        [{**choice, "text": "", "finish_reason": item.finish_reason}],
                        chunk=True,
                        usage_=usage(job.prompt_tokens(), tokens) if last else None,
                        speculation=_stats(job, results) if last else None,
                    )
                )
        status = 200
    except RequestError as exc:
        status = exc.status
        yield sse(error_body(exc.message, exc.param, exc.code, exc.kind))
    except Exception:
        status = 500
        # Headers are out: the error goes in the stream, which the openai client raises.
        log.exception("generation failed mid-stream (%s)", job.cid)
        yield sse(error_body("internal server error during generation", kind="server_error"))
    finally:
        done(results, status)
    yield sse("[DONE]")
