"""The checks of a request that need the model: token ids sent as prompts in the vocabulary,
prompt and max_tokens within the context and the server's limit."""

from __future__ import annotations

from typing import Protocol

from serving.errors import RequestError


class AsksForTokens(Protocol):
    """What resolve_max_tokens reads of a request (serving.protocol's completion and chat
    requests both have it); a protocol so the request models can import these checks."""

    @property
    def requested_max_tokens(self) -> int | None: ...

    @property
    def max_tokens_param(self) -> str: ...


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """Token ids sent as a prompt must name tokens of the model: 0 <= id < vocab_size.
    ``param`` names the prompt ("prompt", "prompt[1]"); the error names the id's index."""
    for j, tok in enumerate(ids):
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
            raise RequestError(
                f"{param}[{j}]: token id {tok!r} is out of range; the model's vocabulary has "
                f"{vocab_size} tokens (ids 0 to {vocab_size - 1})",
                f"{param}[{j}]",
            )


def check_lengths(
    prompt_tokens: int,
    max_tokens: int,
    context: int,
    max_tokens_limit: int,
    *,
    prompt_param: str = "prompt",
    max_tokens_param: str = "max_tokens",
    lookahead: int = 0,
) -> None:
    """The prompt and max_tokens fit the context and the server's limit. ``lookahead``: the
    positions past the last kept token one speculative step may draft or verify (the last
    step may run that far beyond max_tokens); they must fit the context too, or a model with
    learned positions would index past its table."""
    full, context = context, context - lookahead
    ahead = (
        f" less the {lookahead} positions a step of this policy looks ahead" if lookahead else ""
    )
    limit, mt = min(max_tokens_limit, context - 1), max_tokens_param
    if max_tokens < 1:
        raise RequestError(f"{mt} must be >= 1, got {max_tokens}", mt)
    if max_tokens > limit:
        raise RequestError(f"{mt} must be <= {limit}, got {max_tokens}", mt)
    if prompt_tokens == 0:
        raise RequestError(f"{prompt_param} has no tokens", prompt_param)
    if prompt_tokens + max_tokens > context:
        raise RequestError(
            f"{prompt_param} is {prompt_tokens} tokens and {mt} is {max_tokens}: together "
            f"they exceed the context of {full} tokens{ahead} (at most "
            f"{context - max_tokens} prompt tokens with this {mt})",
            prompt_param,
            code="context_length_exceeded",
        )


def resolve_max_tokens(
    req: AsksForTokens,
    prompt_tokens: int,
    context: int,
    max_tokens_limit: int,
    default: int,
    prompt_param: str = "prompt",
    lookahead: int = 0,
) -> int:
    """The generation's token limit, checked: the request's own (check_lengths), or, for a chat
    request without one, ``default`` cut to what the context and the server's limit leave (as
    OpenAI: no limit means "until the context is full")."""
    requested = req.requested_max_tokens
    if requested is not None:
        check_lengths(
            prompt_tokens,
            requested,
            context,
            max_tokens_limit,
            prompt_param=prompt_param,
            max_tokens_param=req.max_tokens_param,
            lookahead=lookahead,
        )
        return requested
    if prompt_tokens == 0:
        raise RequestError(f"{prompt_param} has no tokens", prompt_param)
    room = min(default, max_tokens_limit, context - lookahead - prompt_tokens)
    if room < 1:
        raise RequestError(
            f"{prompt_param} is {prompt_tokens} tokens: it leaves no room to generate in the "
            f"context of {context} tokens"
            + (
                f" less the {lookahead} positions a step of this policy looks ahead"
                if lookahead
                else ""
            ),
            prompt_param,
            code="context_length_exceeded",
        )
    return room
