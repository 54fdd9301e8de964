"""The EAGLE-3 head's side of a speculative step: the Drafter contract over a head that reads
the target's hidden states (pipeline.models.eagle3).

Head position i reads the target's features at position i and the embedding of committed
token i + 1, so with L committed tokens the head has L - 1 positions from the target; the last
one's output is the distribution of token L (the first draft). The target's features of the
tokens a step commits come from its verification pass (``observe``, the accepted path's rows),
those of the prompt from its prefill. A drafted token's position reads the head's own output
at its parent; after the step those positions are dropped (``end``) and recomputed from the
target's features next step, as vLLM's EAGLE proposer does.
"""

from __future__ import annotations

import torch

from pipeline.decode.drafter import Drafter
from pipeline.models.eagle3 import Eagle3Head, HeadCache
from pipeline.models.features import feature_tap
from pipeline.models.treemask import ancestor_matrix


class HeadDrafter(Drafter):
    """Drafter over an EAGLE-3 head (``pair.draft`` is an Eagle3Head)."""

    ROW_AHEAD = 2  # head position i reads committed token i + 1 and predicts token i + 2

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        head: Eagle3Head = self.pair.draft
        self.head = head
        self.masked_logits = head.cfg.draft_vocab_size < head.cfg.vocab_size
        self.tap = feature_tap(self.pair.target, head.cfg.aux_layer_ids)
        # Target features of committed positions the cache lacks: rows for positions
        # feats_start, feats_start + 1, ...
        self.feats: torch.Tensor | None = None
        self.feats_start = 0
        self._outs: torch.Tensor | None = None  # head outputs of this step's nodes [n, H]
        self._root_out: torch.Tensor | None = None
        self._blind = False  # no target feature to draft from (a one-token prompt)

    def _new_cache(self) -> HeadCache:
        return HeadCache()

    def cached(self) -> int:
        return len(self.cache)

    def _crop(self, length: int) -> None:
        self.cache.crop(length)

    def _model(self, ids: list[int], **kw) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.head.device
        t = torch.tensor([ids], device=dev)
        positions = kw.get("position_ids")
        if positions is None:
            start = len(self.cache)
            positions = torch.arange(start, start + len(ids), device=dev).view(1, -1)
        logits, out = self.head(
            t, kw["hidden"].unsqueeze(0), positions.to(dev), self.cache, kw.get("attention_mask")
        )
        return logits[0], out[0]

    def _add_feats(self, rows: torch.Tensor) -> None:
        rows = rows.to(self.head.device)
        self.feats = rows if self.feats is None else torch.cat([self.feats, rows])

    def prefill(self, ids: list[int]) -> None:
        """The prompt's target features (its prefill just ran); the head runs them in the first
        step's begin, where the token after the last of them is known."""
        self.committed_len = len(ids)
        if ids:
            self._add_feats(self.tap.latest()[0, -len(ids) :])

    def observe(self, path: list[int]) -> None:
        """The verification pass's features at the accepted path (rows of that forward: the
        last committed token, then each accepted candidate)."""
        self._add_feats(self.tap.latest()[0, path])

    def begin(self, committed: list[int]) -> torch.Tensor:
        start = len(self.cache)
        self.committed_len = len(committed)
        self._tree_parents = []
        drop = start - self.feats_start  # positions the cache already holds
        if drop > 0 and self.feats is not None:
            self.feats, self.feats_start = self.feats[drop:], start
        end = len(committed) - 1  # head positions with a target feature and a next token
        self._blind = end <= start
        if self._blind:
            # A one-token prompt: no target feature yet. The draft is then uniform (still
            # lossless: verification uses the probabilities the draft claims).
            return self._uniform(1)
        ids = committed[start + 1 : end + 1]
        feats = self.feats[: end - start]
        self.in_begin = True
        try:
            logits = self._forward(ids, hidden=feats)
        finally:
            self.in_begin = False
        self.root_context = self.hidden[-2] if len(ids) >= 2 else self._last_committed_hidden
        self._last_committed_hidden = self.hidden[-1]
        self._root_out = self.hidden[-1:]
        self._outs = None
        return self.sampling.probs(logits[-1])

    def _uniform(self, rows: int) -> torch.Tensor:
        vocab = self.head.cfg.vocab_size
        self.hidden = torch.zeros(rows, self.head.cfg.hidden_size, device=self.head.device)
        self.root_context = self._last_committed_hidden = self.hidden[-1]
        probs = torch.full((rows, vocab), 1.0 / vocab, device=self.head.device)
        return probs[0] if rows == 1 else probs

    def extend(self, token: int) -> torch.Tensor:
        if self._blind:
            return self._uniform(1)
        self._tree_parents.append(len(self._tree_parents) - 1)
        parent = self._root_out if self._outs is None else self._outs[-1:]
        logits = self._forward([token], hidden=parent)
        self._outs = self.hidden if self._outs is None else torch.cat([self._outs, self.hidden])
        return self.sampling.probs(logits[-1])

    def expand(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        if self._blind:
            return self._uniform(len(tokens)).view(len(tokens), -1)
        base = self.committed_len - 1  # the head's committed positions
        start = len(self._tree_parents)
        self._tree_parents.extend(parents)
        sees = ancestor_matrix(self._tree_parents)[start:]
        dtype = self.head.dtype
        mask = torch.zeros(len(tokens), base + len(self._tree_parents), dtype=dtype)
        mask[:, base:] = torch.where(sees, 0.0, torch.finfo(dtype).min)
        depth = sees.sum(dim=1) - 1
        positions = (base + depth).view(1, -1)
        rows = [self._root_out if p < 0 else self._outs[p : p + 1] for p in parents]
        logits = self._forward(
            tokens,
            hidden=torch.cat(rows),
            attention_mask=mask.view(1, 1, *mask.shape).to(self.head.device),
            position_ids=positions,
        )
        self._outs = self.hidden if self._outs is None else torch.cat([self._outs, self.hidden])
        return self.sampling.probs(logits)

    def end(self) -> None:
        self._outs = None
        self._crop(min(len(self.cache), max(self.committed_len - 1, 0)))
