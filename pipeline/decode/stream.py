"""One generation run step by step: how it ends (max tokens, EOS, stop strings) and the
text it hands out as it grows (for streaming)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from time import monotonic
from typing import Any, Protocol

import torch

from pipeline.decode.types import Generation, SamplingConfig, StepRecord


class Session(Protocol):
    """What a stream drives: an engine's decode session (pipeline.decode.engine)."""

    generated: list[int]
    steps: list[StepRecord]

    def step(self) -> list[int]: ...

    def close(self) -> None: ...


class SessionStarter(Protocol):
    """What a stream needs of an engine (the single and the batched one both are); a protocol
    so the engine can hand out streams without this module importing it back."""

    pair: Any  # a ModelPair: its tokenizer decodes the text

    def start(
        self, prompt_ids: list[int], policy: Any, sampling: SamplingConfig | None, seed: int | None
    ) -> Session: ...


class GenerationStream:
    """One generation and how it ends (max tokens, EOS, the first stop string), run by
    iterating ``deltas()`` (text as it grows, for streaming), ``step_deltas()`` (the same, one
    yield per step, with a deadline) or by ``run()``; the result is in ``result``.

    A delta never holds text the finished generation will not: the last len(longest stop) - 1
    characters are held back (the next step may complete a stop string), as is a trailing
    U+FFFD (a UTF-8 character split across tokens).
    """

    def __init__(
        self,
        engine: SessionStarter,
        prompt_ids: list[int],
        policy,
        max_new_tokens: int,
        sampling: SamplingConfig | None,
        seed: int | None,
        stop: list[str] | None,
        stop_at_eos: bool,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.policy = policy
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling or SamplingConfig()
        self.seed = seed
        self.stop = [s for s in (stop or []) if s]
        self.stop_at_eos = stop_at_eos
        self.result: Generation | None = None

    def deltas(self, cancelled: Callable[[], bool] = lambda: False) -> Iterator[str]:
        """Run step by step, yielding non-empty text deltas whose concatenation is the final
        ``result.text``; ``cancelled()`` is polled between steps (finish reason "cancelled")."""
        return (delta for delta in self.step_deltas(cancelled) if delta)

    def step_deltas(
        self, cancelled: Callable[[], bool] = lambda: False, deadline: float | None = None
    ) -> Iterator[str]:
        """Run step by step, yielding once per unit of work so that a caller (a server's
        heartbeat, its fairness between requests) regains control after each: "" once the
        session is started (the prefill), then one delta per engine step (possibly ""), then
        the final remainder (possibly ""): len(result.steps) + 2 yields in all. The deltas
        concatenate to ``result.text``. ``cancelled()`` and the ``deadline`` (a
        time.monotonic() instant) are checked before every step: finish reason "cancelled" or
        "deadline"."""
        tok = self.engine.pair.tokenizer
        eos = tok.eos_token_id if (self.stop_at_eos and tok is not None) else None
        holdback = max((len(s) for s in self.stop), default=1) - 1
        emitted = ""
        with torch.no_grad():
            session = self.engine.start(self.prompt_ids, self.policy, self.sampling, self.seed)
        try:
            yield ""
            reason = "length"
            while len(session.generated) < self.max_new_tokens:
                if cancelled():
                    reason = "cancelled"
                    break
                if deadline is not None and monotonic() >= deadline:
                    reason = "deadline"
                    break
                with torch.no_grad():
                    new = session.step()
                if eos is not None and eos in new:
                    reason = "eos"
                    yield ""  # the final remainder below holds this step's text
                    break
                delta = ""
                if tok is not None:
                    text = tok.decode(session.generated[: self.max_new_tokens])
                    if any(s in text for s in self.stop):
                        reason = "stop"
                        yield ""
                        break
                    safe = text[: len(text) - holdback].rstrip("\ufffd")
                    if len(safe) > len(emitted) and safe.startswith(emitted):
                        delta, emitted = safe[len(emitted) :], safe
                yield delta
            out = session.generated[: self.max_new_tokens]
            if eos is not None and eos in out:
                out = out[: out.index(eos) + 1]
            text = tok.decode(out) if tok is not None else ""
            cuts = [text.find(s) for s in self.stop if s in text]
            if cuts:
                text, reason = text[: min(cuts)], "stop"
            self.result = Generation(out, text, reason, session.steps)
            yield text[len(emitted) :] if text.startswith(emitted) else ""
        finally:
            session.close()  # a batched session's cache slots go back at once
        # (decode() not prefix-stable would leave the stream unable to take text back; the
        # result still holds the exact final text.)

    def run(self) -> Generation:
        for _ in self.deltas():
            pass
        assert self.result is not None
        return self.result
