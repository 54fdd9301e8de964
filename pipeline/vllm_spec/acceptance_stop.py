"""The acceptance stop: inside vLLM's ``draft_model`` drafter, a row's chain ends where the
pair's offline acceptance model (pipeline.acceptance.model, what our engine's `throughput`
policy reads) says the next token is no longer worth its draft forward.

The scheduler's k is the step's longest chain; at every drafted position the stop reads, per
row, what the model was fitted on (pipeline.acceptance.features): the draft's distribution
(confidence, entropy, top-2 margin), how far the drafted token continues an n-gram of the
request's own text (copied names and lines are accepted far more often), the draft's last
hidden state, and the request's recent acceptance (a moving average of its verified
outcomes). ``reach`` is the probability that the row's chain so far is all accepted. A token
whose own acceptance (`current`) takes ``reach`` below ``stop_below`` is not proposed; after
a kept token the row drafts on only while ``reach`` times the `next` model's acceptance of the
token after it stays at or above it. Tokens not proposed are -1 (the scheduler cuts a chain at
its first), and once every row has stopped the step's drafting loop ends: the draft forwards
after it do not run. ``stop_below`` is the extra cost of one more drafted token over the cost
per token the engine makes (about 1.5 ms over 4 ms at one request here: 0.3-0.4).

Greedy batches only: at T > 0 the rejection test reads the probabilities of every drafted
position, and the model's `sampled` part predicts sum min(p, q), not the argmax's fate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.acceptance.features import (
    FEATURE_NAMES,
    MAX_MATCH,
    NgramIndex,
    logistic,
    match_features,
)
from pipeline.acceptance.model import AcceptanceModel, ModeModel


class StopDrafting(Exception):
    """Every row of the step has stopped: the drafting loop ends here."""


@dataclass
class RowText:
    """What the stop knows of one request: its committed text (an n-gram index) and recent
    acceptance."""

    index: NgramIndex
    recent: float


@dataclass
class StepChains:
    """The step's chains while they are drafted."""

    rows: list[RowText | None]  # None: a row not drafting this step (a prompt chunk)
    k: int  # the step's longest chain
    reach: list[float] = field(default_factory=list)
    recent: list[float] = field(default_factory=list)  # recent, as if the chain is accepted
    chains: list[list[int]] = field(default_factory=list)
    live: list[bool] = field(default_factory=list)
    position: int = 0  # the drafted position about to be judged

    def __post_init__(self) -> None:
        n = len(self.rows)
        self.reach = [1.0] * n
        self.recent = [row.recent if row is not None else 0.0 for row in self.rows]
        self.chains = [[] for _ in range(n)]
        self.live = [row is not None for row in self.rows]


class AcceptanceStop:
    def __init__(self, model: AcceptanceModel, stop_below: float) -> None:
        if not 0.0 < stop_below < 1.0:
            raise ValueError(f"stop_below {stop_below}: between 0 and 1 (0: no stop)")
        self.mode: ModeModel = model.mode(greedy=True)
        self.decay = model.decay
        self.stop_below = stop_below
        self.weights = self.mode.hidden_weights("both")  # [H, 2] or None
        n = len(FEATURE_NAMES)
        if self.weights is None and max(len(self.mode.current), len(self.mode.next)) > n:
            raise ValueError("the acceptance model reads the hidden state in one part only")
        self.w_current, self.w_next = self.mode.current[:n], self.mode.next[:n]
        self.texts: dict[str, RowText] = {}
        self.step: StepChains | None = None
        self.stopped_steps = 0  # steps whose loop ended before k (a report)

    def begin(
        self,
        req_ids: list[str],
        token_ids: np.ndarray,
        committed: np.ndarray,
        starts: np.ndarray,
        lens: np.ndarray,
        step_ids: list[int],
        next_ids: list[int],
        rejected: list[int] | None,
        k: int,
    ) -> None:
        """Bring each request's text and recent acceptance up to this step, before the
        drafter's first pass. ``token_ids``/``committed``: the runner's committed tokens and
        their counts per row (the step's sampled ones not yet among them); ``starts``,
        ``lens``: the step's rows; ``step_ids``: the step's tokens (the drafter's input);
        ``next_ids``: each row's token after the accepted ones; ``rejected``: drafted tokens
        the step rejected per row (None: it verified none)."""
        rows: list[RowText | None] = []
        offset = 0
        for i, req_id in enumerate(req_ids):
            start, n_tokens = int(starts[i]), int(lens[i])
            text = self.texts.get(req_id)
            if text is None:
                text = self.texts[req_id] = RowText(NgramIndex(), self.mode.prior)
            n = int(committed[i])
            known = len(text.index.tokens)
            if known < n:
                text.index.extend(token_ids[i, known:n].tolist())
            drafted = start + n_tokens - n  # the step's verified drafts of this row
            if drafted < 0 or len(text.index.tokens) != n:
                rows.append(None)  # a prompt chunk, or a text this stop cannot follow
                offset += n_tokens
                continue
            accepted = drafted - (rejected[i] if rejected is not None else 0)
            recent, decay = text.recent, self.decay
            for hit in [1.0] * accepted + [0.0] * (accepted < drafted):
                recent = decay * recent + (1 - decay) * hit
            text.recent = recent
            first = offset + n_tokens - drafted
            text.index.extend(step_ids[first : first + accepted] + [next_ids[i]])
            rows.append(text)
            offset += n_tokens
        self.step = StepChains(rows, k)

    def judge(self, logits: torch.Tensor, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        """Judge the drafted ``tokens`` (one per row) of the step's next position from the
        draft's ``logits`` and last-layer ``hidden`` states there; raises StopDrafting when no
        row drafts on and positions of k remain."""
        step = self.step
        assert step is not None, "begin() before judge()"
        probs = torch.softmax(logits.float(), dim=-1)
        top = probs.topk(2, dim=-1).values.tolist()
        entropy = (-(probs * probs.clamp_min(1e-30).log()).sum(-1)).tolist()
        products = (hidden.float() @ self.weights).tolist() if self.weights is not None else None
        drafted = tokens.tolist()
        decay, floor = self.decay, self.stop_below
        for i, text in enumerate(step.rows):
            if not step.live[i] or text is None:
                continue
            chain = step.chains[i]
            tail = (text.index.tokens[-(MAX_MATCH - 1) :] + chain)[-(MAX_MATCH - 1) :]
            (top1, top2), token = top[i], drafted[i]
            stats = [
                math.log(max(top1, 1e-9)),
                top1,
                entropy[i],
                top1 - top2,
                *match_features(text.index.match(tail, token)),
            ]
            now, after = self.predict(
                stats, step.recent[i], products[i] if products is not None else None
            )
            reach = step.reach[i] * now
            if reach < floor:
                step.live[i] = False
                continue
            chain.append(token)
            step.reach[i] = reach
            step.recent[i] = decay * step.recent[i] + (1 - decay)
            step.live[i] = reach * after >= floor
        step.position += 1
        if step.position < step.k and not any(step.live):
            self.stopped_steps += 1
            raise StopDrafting

    def predict(
        self, stats: list[float], recent: float, products: list[float] | None
    ) -> tuple[float, float]:
        """P(the token drafted here is accepted) and the `next` model's for the token after
        it: ModeModel.chain_view's for one token, in a few float operations (this runs per
        row and drafted position). ``products``: the hidden state times the two models'
        hidden-state weights."""
        f = (1.0, *stats, recent)
        z_now = sum(w * x for w, x in zip(self.w_current, f, strict=True))
        z_after = sum(w * x for w, x in zip(self.w_next, f, strict=True))
        if products is not None:
            z_now += products[0]
            z_after += products[1]
        return logistic(z_now), logistic(z_after)

    def proposals(self, batch: int, device: torch.device) -> torch.Tensor:
        """The step's proposals [batch, k] when its loop ended early: each row's kept chain,
        -1 after it (a row not judged drafts nothing)."""
        step = self.step
        assert step is not None
        self.step = None
        out = torch.full((batch, step.k), -1, dtype=torch.int64)
        for i, chain in enumerate(step.chains):
            if chain:
                out[i, : len(chain)] = torch.tensor(chain, dtype=torch.int64)
        return out.to(device)

    def finish(self, drafted: torch.Tensor) -> torch.Tensor:
        """``drafted`` (the loop's own proposals, [batch, k]) with each judged row's tokens
        after its kept chain set to -1 (a row not judged keeps vLLM's)."""
        step = self.step
        assert step is not None
        self.step = None
        out = drafted.clone()
        for i, chain in enumerate(step.chains):
            if step.rows[i] is not None and len(chain) < out.shape[1]:
                out[i, len(chain) :] = -1
        return out

    def forget(self, alive: set[str]) -> None:
        for req_id in [r for r in self.texts if r not in alive]:
            del self.texts[req_id]


def acceptance_stop_for(vllm_config: Any) -> AcceptanceStop | None:
    """The stop the scheduler's settings ask for (``stop_below`` > 0), or None; a ValueError
    at engine start where it cannot work."""
    from pipeline.vllm_spec.planner_config import PlannerConfig
    from pipeline.vllm_spec.priors import find_artifact
    from pipeline.vllm_spec.scheduler import CostAwareScheduler

    below = PlannerConfig.from_env().stop_below
    if below <= 0:
        return None
    cls = vllm_config.scheduler_config.get_scheduler_cls()
    spec = vllm_config.speculative_config
    if not issubclass(cls, CostAwareScheduler):
        raise ValueError(
            "stop_below needs the cost-aware scheduler (pipeline.vllm_spec.scheduler."
            f"CostAwareScheduler), which cuts the chains the stop marks; this engine runs {cls}"
        )
    if spec is None or spec.method != "draft_model" or spec.disable_padded_drafter_batch:
        raise ValueError(
            "stop_below: a draft model's acceptance model, read by vLLM's "
            "draft_model drafter with its padded batch (method draft_model)"
        )
    if spec.use_heterogeneous_vocab or spec.use_local_argmax_reduction:
        # The stop drafts the argmax of the draft's full logits itself.
        raise ValueError(
            "stop_below: a draft of the target's vocabulary, without local argmax reduction"
        )
    found = find_artifact(Path(spec.model), "acceptance.json")
    if found is None:
        raise ValueError(
            f"stop_below: no acceptance model for the draft {spec.model}; train "
            "one with python -m jobs.train_acceptance"
        )
    return AcceptanceStop(AcceptanceModel.load(found), below)
