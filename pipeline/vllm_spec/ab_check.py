"""The A/B check: whether drafting as the planner chooses it beats holding k fixed (at 0, no
speculation, and optionally at one K) on this replica, judged by what the model cannot leave
out (numpy-free: it runs in vLLM's engine process).

The planner's model prices steady decode steps; what it leaves out (switches, catch-ups,
steps where requests arrive or end, the serving stack's share of the cores) decided the
comparison at 16 requests, where ours lost 5-20% to `none` while its model said drafting paid
at about half of the steps. This check measures the sides themselves: epochs of ``epoch``
steps run either as the planner chooses ("the policy") or held at a fixed k (0: no draft
forward with the plugin), and each epoch's realized rate is every token the engine made over
every millisecond of its steps (schedule to schedule: prefills, switches and catch-ups
included). Per batch-size band (``round(log2 rows)``: 12-22 rows one band, so a batch of 16
that dips to 15 stays in it) one side leads, the policy first, and each other side is run for
one epoch after ``gap`` leader epochs, a gap that doubles each time such a check agrees (from
1 up to MAX_GAP per challenger), is 1 after one that disagrees, and starts again at 2 for
every side when the leader changes. A check is scored against the mean log rate of the leader
epochs just before and after it (the host's speed drifts within seconds, so the pair, not the
history, is the comparison); a challenger takes the lead when a moving average of its checks
puts it MARGIN ahead. An epoch is scored in the band it started in; one whose band changes
ends there, scored if it ran at least half its steps. The first step of an epoch that changed
sides is left out of it: it switches (the catch-up of the draft, the last drafts verified), a
cost of checking that neither side's steady run pays.

What it costs: settled, about one epoch in MAX_GAP + 1 on a challenger (each challenger's
gap grows to MAX_GAP times their number), plus the switches into and out of it; where the
sides are close the checks are frequent and cheap, where they are far apart they seldom trade.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_GAP = 32  # most leader epochs between checks, per challenger
RATE = 0.5  # weight of a check's difference in its challenger's moving average
MARGIN = 0.02  # log-rate lead a challenger needs to take over (hysteresis)
POLICY = -1  # the side that runs as the planner chooses; the others hold k fixed


def band(rows: int) -> int:
    return max(0, round(math.log2(max(rows, 1))))


@dataclass
class _Side:
    lead: float = 0.0  # moving average of its checks' log rate minus their neighbours'
    checks: int = 0
    gap: int = 1  # leader epochs before its next check
    since: int = 0  # leader epochs since its last check
    epochs: int = 0  # epochs it ran (a report)


@dataclass
class _Band:
    sides: dict[int, _Side]
    leader: int = POLICY
    before: float | None = None  # log rate of the last leader epoch
    pending: tuple[int, float, float] | None = None  # a check: its side, rate, neighbour before
    epochs: int = 0
    trades: int = 0  # times the leader changed (a report)
    max_gap: int = field(default=MAX_GAP)


class ABCheck:
    """``held(rows)`` before each choice (the k the step is held at, or None: the planner
    chooses), ``observe(tokens, ms)`` after each step."""

    def __init__(self, epoch: int, fixed: tuple[int, ...] = (0,)) -> None:
        self.epoch = epoch
        self.fixed = tuple(sorted(set(fixed) | {0}))  # the held sides; 0 always among them
        self.bands: dict[int, _Band] = {}
        self._band = -1  # the running epoch's band and side
        self._side = POLICY
        self._switched = False  # the running epoch's first step switches sides (left out)
        self._steps = 0
        self._tokens = 0
        self._ms = 0.0

    def held(self, rows: int) -> int | None:
        """The k this step is held at, or None where the planner chooses."""
        b = band(rows)
        if b != self._band:
            if self._steps:
                self._close(self._steps * 2 >= self.epoch)
            self._start(b)
        return None if self._side == POLICY else self._side

    def observe(self, tokens: int, ms: float) -> None:
        """One finished step of the running epoch: the tokens it made in ``ms``."""
        if self._band < 0 or not math.isfinite(ms) or ms <= 0:
            return
        if self._switched:
            self._switched = False
            return
        self._steps += 1
        self._tokens += tokens
        self._ms += ms
        if self._steps >= self.epoch:
            self._close(True)
            self._start(self._band)

    def _start(self, b: int) -> None:
        s = self.bands.get(b)
        if s is None:
            sides = {side: _Side() for side in (POLICY, *self.fixed)}
            s = self.bands[b] = _Band(sides, max_gap=MAX_GAP * len(self.fixed))
        side = s.leader
        if s.before is not None and s.pending is None:
            # The most overdue challenger; of equals the shortest k (no speculation first).
            due = [(c.since - c.gap, -x) for x, c in s.sides.items() if x != s.leader]
            overdue, x = max(due)
            if overdue >= 0:
                side = -x
        self._switched, self._side = side != self._side, side
        self._band, self._steps, self._tokens, self._ms = b, 0, 0, 0.0

    def _close(self, scored: bool) -> None:
        s = self.bands[self._band]
        s.epochs += 1
        s.sides[self._side].epochs += 1
        if not scored or self._tokens <= 0:
            return
        rate = math.log(self._tokens / self._ms)
        if self._side != s.leader:  # a check: scored once the next leader epoch is in
            s.pending = (self._side, rate, s.before)
            s.sides[self._side].since = 0
            return
        for x, c in s.sides.items():
            c.since += int(x != s.leader)
        s.before = rate
        if s.pending is None:
            return
        x, other, before = s.pending
        s.pending = None
        c = s.sides[x]
        diff = other - (before + rate) / 2
        c.lead = diff if not c.checks else c.lead + RATE * (diff - c.lead)
        c.checks += 1
        if c.lead > MARGIN:  # the challenger is ahead: it leads, everyone re-checked soon
            for y, d in s.sides.items():
                d.lead = -c.lead if y == s.leader else d.lead - c.lead
                d.gap, d.since = 2, 0
            c.lead, s.leader, s.before = 0.0, x, None
            s.trades += 1
        else:  # a check that disagreed is repeated at once, one that agreed waits longer
            c.gap = 1 if diff > MARGIN else min(2 * c.gap, s.max_gap)

    def report(self) -> str:
        parts = []
        for b in sorted(self.bands):
            s = self.bands[b]
            if not s.epochs:
                continue
            low, high = math.ceil(2 ** (b - 0.5)), math.floor(2 ** (b + 0.5))
            rows = f"{low}-{high}" if high > low else str(low)
            sides = ", ".join(
                f"{_name(x)} {c.lead:+.3f} ({c.checks} checks)"
                for x, c in s.sides.items()
                if x != s.leader
            )
            runs = ", ".join(f"{_name(x)} {c.epochs}" for x, c in s.sides.items() if c.epochs)
            parts.append(
                f"{rows} rows: {_name(s.leader)} leads (traded {s.trades} times; the others' "
                f"log tok/ms against it {sides}); epochs run {runs}"
            )
        return "A/B check " + ("; ".join(parts) if parts else "-")


def _name(side: int) -> str:
    return "the policy" if side == POLICY else f"k = {side}"
