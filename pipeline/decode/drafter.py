"""The draft model's side of a speculative step (catch up, extend a chain, expand a tree
level, roll back)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from pipeline.decode.randomness import RandomSource
from pipeline.decode.step_limits import StepLimits
from pipeline.decode.types import SamplingConfig
from pipeline.models.kvcache import crop_to
from pipeline.models.loading import ModelPair
from pipeline.models.treemask import ancestor_matrix


class Drafter:
    """The draft model's side of a step: catch up on committed tokens, extend a chain, expand a
    tree level; rolled back to the committed prefix after every step.

    It also keeps the draft's last-layer hidden state of every row it just computed
    (``hidden``): the state that produced a drafted token's distribution is the cheap, already
    paid-for context an expert predictor reads (pipeline.predictor.model). ``root_context`` is
    that state for the last committed token (the one the verification pass starts with).

    With ``limits`` a forward that would take the step past its draft forwards or draft
    tokens raises StepLimitExceeded before it runs (the prompt's prefill is not a step).
    """

    # Row r of ``begin``'s forward (over the positions from cached() on) is the distribution
    # of text position cached() + r + ROW_AHEAD: a draft model's row reads the token at its
    # own position (an EAGLE-3 head's reads the next one: 2).
    ROW_AHEAD = 1
    # Whether some logits are -inf by construction (a head's reduced vocabulary): statistics
    # that read the logits (features._top_stats) then have to read the distribution instead.
    masked_logits = False

    def __init__(
        self,
        pair: ModelPair,
        sampling: SamplingConfig,
        rng: RandomSource,
        limits: StepLimits | None = None,
    ):
        self.pair = pair
        self.sampling = sampling
        self.rng = rng  # the session's one source of randomness (pipeline.decode.randomness)
        self.cache = self._new_cache()
        self.committed_len = 0
        self._tree_parents: list[int] = []  # nodes appended to the cache this step
        self.hidden: torch.Tensor | None = None  # [rows, hidden] of the last forward
        self.logits: torch.Tensor | None = None  # [rows, vocab] of the last forward
        self.root_context: torch.Tensor | None = None
        self._last_committed_hidden: torch.Tensor | None = None
        self.limits = limits
        self.forwards = 0  # draft forward passes since the engine last reset it (one step)
        self.tokens = 0  # tokens those forwards fed the draft
        self.in_prefill = self.in_begin = False

    def _new_cache(self):
        return DynamicCache(config=self.pair.draft.config)

    def start_step(self) -> None:
        """Reset the per-step counters (and so the step's budget)."""
        self.forwards = 0
        self.tokens = 0

    def _forward(self, ids: list[int], **kw) -> torch.Tensor:
        if self.limits is not None:
            self.limits.check_forward(self.forwards + 1, self.tokens + len(ids))
        return self._run(ids, **kw)

    def _run(self, ids: list[int], **kw) -> torch.Tensor:
        self.forwards += 1
        self.tokens += len(ids)
        self.logits, self.hidden = self._model(ids, **kw)
        return self.logits

    # The cache and the model call, the only parts a batched drafter replaces
    # (pipeline.decode.batched).
    def _model(self, ids: list[int], **kw) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [n, vocab], last hidden state [n, hidden]) of the new tokens."""
        t = torch.tensor([ids], device=self.pair.device)
        out = self.pair.draft(
            t, past_key_values=self.cache, use_cache=True, output_hidden_states=True, **kw
        )
        return out.logits[0], out.hidden_states[-1][0]

    def cached(self) -> int:
        """Positions in the draft's cache."""
        return self.cache.get_seq_length()

    def _crop(self, length: int) -> None:
        crop_to(self.cache, length)

    def prefill(self, ids: list[int]) -> None:
        """Feed the prompt (all but its last token) before the first step, as the target's
        prefill is, so that no step's draft time includes it."""
        if ids:
            self.in_prefill = True  # (a batched drafter marks its forward as a prefill)
            try:
                self._run(ids)  # unbudgeted: the prompt's length is the server's to bound
            finally:
                self.in_prefill = False
            self._last_committed_hidden = self.hidden[-1]
            self.committed_len = len(ids)  # what end() rolls back to, even with no draft

    def begin(self, committed: list[int]) -> torch.Tensor:
        """Feed committed tokens the cache lacks; the distribution after the last one."""
        pending = committed[self.cached() :]
        self.committed_len = len(committed)
        self._tree_parents = []
        self.in_begin = True  # (a batched drafter marks a step's first forward)
        try:
            logits = self._forward(pending)
        finally:
            self.in_begin = False
        # The state after the second-to-last committed token: in this forward when it fed two
        # or more tokens, else the last committed state of the previous step.
        if len(pending) >= 2:
            self.root_context = self.hidden[-2]
        else:
            self.root_context = self._last_committed_hidden
        self._last_committed_hidden = self.hidden[-1]
        return self.sampling.probs(logits[-1])

    def extend(self, token: int) -> torch.Tensor:
        """Chain: append ``token``; the distribution after it."""
        self._tree_parents.append(len(self._tree_parents) - 1)
        return self.sampling.probs(self._forward([token])[-1])

    def expand(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """Tree: append a level of nodes (``parents`` index earlier appended nodes, -1 = root);
        their next-token distributions, one row each."""
        base = self.committed_len
        start = len(self._tree_parents)
        self._tree_parents.extend(parents)
        sees = ancestor_matrix(self._tree_parents)[start:]  # rows: new nodes
        dtype = self.pair.draft.dtype
        mask = torch.zeros(len(tokens), base + len(self._tree_parents), dtype=dtype)
        mask[:, base:] = torch.where(sees, 0.0, torch.finfo(dtype).min)
        depth = sees.sum(dim=1) - 1
        positions = (base + depth).view(1, -1).to(self.pair.device)
        logits = self._forward(
            tokens,
            attention_mask=mask.view(1, 1, *mask.shape).to(self.pair.device),
            position_ids=positions,
        )
        return self.sampling.probs(logits)

    def sample(self, probs: torch.Tensor) -> int:
        """x ~ probs (the argmax when greedy). Verification assumes the drafted token follows
        ``probs`` exactly: a policy decides whether to draft before it samples, never by
        looking at the sample and dropping it."""
        if self.sampling.greedy:
            return int(probs.argmax())
        return self.rng.categorical(probs)

    def observe(self, path: list[int]) -> None:
        """The verification pass committed the rows ``path`` of its forward (a draft model
        needs nothing from it; an EAGLE-3 head reads the target's features there)."""

    def end(self) -> None:
        self._crop(self.committed_len)
