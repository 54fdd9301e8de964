"""What turning drafting on or off costs beyond the steady steps, and when a switch pays
(numpy only: it runs in vLLM's engine process).

With the project's plugin a step at k = 0 runs no draft forward, so the two sides of the
choice are not steady states one step apart. Turning drafting on, the first drafted step's
draft pass also catches up every token the steps at 0 skipped; turning it off, the first step
at 0 still verifies the last drafts on vLLM's speculative path (at 16 rows 11-12.5 ms where a
plain step took 8.2-9.6). The step-cost model prices steady steps only (the scheduler does not
fit these): a planner whose best k hovers near the line between 0 and drafting pays them
unpriced (at 16 ShareGPT requests its k changed at 1 step in 9-12, and it lost to both of its
sides).

Measured here: per batch-size band, a moving average of each switch step's time above the
model's price of a steady step of the same shape, on and off apart, from 0 (switching starts
free) and each step's extra clipped to CLIP steady steps: one 16-row catch-up once took 39 ms
more than its steady price, and as the average's first value it held an engine drafting at
16 requests where drafting lost. Used as a ski-rental rule:
while the modelled best k is on the other side of 0 from the current one, the milliseconds it
would save per step add up, and the planner switches once they reach a pair of switches
(there and back); an agreement of the two resets the sum. Opt-in (``price_switches``): in
vLLM at 8 and 16 requests it bought nothing measurable (docs/serving_vllm.md). The unlocks
(``unlock_every``) are spaced by the measured pair in any case (``unlock_after``).
"""

from __future__ import annotations

import numpy as np

from pipeline.vllm_spec.online_step_cost import BANDS, band

# At most this share of the time at 0 goes to unlocking (a pair of switches each): at 16 rows
# a pair cost about two steady steps, so unlock_every's 32 alone would spend 6% of it there.
UNLOCK_SHARE = 0.02
RATE = 0.1  # weight of a new switch step in its band's average
CLIP = 2.0  # most steady steps' time one switch step's extra counts for


class SwitchCost:
    def __init__(self) -> None:
        self.on = np.zeros(BANDS)  # ms a switch on costs above a steady step, per band
        self.off = np.zeros(BANDS)
        self.seen = np.zeros((2, BANDS), dtype=np.int64)  # switch steps measured: on, off
        self.advantage = 0.0  # ms the other side would have saved since the two parted
        self.held = 0  # choices held on their side by the rule (a report)

    def observe(self, on: bool, rows: int, ms: float, steady_ms: float) -> None:
        """One switch step of ``rows`` rows that took ``ms`` where a steady step of its shape
        is priced at ``steady_ms`` (one that came out cheaper counts as free)."""
        b = band(rows)
        extra = min(max(float(ms - steady_ms), 0.0), CLIP * max(float(steady_ms), 0.0))
        side = self.on if on else self.off
        side[b] += RATE * (extra - side[b])
        self.seen[0 if on else 1, b] += 1

    def pair_ms(self, rows: int) -> float:
        b = band(rows)
        return float(self.on[b] + self.off[b])

    def side(
        self,
        current: int,
        best_k: int,
        worth: np.ndarray,
        ms: np.ndarray,
        rows: int,
        floor_ms: float = 0.0,
    ) -> int:
        """``best_k``, or the best k on ``current``'s side of 0 while a switch there and back
        has not yet paid; ``worth``: modelled tokens per ms at each k, ``ms``: the step's; a
        pair of switches costs at least ``floor_ms`` (the catch-up drafting on will make)."""
        if (current > 0) == (best_k > 0):
            self.agree()
            return best_k
        here = 0 if current == 0 else 1 + int(np.argmax(worth[1:]))
        saved = float(ms[here] * (1.0 - worth[here] / worth[best_k]))
        return best_k if self.pays(saved, rows, floor_ms) else here

    def pays(self, saved_ms: float, rows: int, floor_ms: float = 0.0) -> bool:
        """Whether to switch sides now, the other side's modelled best saving ``saved_ms``
        per step over the current one."""
        self.advantage += max(saved_ms, 0.0)
        if self.advantage >= max(self.pair_ms(rows), floor_ms):
            self.advantage = 0.0
            return True
        self.held += 1
        return False

    def agree(self) -> None:
        """The modelled best is on the current side: what the other side saved is gone."""
        self.advantage = 0.0

    def report(self) -> str:
        bands = [
            f"{1 << b}+ rows on {self.on[b]:.1f} off {self.off[b]:.1f}"
            for b in range(BANDS)
            if self.seen[:, b].any()
        ]
        return (
            f"switch ms above a steady step {'; '.join(bands) or '-'}; "
            f"{self.held} choices held on their side of 0"
        )


def unlock_after(every: int, pair_ms: float, ms_at_zero: float) -> float:
    """Choices of 0 in a row before an unlock: ``every``, or more where a pair of switches
    costs more than UNLOCK_SHARE of that many steps at 0."""
    return max(every, pair_ms / (UNLOCK_SHARE * max(float(ms_at_zero), 1e-3)))
