"""What drafting costs beyond the steady decode step: the draft prefills every prompt (numpy
only: it runs in vLLM's engine process).

The step-cost model (pipeline.vllm_spec.online_step_cost) prices steady decode steps, where
the draft processes each row's new tokens. A row drafts only once its draft has also seen
the row's prompt: prefilled by the draft in the step the prompt arrives in, or caught up by
the first drafted step after steps at 0 (pipeline.vllm_spec.catch_up_draft). Without
speculation nobody pays that, so over a request's life drafting costs its prompt's draft
prefill more than staying at 0: per token the request makes, ``ms_per_token x prompt /
output``. At 16 ShareGPT requests in vLLM (prompts about 1.5 x the 128 tokens made) that was
about 0.06 ms a token, 14% of a 16-row step's 0.46 ms per token, more than the 8% by which the
model priced k = 1 above k = 0: ours drafted at half its steps and ran at 0.85 x `none` where
an engine held at 0 ran at 1.02.

So the choice prices a step at k > 0 at its steady price plus its expected tokens times the
batch's mean ``prompt / output`` times the draft's prefill ms per token. That price per token
is measured on the replica from the steps that catch the draft up: their time above a steady
step's price against the tokens they caught up (the scheduler counts them: each row's
computed tokens the draft has not processed), the slope of a line with an intercept (a
switch's own cost: most catch-ups are a few tokens a row, and a ratio would price them at the
switch), decayed DECAY a catch-up, from a prior slope worth a catch-up of PRIOR_TOKENS
tokens: the step-cost fit's ``d_row``, what one more row's token adds to a draft round (a
drafting engine whose arrivals are prefilled in drafted steps never catches up, and would
otherwise price prompts at nothing). A request's output is its ``max_tokens`` or, once
requests have ended, at most their mean output (decayed): served requests often end well
before their bound.
"""

from __future__ import annotations

from typing import Any

import numpy as np

DECAY = 0.95  # per catch-up step, of the prefill price's evidence
PRIOR_TOKENS = 64.0  # the prior slope is worth a catch-up of this many tokens
OUTPUT_DECAY = 0.98  # per ended request, of the mean output's evidence
DEFAULT_OUTPUT = 256  # a request's output where it sets no max_tokens and none has ended


class DraftPrefill:
    def __init__(self, cost: Any) -> None:
        self.cost = cost  # the step-cost fit (online_step_cost.OnlineStepCost): the prior
        # decayed sums over catch-up steps: 1, tokens, tokens^2, excess ms, tokens x excess
        self.sums = np.zeros(5)
        self.prior_weight = PRIOR_TOKENS**2  # the prior slope's information, decayed too
        self.caught_up = 0  # tokens caught up over the run (a report)
        self._rows = 1  # the batch size the price was last asked at (a report)
        self._output_sum = self._output_n = 0.0  # decayed, over ended requests
        self.shapes: dict[str, tuple[int, int]] = {}  # id -> prompt tokens, max_tokens or 0

    def ms_per_token(self, rows: int) -> float:
        """The draft's prefill ms per token: the catch-ups' measure, from the fit's ``d_row``
        at ``rows`` rows."""
        self._rows = rows
        return max(self._line(rows)[1], 0.0)

    def _line(self, rows: int) -> np.ndarray:
        """The catch-ups' excess ms against their tokens: intercept and slope."""
        prior = max(self.cost.coefficient("d_row", rows), 0.0) if self.prior_weight > 1 else 0.0
        n, t, tt, e, te = self.sums
        w = self.prior_weight
        return np.linalg.solve([[n + 1e-3, t], [t, tt + w]], [e, te + w * prior])

    def set_shape(self, request_id: str, prompt_tokens: int, max_tokens: int | None) -> None:
        self.shapes[request_id] = (int(prompt_tokens), int(max_tokens or 0))

    def observe_catch_up(self, excess_ms: float, tokens: int) -> None:
        """A step that caught up ``tokens`` of the draft, ``excess_ms`` above its steady
        price."""
        if tokens <= 0:
            return
        t, e = float(tokens), float(excess_ms)
        self.sums = DECAY * self.sums + np.array([1.0, t, t * t, e, t * e])
        self.prior_weight *= DECAY
        self.caught_up += int(tokens)

    def ended(self, request_id: str, made: int) -> None:
        """A request ended (or was aborted) after ``made`` output tokens."""
        if self.shapes.pop(request_id, None) is not None and made > 0:
            self._output_sum = OUTPUT_DECAY * self._output_sum + made
            self._output_n = OUTPUT_DECAY * self._output_n + 1.0

    def forget(self, alive: set[str]) -> None:
        for gone in set(self.shapes) - alive:
            del self.shapes[gone]

    def per_token(self, request_ids: list[str]) -> float:
        """The draft's prefill ms per token the batch makes drafting (a row unknown counts
        0)."""
        ratio = sum(p / max(o, 1.0) for p, o in self._shapes(request_ids))
        return self.ms_per_token(len(request_ids)) * ratio / len(request_ids) if ratio else 0.0

    def catch_up_ms(self, request_ids: list[str]) -> float:
        """What catching up the rows' whole lives (prompt and output) costs the draft: the
        most a catch-up after a long stretch at 0 costs (a row's backlog ends with it)."""
        tokens = sum(p + o for p, o in self._shapes(request_ids))
        return self.ms_per_token(len(request_ids)) * tokens if tokens else 0.0

    def _shapes(self, request_ids: list[str]):
        """Each known row's prompt tokens and expected output tokens."""
        mean = self._output_sum / self._output_n if self._output_n else 0.0
        for request in request_ids:
            shape = self.shapes.get(request)
            if shape is not None:
                bound = shape[1] or DEFAULT_OUTPUT
                yield shape[0], (min(bound, mean) if mean else bound)

    def report(self) -> str:
        fixed, slope = self._line(self._rows)
        mean = self._output_sum / self._output_n if self._output_n else float("nan")
        return (
            f"draft prefill {slope:.4f} ms/token (catch-ups' intercept {fixed:.2f} ms) over "
            f"{self.caught_up} caught-up tokens; mean output of ended requests {mean:.0f}"
        )
