"""What an acceptance prediction reads: a few numbers from one draft distribution (the one a
token is drawn from), how far the draft's top token continues text already in the context,
and the generation's recent acceptance. One definition, shared by the traces the model is
fitted on and the policy that queries it while drafting.

The context match is the prompt-lookup signal: when the last n - 1 tokens followed by the
draft's top token already occurred in the context, the target is far more likely to agree
(copying names, repeated phrases, formulas); it separates greedy acceptance better than any
number read off the draft's distribution.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pipeline.acceptance.native_reads import NativeReads, Reads

FEATURE_NAMES = (
    "bias",
    "log_conf",
    "conf",
    "entropy",
    "margin",
    "match",
    "match2",
    "match4",
    "recent",
)
MAX_MATCH = 8  # the longest n-gram the context match looks for
STATS_MATCH = FEATURE_NAMES.index("match") - 1  # where position_stats has it (no bias)


class NgramIndex:
    """Every n-gram (n <= MAX_MATCH) of a growing token sequence, for the context match: one
    dict lookup per n, so a query costs microseconds whatever the context's length. Each
    n-gram keeps its two most recent end positions (pipeline.acceptance.repeats reads them)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], tuple[int, int]] = {}  # (last end, the one before)

    def extend(self, tokens: list[int]) -> None:
        text, ends = self.tokens, self._ends  # (locals: this runs for every committed token)
        for tok in tokens:
            text.append(tok)
            last = len(text) - 1
            suffix = text[-MAX_MATCH:]
            for start in range(len(suffix) - 1, -1, -1):  # n = 1 .. MAX_MATCH
                key = tuple(suffix[start:])
                before = ends.get(key)
                ends[key] = (last, -1 if before is None else before[0])

    def match(self, tail: list[int], token: int) -> int:
        """The largest n such that the last n - 1 tokens of ``tail`` followed by ``token``
        occur in the indexed sequence (0: not even ``token`` does)."""
        best = 0
        for n in range(1, MAX_MATCH + 1):
            if n - 1 > len(tail):
                break
            if tuple(tail[len(tail) - n + 1 :] + [token]) not in self._ends:
                break
            best = n
        return best


def match_features(n: int) -> list[float]:
    """The context match as model inputs: its length (scaled), and whether it reaches 2 and 4."""
    return [min(n, MAX_MATCH) / MAX_MATCH, float(n >= 2), float(n >= 4)]


def match_length(stats: list[float]) -> int:
    """The context match's n back from position_stats' features (its scaled length)."""
    return round(stats[STATS_MATCH] * MAX_MATCH)


def context_features(context: list[int], text: list[int], proposed: list[int]) -> list[list[float]]:
    """match_features of ``proposed[i]`` (the draft's top token at position i) after
    ``context + text[:i]``, against everything before it: what the policy sees drafting along
    this text."""
    index = NgramIndex()
    index.extend(context)
    out = []
    for tok, nxt in zip(text, proposed, strict=True):
        tail = index.tokens[-(MAX_MATCH - 1) :]
        out.append(match_features(index.match(tail, nxt)))
        index.extend([tok])
    return out


def distribution_stats(probs: torch.Tensor) -> torch.Tensor:
    """[..., 4]: log max q, max q, entropy (nats) and top-1 minus top-2 probability of each
    distribution in ``probs`` ([..., vocab]), computed at the decoding temperature."""
    top = probs.topk(2, dim=-1).values
    conf = top[..., 0]
    entropy = torch.special.entr(probs).sum(-1)
    return torch.stack([conf.clamp_min(1e-9).log(), conf, entropy, conf - top[..., 1]], dim=-1)


def _top_stats(
    probs: torch.Tensor, logits: torch.Tensor | None = None, temperature: float = 1.0
) -> tuple[list[float], int]:
    """distribution_stats of one distribution as floats, and its top token, with few tensor
    operations (this runs once per draft token while deciding). ``logits``: given when
    ``probs`` is softmax(logits / temperature) exactly (no top-p): the entropy is then one dot
    product, log Z - sum p z / T with log Z = z_top / T - log p_top, and no vocabulary-sized
    temporary is made. After a draft forward each tensor call here costs several times what
    it costs warm (the forward evicted torch's code from the caches, not the data: the same
    call on a tensor the forward never touched costs as much), so the calls are few and
    conversions are made only when needed."""
    if probs.dtype != torch.float32:
        probs = probs.float()
    values, indices = probs.topk(2)
    top1, top2 = values.tolist()
    top = indices.tolist()[0]
    entropy = math.nan
    if logits is not None:
        if logits.dtype != torch.float32:
            logits = logits.float()
        dot = float(logits[top]) - float(torch.dot(probs, logits))
        entropy = dot / temperature - math.log(top1)
    if not math.isfinite(entropy):  # no logits, or masked ones (-inf) in them
        # -sum p log p as one dot product, a quarter of entr().sum()'s time on a 4k
        # vocabulary; the clamp keeps 0 * log 0 at 0 (top-p zeros, underflow) instead of nan.
        entropy = -float(torch.dot(probs, probs.clamp_min(1e-30).log()))
    return _four_stats(top1, top2, entropy), top


def _four_stats(top1: float, top2: float, entropy: float) -> list[float]:
    """distribution_stats' four numbers, as floats."""
    return [math.log(max(top1, 1e-9)), top1, entropy, top1 - top2]


def stats_of(probs: torch.Tensor) -> list[float]:
    """distribution_stats of one distribution as floats."""
    return _top_stats(probs)[0]


def position_stats(probs: torch.Tensor, index: NgramIndex, tail: list[int]) -> list[float]:
    """What the model reads at one draft position, bar recent acceptance: stats_of(probs) and
    the context match of its top token after ``tail`` (the text's last tokens, chain
    included) in ``index`` (the committed text)."""
    return position_view(probs, index, tail)[0]


def position_view(
    probs: torch.Tensor,
    index: NgramIndex,
    tail: list[int],
    logits: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[list[float], int]:
    """position_stats and the distribution's top token, which a greedy drafter drafts: one
    top-2 serves the features, the draft and its confidence (stats[1]). ``logits``: given
    when ``probs`` is softmax(logits / temperature) exactly (_top_stats: a cheaper entropy)."""
    stats, top = _top_stats(probs, logits, temperature)
    return [*stats, *match_features(index.match(tail, top))], top


def position_view_of_reads(
    reads: Reads, index: NgramIndex, tail: list[int], temperature: float = 1.0
) -> tuple[list[float], int]:
    """position_view from the compiled reads of the position (native_reads; the entropy from
    z_top - p.z as _top_stats takes it from the logits)."""
    top1, top2, top, z_dot, _ = reads
    entropy = z_dot / temperature - math.log(top1)
    return [*_four_stats(top1, top2, entropy), *match_features(index.match(tail, top))], top


def read_position(
    probs: torch.Tensor,
    index: NgramIndex,
    tail: list[int],
    logits: torch.Tensor | None = None,
    temperature: float = 1.0,
    hidden: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    native: NativeReads | None = None,
) -> tuple[list[float], int, list[float] | None]:
    """position_view, made by one compiled call where ``native`` can (then with ``hidden`` times
    the acceptance model's hidden-state ``weights`` [H, 2] too; None when not read here)."""
    if native is not None and logits is not None and hidden is not None and weights is not None:
        reads = native.read(probs, logits, hidden, weights)
        if reads is not None:
            return (*position_view_of_reads(reads, index, tail, temperature), reads[4])
    return (*position_view(probs, index, tail, logits, temperature), None)


def feature_vector(stats: list[float], recent: float) -> list[float]:
    """The model's input for one position: a bias, the distribution's stats, recent
    acceptance (an exponential moving average of the generation's outcomes)."""
    return [1.0, *stats, recent]


def logistic(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)
