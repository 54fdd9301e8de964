"""A request, parsed (serving.protocol), made into the decoding thread's Job: the work between
the HTTP layer and the engine that needs the model (tokenizer, vocabulary, context) and the
policy registry."""

from __future__ import annotations

import secrets
from typing import Any

from pipeline.data.prompts import encode
from pipeline.decode.policies.artifacts import PolicyArtifacts
from pipeline.decode.step_limits import StepLimitError, StepLimits, check_step_limits
from pipeline.decode.types import SamplingConfig
from serving.chat import render_chat
from serving.checks import check_token_ids, resolve_max_tokens
from serving.errors import RequestError
from serving.generation import Choice, Job
from serving.protocol import ChatCompletionRequest, CompletionRequest
from serving.responses import new_chat_id, new_completion_id, now
from serving.settings import AppArgs
from serving.speculation import build_policy, default_spec


def prepare_job(
    req: CompletionRequest | ChatCompletionRequest,
    kind: str,
    arrived: float,
    tokenizer: Any,
    vocab: int,
    context: int,
    args: AppArgs,
    limits: StepLimits,
    artifacts: PolicyArtifacts | None,
    artifacts_error: str | None,
) -> Job:
    """A parsed request as the decoding thread's Job: prompts tokenized (token-id prompts
    checked against ``vocab``), the policy built and held to the step ``limits``, max_tokens
    resolved within ``context``, a seed per choice and the deadline. Every refusal is a
    RequestError (a 4xx), raised before any decoding."""
    count = req.n * (1 if kind == "chat" else len(req.prompts))
    if count > args.max_choices:  # before any tokenizing
        raise RequestError(
            f"{count // req.n} prompt(s) x n = {req.n} asks for {count} generations; "
            f"this server allows at most {args.max_choices} per request",
            "n",
        )
    if kind == "chat":
        prompts = [render_chat(tokenizer, req.chat_messages)]
        params = ["messages"]
    else:
        prompts, params = [], [req.prompt_param(i) for i in range(len(req.prompts))]
        for prompt, param in zip(req.prompts, params, strict=True):
            if isinstance(prompt, str):
                prompts.append(encode(tokenizer, prompt))
            else:
                check_token_ids(prompt, vocab, param)
                prompts.append(list(prompt))
    if req.speculation is not None:
        name, knobs = req.speculation_spec
    else:
        name, knobs = default_spec(artifacts, req.temperature)

    sampling = SamplingConfig(req.temperature, req.top_p)
    # The policy prices its steps in the mode this request decodes in.
    priced = artifacts.for_sampling(sampling) if artifacts is not None else None

    def make_policy():
        return build_policy(name, knobs, priced, artifacts_error)

    policy = make_policy()
    try:
        check_step_limits(policy, limits)
    except StepLimitError as exc:
        raise RequestError(str(exc), "speculation", code="step_limit_exceeded") from None
    # The last step may draft and verify this far past max_tokens: it must fit too.
    work = policy.step_work()
    lookahead = max(work.verified - 1, work.draft_forwards)
    # A chat request without a limit generates until the context (or the server's limit).
    max_tokens = min(
        resolve_max_tokens(
            req,
            len(ids),
            context,
            args.max_tokens_limit,
            args.max_tokens_limit,
            param,
            lookahead,
        )
        for ids, param in zip(prompts, params, strict=True)
    )
    # Without a seed every request samples differently (the engine would default to 0);
    # choice i of a seeded request uses seed + i, so n > 1 choices differ.
    seed = req.seed if req.seed is not None else secrets.randbits(63)
    choices = [
        Choice(p * req.n + j, p, ids, (seed + p * req.n + j) % (1 << 63))
        for p, ids in enumerate(prompts)
        for j in range(req.n)
    ]
    timeout = min(req.timeout_s or args.request_timeout_s, args.request_timeout_s)
    cid = new_chat_id() if kind == "chat" else new_completion_id()
    return Job(
        kind,
        cid,
        now(),
        args.model_name,
        choices,
        make_policy,
        name,
        knobs,
        max_tokens,
        sampling,
        req.stops,
        arrived + timeout,
    )
