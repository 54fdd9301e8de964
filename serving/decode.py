"""Incremental decoding over the engine for the endpoint.

`IncrementalGeneration` steps a `DecodeSession` and ends a generation exactly as
`SpeculativeEngine.generate()` does (same tokens, text and finish reason: max tokens, EOS, stop
strings), but hands out the text as deltas after every step. A delta never contains text the
finished generation will not: the last len(longest stop) - 1 characters are held back (a stop
string may be completed by the next step), as is a trailing U+FFFD (a UTF-8 character split
across tokens). The engine's generate() is mirrored here rather than called, so the stream and
the non-stream response come from one loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.engine import SamplingConfig, SpeculativeEngine, StepRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    tokens: list[int]
    text: str
    finish_reason: str  # the engine's "length", "eos" or "stop"; "cancelled" if aborted
    steps: list[StepRecord]


class IncrementalGeneration:
    """One generation; iterate `deltas()` to run it, then read `result`."""

    def __init__(
        self,
        engine: SpeculativeEngine,
        prompt_ids: list[int],
        policy,
        max_tokens: int,
        sampling: SamplingConfig | None = None,
        seed: int | None = None,
        stop: list[str] | None = None,
        stop_at_eos: bool = True,
    ):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.policy = policy
        self.max_tokens = max_tokens
        self.sampling = sampling or SamplingConfig()
        self.seed = seed
        self.stop = [s for s in (stop or []) if s]
        self.stop_at_eos = stop_at_eos
        self.result: Completion | None = None

    def deltas(self, cancelled: Callable[[], bool] = lambda: False) -> Iterator[str]:
        """Run the generation step by step, yielding non-empty text deltas whose concatenation
        is ``result.text``; ``cancelled()`` is polled between steps."""
        tok = self.engine.pair.tokenizer
        eos = tok.eos_token_id if self.stop_at_eos else None
        holdback = max((len(s) for s in self.stop), default=1) - 1
        emitted = ""
        # DecodeSession's prefill runs outside step()'s no_grad; generate() wraps it all.
        with torch.no_grad():
            session = self.engine.start(self.prompt_ids, self.policy, self.sampling, self.seed)
            reason = "length"
            while len(session.generated) < self.max_tokens:
                if cancelled():
                    reason = "cancelled"
                    break
                new = session.step()
                if eos is not None and eos in new:
                    reason = "eos"
                    break
                text = tok.decode(session.generated)
                if self.stop and any(s in text for s in self.stop):
                    reason = "stop"
                    break
                if len(session.generated) > self.max_tokens:
                    text = tok.decode(session.generated[: self.max_tokens])
                safe = text[: len(text) - holdback].rstrip("\ufffd")
                if len(safe) > len(emitted) and safe.startswith(emitted):
                    yield safe[len(emitted) :]
                    emitted = safe
        out = session.generated[: self.max_tokens]
        if eos is not None and eos in out:
            out = out[: out.index(eos) + 1]
        text = tok.decode(out)
        cuts = [text.find(s) for s in self.stop if s in text]
        if cuts:
            text, reason = text[: min(cuts)], "stop"
        self.result = Completion(out, text, reason, session.steps)
        if not text.startswith(emitted):  # decode() was not prefix-stable: cannot take it back
            log.warning("streamed text %r is not a prefix of the final text %r", emitted, text)
        elif len(text) > len(emitted):
            yield text[len(emitted) :]

    def run(self) -> Completion:
        for _ in self.deltas():
            pass
        assert self.result is not None
        return self.result


def speculation_stats(policy: str, knobs: dict, steps: list[StepRecord]) -> dict:
    """Per-response statistics: means per step, total draft and verification times."""

    def mean(values) -> float:
        return round(float(np.mean(values)), 4) if steps else 0.0

    return {
        "policy": policy,
        "knobs": knobs,
        "steps": len(steps),
        "drafted_per_step": mean([s.drafted for s in steps]),
        "accepted_per_step": mean([s.accepted for s in steps]),
        "tokens_per_step": mean([s.new_tokens for s in steps]),
        "unique_experts_per_step": mean([s.u_bar for s in steps]),
        "draft_ms": round(sum(s.t_draft_ms for s in steps), 3),
        "verify_ms": round(sum(s.t_verify_ms for s in steps), 3),
    }
