"""What happened the last time the text was here: at T = 0, whether the draft's argmax matched
the token after the most recent earlier occurrence of the context's longest suffix (2 to
MAX_MATCH tokens). Text that repeats itself (a loop of lines, a copied block) repeats its
outcomes too: the draft that agreed after this n-gram before agrees again, and the one that
missed misses again. The `next` model reads it (ModeModel.repeat: a weight for "agreed there"
and one for "missed there", added to its logit); nothing else says so before the forward that
would show the next token, and the draft's hidden state at a line break can say the opposite.

One definition for the traces the weights are fitted on (``repeat_indicators``; a head's
chains: ``chain_repeat_indicators``) and the policy deciding online (``RepeatMemory.outcome``).
Online the outcome of every committed position is known at T = 0 (verification judges the
drafted tokens, the catch-up forward shows the rest); the chain being drafted is not in the
memory yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.acceptance.features import MAX_MATCH, NgramIndex

MIN_REPEAT = 2  # the shortest suffix whose earlier occurrence counts


class RepeatMemory(NgramIndex):
    """The committed text's n-grams and the draft's outcome at each committed position the
    policy has seen judged."""

    def __init__(self) -> None:
        super().__init__()
        self.agreed: dict[int, bool] = {}  # text position -> the draft's argmax matched it

    def observe(self, position: int, agreed: bool) -> None:
        self.agreed[position] = bool(agreed)

    def outcome(self, tail: Sequence[int], longest: int = MAX_MATCH) -> bool | None:
        """The outcome after the most recent earlier occurrence in the committed text of the
        longest suffix of ``tail`` (the text's last tokens, chain included) whose follower's
        outcome is known (the latest occurrence may end at the last committed token); None
        when there is none. ``longest``: no longer suffix occurs (the context match of the
        tail's last token, NgramIndex.match, when the caller has it: none is looked up)."""
        for n in range(min(MAX_MATCH, len(tail), longest), MIN_REPEAT - 1, -1):
            for end in self._ends.get(tuple(tail[len(tail) - n :]), ()):
                if end >= 0 and (seen := self.agreed.get(end + 1)) is not None:
                    return seen
        return None


def indicators(outcome: bool | None) -> tuple[float, float]:
    """(agreed, missed) as the model's two inputs; (0, 0) when the text was never here."""
    return (float(outcome is True), float(outcome is False))


def repeat_indicators(tokens: Sequence[int], labels: Sequence[float]) -> np.ndarray:
    """[n, 2] per position i of a traced text: indicators of the outcome the policy sees when it
    decides about position i + 1 with token i drafted (labels: >= 0.5 agreed), the positions
    before i committed and judged."""
    memory, out = RepeatMemory(), np.zeros((len(tokens), 2))
    for i, tok in enumerate(tokens):
        tail = [int(t) for t in tokens[max(0, i - MAX_MATCH + 1) : i + 1]]
        out[i] = indicators(memory.outcome(tail))
        memory.extend([int(tok)])
        memory.observe(i, labels[i] >= 0.5)
    return out


def chain_repeat_indicators(
    tokens: Sequence[int], labels: np.ndarray, depth: np.ndarray
) -> np.ndarray:
    """repeat_indicators of a head's trace (pipeline.acceptance.head_chains: rows by chain,
    then depth; chain c starts at text position c, its depth-1 row the head's teacher-forced
    outcome there): each row's decision about the position after it, the text before its
    chain committed and judged, the chain's own tokens not (as the policy sees it)."""
    memory, out, chain = RepeatMemory(), np.zeros((len(labels), 2)), -1
    first = labels[depth == 1]
    for r, d in enumerate(depth):
        if d == 1:
            chain += 1
            if chain > 0:
                memory.extend([int(tokens[chain - 1])])
                memory.observe(chain - 1, first[chain - 1] >= 0.5)
        end = chain + int(d)  # tokens up to position chain + d - 1 drafted
        out[r] = indicators(memory.outcome([int(t) for t in tokens[max(0, end - MAX_MATCH) : end]]))
    return out


def trace_indicators(
    tokens: Sequence[int], labels: np.ndarray, depth: np.ndarray | None
) -> np.ndarray:
    """The indicators of a trace's rows: a text's (``depth`` None) or a head's chains'."""
    if depth is None:
        return repeat_indicators(tokens, labels)
    return chain_repeat_indicators(tokens, labels, depth)


def fit_repeat_weights(
    z: np.ndarray, x: np.ndarray, y: np.ndarray, w: np.ndarray, l2: float = 1e-3
) -> list[float]:
    """The weights of ``x``'s columns (repeat indicators) added to fixed logits ``z`` (the fitted
    `next` model's) that minimise the weighted log loss of labels ``y`` (Newton, a small ridge
    so that an indicator never seen stays at 0)."""
    beta = np.zeros(x.shape[1])
    ridge = l2 * max(float(w.sum()), 1.0) * np.eye(x.shape[1])
    for _ in range(50):
        p = 1.0 / (1.0 + np.exp(-(z + x @ beta)))
        grad = x.T @ (w * (p - y)) + ridge @ beta
        hess = (x * (w * p * (1 - p))[:, None]).T @ x + ridge
        step = np.linalg.solve(hess, grad)
        beta -= step
        if np.abs(step).max() < 1e-10:
            break
    return [float(b) for b in beta]
