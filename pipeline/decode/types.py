"""The decoding contract: what a policy proposes, what a step records, what a generation
returns, and how tokens are sampled. Every other decode module, the policies and serving
speak these types."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Next-token distribution(s) after temperature and top-p (float32)."""
        if logits.dtype != torch.float32:  # (a no-op call still costs after a forward)
            logits = logits.float()
        if self.greedy:
            return torch.softmax(logits, dim=-1)
        probs = torch.softmax(logits / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always the top token).
            drop = sorted_p.cumsum(-1) - sorted_p >= self.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs


@dataclass
class Candidates:
    """Draft proposals: node j has token ``tokens[j]`` and parent ``parents[j]`` (-1: the last
    committed token). ``q[j]`` is the distribution node j was *sampled* from (chain sampling);
    None for nodes chosen deterministically (argmax / top-b)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    q: list[torch.Tensor | None] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend_chain(
        self, token: int, probs: torch.Tensor, greedy: bool, confidence: float | None = None
    ) -> None:
        """Append ``token``, drawn from ``probs``, as the chain's next node (kept for the
        acceptance rule when sampling; a greedy argmax needs none). ``confidence``:
        probs[token] when the caller already has it."""
        self.parents.append(len(self.tokens) - 1)
        self.tokens.append(token)
        self.q.append(None if greedy else probs)
        self.confidences.append(float(probs[token]) if confidence is None else confidence)

    @property
    def is_chain(self) -> bool:
        return all(p == j - 1 for j, p in enumerate(self.parents))


@dataclass(frozen=True)
class StepRecord:
    drafted: int
    verified: int
    accepted: int
    new_tokens: int
    unique_experts: list[int]  # per MoE layer, over the whole verification pass
    t_draft_ms: float
    t_verify_ms: float
    # Draft forward passes the proposal ran (a chain that looked at one more token before
    # stopping at k ran k + 1; a look that ended in k = 0 ran one; `ar` runs none): what the
    # cost model's T_D prices.
    draft_forwards: int = 0
    # Tokens those forwards fed the draft: the catch-up on the last step's committed tokens
    # plus every chain token or tree node fed (what StepLimits.max_draft_tokens bounds).
    draft_tokens: int = 0
    # The target's distributions (temperature, top-p) and the acceptance walk after the
    # verification forward: cheap at T = 0, a real share of a step at T > 0.
    t_accept_ms: float = 0.0

    @property
    def u_bar(self) -> float:
        return float(np.mean(self.unique_experts))


@dataclass
class Generation:
    tokens: list[int]
    text: str
    # "length", "eos", "stop"; a stream stopped early: "cancelled" or "deadline"
    finish_reason: str
    steps: list[StepRecord]

    @property
    def mean_accepted(self) -> float:
        return float(np.mean([s.accepted for s in self.steps])) if self.steps else 0.0


@dataclass(frozen=True)
class StepOutcome:
    candidates: Candidates
    accepted: int
    record: StepRecord
    # The accepted candidate nodes, root to leaf (in a tree, which branch the walk took).
    accepted_nodes: tuple[int, ...] = ()
