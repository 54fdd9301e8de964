"""What `throughput` learns online from a generation's own outcomes: recent acceptance (a
moving average of judged draft tokens, the acceptance model's `recent` feature) and a logit
offset that corrects the offline model for this generation (a domain it under- or overrates).

Outcomes come from verification (the drafted tokens judged) and, at T = 0, from the catch-up
forward after plain steps: it shows for free whether the draft's argmax matched each committed
token that no drafted token was judged on, so recent acceptance keeps moving while speculation
is off."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.acceptance.repeats import RepeatMemory

MAX_OFFSET = 3.0  # the online logit correction stays within this


@dataclass
class OutcomeTracker:
    decay: float  # recent acceptance's decay per outcome (the acceptance model's)
    adapt: float  # learning rate of the logit offset (0: off)
    recent: float | None = None  # None: no outcome yet (read the mode's prior)
    offset: float = 0.0
    # P(accept) the policy predicted for each position it drafted or looked at this step.
    predicted: list[float] = field(default_factory=list)
    _observed_upto: int = -1  # the last text position whose draft outcome is counted
    _catchup: list[bool] = field(default_factory=list)  # this step's catch-up outcomes
    # At T = 0, where each committed position's outcome is recorded for the repeat lookup
    # (pipeline.acceptance.repeats); None: not recorded.
    memory: RepeatMemory | None = None

    def recent_or(self, prior: float) -> float:
        return prior if self.recent is None else self.recent

    def start(self, prompt_len: int) -> None:
        """Outcomes are the generated text's: a position of the prompt is none (a head's first
        catch-up runs over the prompt)."""
        self._observed_upto = max(self._observed_upto, prompt_len - 1)

    def observe_catchup(
        self,
        logits: torch.Tensor,
        committed: list[int],
        cached: int,
        recent: float,
        ahead: int = 1,
    ) -> float:
        """``recent`` moved by the catch-up forward's outcomes (greedy: its ``logits`` row r is
        the draft's prediction of position ``cached`` + r + ``ahead``, Drafter.ROW_AHEAD);
        they are counted for good at the step's update."""
        # Rows up to the last judged position add nothing (after a drafting step that is all
        # of them: no argmax to run); the last row is the next draft's.
        first = max(0, self._observed_upto + 1 - cached - ahead)
        self._catchup = []
        if first < logits.shape[0] - 1:
            rows = logits[first:-1].argmax(-1).tolist()
            at = cached + first + ahead  # the position row `first` predicts
            self._catchup = [tok == committed[at + r] for r, tok in enumerate(rows)]
            if self.memory is not None:
                for r, hit in enumerate(self._catchup):
                    self.memory.observe(at + r, hit)
        for hit in self._catchup:
            recent = self.decay * recent + (1 - self.decay) * float(hit)
        return recent

    def observe_step(self, drafted: int, accepted: int, ctx: int, prior: float) -> None:
        """A verified step of ``drafted`` chain tokens, ``accepted`` of them accepted, drafted
        after ``ctx`` committed tokens."""
        if not (drafted or self._catchup):
            return  # a plain step, or a look that drafted nothing: no outcome
        recent = self.recent_or(prior)
        # The first `accepted` tokens were accepted, the next (if any) rejected; later ones
        # were never judged.
        judged = min(drafted, accepted + 1)
        for hit in self._catchup + [j < accepted for j in range(judged)]:
            recent = self.decay * recent + (1 - self.decay) * float(hit)
        self.recent = recent
        self._observed_upto = ctx + judged - 1
        if self.memory is not None:
            for j in range(judged):
                self.memory.observe(ctx + j, j < accepted)
        # Online recalibration: one gradient step of the log loss on the logit offset per
        # judged token, so a domain the offline model under- or overrates is corrected within
        # a few steps.
        for j in range(judged):
            self.offset += self.adapt * ((j < accepted) - self.predicted[j])
        self.offset = max(-MAX_OFFSET, min(MAX_OFFSET, self.offset))
        self._catchup = []
