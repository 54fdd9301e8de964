"""What each side of 0, drafting or not, costs a step beyond the decode-step model (numpy
only: it runs in vLLM's engine process).

The step-cost model (pipeline.vllm_spec.online_step_cost) is fitted on steady decode steps;
the steps it does not fit still take time, and not the same on both sides. Drafting, each new
request's prompt is prefilled by the draft too (at once, or by the catch-up of the first
drafted step after steps at 0, pipeline.vllm_spec.catch_up_draft), and every switch on pays
the catch-up of what the steps at 0 skipped; at 0 a new prompt costs the target alone. At 16
ShareGPT requests in vLLM the model priced a 16-row step at k = 1 (11.9 ms, 27.5 tokens) above
one at 0 (7.4 ms, 16 tokens) while ours ran at 0.85 x `none`: 194 catch-up steps there cost
9.3 ms each above their steady price, and the draft caught up 43,192 tokens, mostly prompts.

So per batch-size band and side, the excess (a step's time - the model's price of a steady
step of its rows, k and verified positions) of the steps the policy chose on that side, a
fitted step counting 0 (its excess is the fit's to learn), per token they made: arrivals come
with the tokens made, not with the steps (a mean per step, tried first, priced long chains
below short ones for the same arrivals and lost 5-10% more at 16 requests). Decayed DECAY a
step of the band from PRIOR_TOKENS tokens at 0 ms (a side not chosen fades back to it), each
step's excess clipped to CLIP steady steps; the choice prices each k at its steady price plus
its expected tokens times its side's excess per token. Steps the planner drafts to measure
(unlocks) are left out: a pair of them carries a whole stretch's catch-up, which steady
drafting does not. Opt-in (``price_overhead``): in vLLM at 1, 8 and 16 requests it lost as
much as it won (docs/serving_vllm.md).
"""

from __future__ import annotations

import numpy as np

from pipeline.vllm_spec.online_step_cost import BANDS, band

DECAY = 0.995  # per step of the band
PRIOR_TOKENS = 100.0  # tokens at 0 ms the excess per token starts from
CLIP = 2.0  # most steady steps' time one step's excess counts for


class SideOverhead:
    def __init__(self) -> None:
        # per band, [0] at 0 and [1] drafting: decayed sums of excess ms and of tokens made
        self.excess = np.zeros((BANDS, 2))
        self.tokens = np.full((BANDS, 2), PRIOR_TOKENS)

    def observe(
        self, rows: int, drafting: bool, ms: float, steady_ms: float, tokens: float
    ) -> None:
        """One step the policy chose, of ``rows`` rows, that took ``ms`` and made ``tokens``
        where a steady step of its shape is priced at ``steady_ms``."""
        steady = max(float(steady_ms), 0.0)
        b, side = band(rows), int(drafting)
        # Both sides fade, the other toward the prior: a side the policy left on a bad
        # stretch is tried again once its evidence has faded.
        self.excess[b] *= DECAY
        self.tokens[b] = DECAY * self.tokens[b] + (1.0 - DECAY) * PRIOR_TOKENS
        self.excess[b, side] += min(max(float(ms) - steady, -0.5 * steady), CLIP * steady)
        self.tokens[b, side] += max(float(tokens), 0.0)

    def per_token(self, rows: int) -> np.ndarray:
        """The excess ms per token made at 0 and drafting, at ``rows`` rows."""
        b = band(rows)
        return self.excess[b] / self.tokens[b]

    def ms(self, rows: int, tokens: np.ndarray) -> np.ndarray:
        """The extra ms of a step at each k of 0..len(tokens)-1 making ``tokens``."""
        at_zero, drafting = self.per_token(rows)
        return np.asarray(tokens) * np.where(np.arange(len(tokens)) > 0, drafting, at_zero)

    def report(self) -> str:
        mean = self.excess / self.tokens
        parts = [
            f"{1 << b}+ rows at 0 {mean[b, 0]:.3f} drafting {mean[b, 1]:.3f}"
            for b in range(BANDS)
            if self.excess[b].any()
        ]
        return "ms per token beyond the model " + (", ".join(parts) or "-")
