"""What one request may ask of speculation in vLLM: ``vllm_xargs`` keys (vLLM's OpenAI server
passes them into ``SamplingParams.extra_args``), read by the cost-aware scheduler row by row
and checked at the app's ingress.

    {"vllm_xargs": {"speculation": "off"}}        this request's row drafts nothing
    {"vllm_xargs": {"max_draft_tokens": 2}}       at most 2 draft tokens verified per step

A seeded request at T > 0 drafts nothing unless it says ``"speculation": "on"``: vLLM draws
the draft's samples from the process's generator, not the request's, so a seeded request that
drafts does not repeat its text; one that drafts nothing draws exactly what it would draw
without speculation (vLLM skips a row's rejection draws when it has no draft tokens), so its
text repeats and equals decoding without speculation.
"""

from __future__ import annotations

from typing import Any

SPECULATION_ARG = "speculation"
SPECULATION_VALUES = ("on", "off")
MAX_DRAFT_ARG = "max_draft_tokens"
REQUEST_ARGS = (SPECULATION_ARG, MAX_DRAFT_ARG)


def check_request_args(extra: Any, max_k: int) -> list[tuple[str, str]]:
    """The problems with a request's speculation arguments, as (param, message) pairs; empty
    when they are fine. Keys other than ours are left to vLLM (extra_args is shared)."""
    if extra is None:
        return []
    if not isinstance(extra, dict):
        return [("vllm_xargs", "vllm_xargs must be a JSON object")]
    problems = []
    if SPECULATION_ARG in extra and extra[SPECULATION_ARG] not in SPECULATION_VALUES:
        problems.append(
            (
                f"vllm_xargs.{SPECULATION_ARG}",
                f"vllm_xargs.{SPECULATION_ARG} must be one of "
                f"{', '.join(repr(v) for v in SPECULATION_VALUES)}",
            )
        )
    if MAX_DRAFT_ARG in extra:
        value = extra[MAX_DRAFT_ARG]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= max_k:
            problems.append(
                (
                    f"vllm_xargs.{MAX_DRAFT_ARG}",
                    f"vllm_xargs.{MAX_DRAFT_ARG} must be an integer from 0 to {max_k}",
                )
            )
    return problems


def draft_cap(params: Any, max_k: int) -> int:
    """The most draft tokens this request's row may have verified per step (0: none)."""
    extra = getattr(params, "extra_args", None) or {}
    speculation = extra.get(SPECULATION_ARG)
    if speculation == "off":
        return 0
    sampled = (getattr(params, "temperature", 0.0) or 0.0) > 0
    if speculation != "on" and sampled and getattr(params, "seed", None) is not None:
        return 0  # a seed repeats its text only without drafting (module docstring)
    cap = extra.get(MAX_DRAFT_ARG)
    if isinstance(cap, int) and not isinstance(cap, bool):
        return max(0, min(cap, max_k))
    return max_k
