"""The draft lengths that make a continuous batch fastest (the `batch` policy asks for them).

A step of a batch of B generations costs (pipeline.cost.batch, all measured on this setup)

    S(B) + sum over rounds j = 1..R of T_D(n_j) + T_T(P, U(P), L)

with R draft rounds, n_j the generations still drafting in round j (a generation drafting k
tokens is in rounds 1..k), P = sum(1 + k_r) positions verified and U(P) the experts they
load together; it yields sum(1 + E_r(k_r)) tokens, E_r(k) the expected accepted tokens of
generation r's chain of k from its acceptance by chain depth. Once per step the plan picks R
and every k_r <= R that maximise tokens per ms (Dinkelbach: with rho the ms per token of the
best plan so far, generation r drafts its k-th token when rho times the chance it is accepted
exceeds what it adds to the step, its share of a round and its position in the pass).

A round with few generations costs nearly what a full one does, while every other generation
waits: a straggler's long chain pays only where the batch as a whole gains by it.
"""

from __future__ import annotations

import threading

from pipeline.cost.batch import BatchCost

STALE_STEPS = 2  # a generation not heard from for this many passes has left the batch


class BatchEconomy:
    def __init__(self, cost: BatchCost) -> None:
        self.cost = cost
        self._lock = threading.Lock()
        self._steps = 0  # verification passes seen: the plan's epoch
        self._rows: dict[int, tuple[list[float], int, int]] = {}  # key -> (accept, step, ctx)
        self._plan: dict[int, int] = {}
        self._planned_at = -1
        self.planned_rate: float | None = None  # ms per token the last plan expects

    @classmethod
    def attach(cls, batcher, cost: BatchCost) -> BatchEconomy:
        """The batcher's economy, created on first use."""
        with batcher.economy_lock:
            if batcher.economy is None:
                batcher.economy = cls(cost)
            return batcher.economy

    def observe(self, record) -> None:
        """A packed forward ran (pipeline.decode.batching.BatchRecord): a verification pass
        ends a step, and the next proposals get a new plan."""
        if record.side == "target":
            with self._lock:
                self._steps += 1

    def plan(self, key: int, accept: list[float], max_k: int, context: int) -> int:
        """The chain length of generation ``key`` this step, at most its own ``max_k``;
        ``accept[j]`` is the chance its token j + 1 is accepted given the ones before it were;
        ``context`` its length."""
        with self._lock:
            # Each row keeps its own cap: generations of one batch may ask with different max_k,
            # and a plan made when another asked must still hold this one to its own.
            self._rows[key] = (accept[: max(max_k, 0)], self._steps, context)
            if self._planned_at != self._steps or key not in self._plan:
                self._replan()
            return self._plan.get(key, 0)

    def _replan(self) -> None:
        fresh = self._steps - STALE_STEPS
        self._rows = {k: v for k, v in self._rows.items() if v[1] >= fresh}
        keys = list(self._rows)
        accs = [self._rows[k][0] for k in keys]
        ctxs = [self._rows[k][2] for k in keys]
        # Rounds up to the longest cap in the batch; each row stops at its own (len(accept)).
        rounds = max((len(a) for a in accs), default=0)
        ks, self.planned_rate = plan_lengths(self.cost, accs, ctxs, rounds)
        self._plan = dict(zip(keys, ks, strict=True))
        self._planned_at = self._steps


def plan_lengths(
    cost: BatchCost,
    accs: list[list[float]],
    ctxs: list[int],
    max_k: int,
    step_overhead: bool = True,
    sunk_rounds: int = 0,
) -> tuple[list[int], float]:
    """The chain length of every generation of a batch that maximises its tokens per ms, and
    that rate (ms per token); ``accs[r][j]``: the chance generation r's token j + 1 is accepted
    given the ones before it were (a generation with fewer entries drafts at most that many),
    ``ctxs[r]`` its context length (module docstring). The first ``sunk_rounds`` draft rounds
    are already paid for: they cost nothing more whichever plan is chosen."""
    rows = len(accs)
    if rows == 0:
        return [], float("nan")
    base = cost.t_step_overhead(rows) if step_overhead else 0.0
    best = (float("inf"), [0] * rows)
    rho = (base + cost.t_target(rows, None, sum(ctxs))) / rows  # plain steps: a first guess
    for _ in range(3):  # Dinkelbach: the rate a plan achieves prices the next one
        # A drafted token's own cost: its place in the rounds, its position in the pass
        # (its work and its share of new experts) and its attention over its context.
        unit = cost.d_tok + cost.marginal_target(rows * 3.0, 1)
        upto = [
            _best_prefix(a, max_k, rho, unit + cost.b_ctx * c)
            for a, c in zip(accs, ctxs, strict=True)
        ]
        for rounds in range(max_k + 1):
            ks = [u[rounds] for u in upto]
            attended = sum((1 + k) * c for k, c in zip(ks, ctxs, strict=True))
            ms = base + cost.t_target(sum(ks) + rows, None, attended)
            later = range(sunk_rounds + 1, rounds + 1)
            ms += sum(cost.t_draft(sum(k >= j for k in ks)) for j in later)
            tokens = sum(1 + expected(a, k) for a, k in zip(accs, ks, strict=True))
            if ms / tokens < best[0]:
                best = (ms / tokens, ks)
        rho = best[0]
    return best[1], best[0]


def expected(accept: list[float], k: int) -> float:
    """Expected accepted draft tokens of a chain of k (``accept``: conditional by depth)."""
    total, p = 0.0, 1.0
    for a in accept[:k]:
        p *= a
        total += p
    return total


def _best_prefix(accept: list[float], max_k: int, rho: float, unit: float) -> list[int]:
    """For each R = 0 .. max_k, the k <= R maximising rho * E(k) - unit * k; a chain never
    runs past its own ``accept`` (a generation whose longest chain is shorter than max_k)."""
    out, best_k, best_v, value, p = [0], 0, 0.0, 0.0, 1.0
    for k in range(1, max_k + 1):
        if k > len(accept):
            out.append(best_k)
            continue
        p *= accept[k - 1]
        value += rho * p - unit
        if value > best_v:
            best_k, best_v = k, value
        out.append(best_k)
    return out
