"""Which draft state belongs to which batch row, found from the tokens alone.

vLLM hands a ``custom_class`` drafter (pipeline.vllm_spec.calibration_drafter) no request ids:
only each row's committed tokens. Rows are reordered, requests are preempted (their text
recomputed later), finish and are replaced, and a row's text may not be what the drafter last
saw. So a state is matched to a row by its tokens: among the states whose first KEY tokens
are the row's, the one sharing the longest prefix with the row's text. Its draft cache is then
cut to that common prefix and fed the rest, so a state is never wrong whatever happened in
between, only sometimes more expensive to bring up to date (a prefill). States nobody claims
for a while are released.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KEY = 8  # leading tokens that index the states
STALE_STEPS = 64  # a state unclaimed this many steps is released (its request ended)


@dataclass
class DraftState:
    slot: int  # the state's block in the draft's slot cache
    cached: np.ndarray  # the tokens in that block, in order (its length is the cache's)
    last_step: int = 0

    def common_prefix(self, tokens: np.ndarray) -> int:
        n = min(len(self.cached), len(tokens))
        if n == 0:
            return 0
        differ = np.flatnonzero(self.cached[:n] != tokens[:n])
        return int(differ[0]) if len(differ) else n


class StateTable:
    """The draft states by leading tokens; ``match`` claims one per row each step."""

    def __init__(self, acquire, release) -> None:
        self._acquire, self._release = acquire, release  # slot cache blocks
        self._by_key: dict[tuple[int, ...], list[DraftState]] = {}
        self.step = 0

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_key.values())

    def match(self, texts: list[np.ndarray]) -> list[tuple[DraftState, int]]:
        """For each row's text, its state and the length of the prefix its cache keeps (the
        cache is not cut here). Rows whose text extends a state exactly are served first, so
        two requests with one prompt keep their own states."""
        self.step += 1
        claimed: set[int] = set()
        out: list[tuple[DraftState, int] | None] = [None] * len(texts)
        for exact in (True, False):
            for r, text in enumerate(texts):
                if out[r] is not None:
                    continue
                best, best_len = None, -1
                for state in self._by_key.get(_key(text), ()):
                    if id(state) in claimed:
                        continue
                    common = state.common_prefix(text)
                    if exact and (common < len(state.cached) or not len(state.cached)):
                        continue
                    if common > best_len:
                        best, best_len = state, common
                if best is None and exact:
                    continue
                if best is None:
                    best, best_len = self._new(text), 0
                claimed.add(id(best))
                best.last_step = self.step
                out[r] = (best, best_len)
        self._expire()
        return out  # type: ignore[return-value]

    def _new(self, text: np.ndarray) -> DraftState:
        state = DraftState(self._acquire(), np.zeros(0, dtype=np.int64))
        self._by_key.setdefault(_key(text), []).append(state)
        return state

    def _expire(self) -> None:
        for key in list(self._by_key):
            keep = []
            for state in self._by_key[key]:
                if self.step - state.last_step >= STALE_STEPS:
                    self._release(state.slot)
                else:
                    keep.append(state)
            if keep:
                self._by_key[key] = keep
            else:
                del self._by_key[key]


def _key(text: np.ndarray) -> tuple[int, ...]:
    return tuple(text[:KEY].tolist())
