"""Exact output distributions of the speculative engine, by enumerating every random draw.

A generation's randomness all comes from its RandomSource (pipeline.decode.randomness). Here a
scripted source replays a list of outcomes and, at the first draw the list does not cover,
raises Branch with every possible outcome and its probability. A depth-first driver re-runs
from a snapshot for each branch and multiplies the probabilities along each path, so the
distribution of the first n generated tokens comes out exact (up to float32 rounding).

Re-runs are kept cheap in three ways, none of which changes what is computed:
* a snapshot is taken before each of a step's phases (DecodeSession.draft, verify, commit,
  which step() runs in this order), so a branch re-runs only its own phase;
* copies share the models, the policy's artifacts and every tensor of the snapshot (decoding
  replaces a session's tensors and never writes into them), and the draft's forwards are
  remembered by their inputs and cache tensors (MemoDraft);
* states after a step with the same committed tokens and the same policy state are merged
  (probabilities summed). A state is a valid speculative decoder whichever of the merged paths
  it continues, so merging keeps the comparison with the target exact.
Were any of these wrong, the distributions would disagree: the harness fails, never passes
wrongly.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pipeline.cost.model import CostModel
from pipeline.decode.engine import DecodeSession, SpeculativeEngine
from pipeline.decode.policies.base import Policy
from pipeline.decode.types import SamplingConfig
from pipeline.models.loading import ModelPair

MAX_RUNS = 60_000  # a policy that needs more phase runs needs smaller knobs


class Branch(Exception):  # noqa: N818 (a signal, not an error)
    """An unscripted draw: its possible outcomes with their probabilities."""

    def __init__(self, outcomes: list[tuple[Any, float]]) -> None:
        super().__init__(f"{len(outcomes)} outcomes")
        self.outcomes = outcomes


class ScriptedRandom:
    """A RandomSource that replays ``script`` and raises Branch at the first draw past it."""

    def __init__(self) -> None:
        self.script: list[Any] = []
        self.pos = 0

    def load(self, script: list[Any]) -> None:
        self.script, self.pos = list(script), 0

    def _next(self, outcomes: list[tuple[Any, float]]) -> Any:
        if self.pos == len(self.script):
            raise Branch(outcomes)
        value = self.script[self.pos]
        self.pos += 1
        assert value in [o for o, _ in outcomes], "a replay took another path"
        return value

    def categorical(self, probs: torch.Tensor) -> int:
        p = probs.detach().cpu().double()
        p = p / p.sum()  # as torch.multinomial normalises
        return self._next([(int(i), float(p[i])) for i in torch.nonzero(p > 0).flatten()])

    def bernoulli(self, p: float) -> bool:
        p = min(max(float(p), 0.0), 1.0)
        return self._next([(o, w) for o, w in ((True, p), (False, 1.0 - p)) if w > 0])


def _bytes(t: torch.Tensor) -> tuple:
    return (str(t.dtype), tuple(t.shape), t.detach().cpu().numpy().tobytes())


class MemoDraft:
    """The draft model, its forwards remembered by (the cache's tensors, the inputs): a replay
    gets the same outputs and the same cache tensors without running the model again."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.memo: dict[Any, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, ids: torch.Tensor, past_key_values, **kw) -> Any:
        layers = past_key_values.layers
        before = [dict(vars(layer)) for layer in layers]  # kept alive: tensor ids stay unique
        state = tuple(
            (k, id(v) if isinstance(v, torch.Tensor) else repr(v))
            for b in before
            for k, v in b.items()
        )
        inputs = tuple(
            (k, _bytes(v) if isinstance(v, torch.Tensor) else v) for k, v in sorted(kw.items())
        )
        key = (state, _bytes(ids), inputs)
        hit = self.memo.get(key)
        if hit is None:
            out = self.model(ids, past_key_values=past_key_values, **kw)
            self.memo[key] = (before, out, [dict(vars(layer)) for layer in layers])
            return out
        _, out, after = hit
        for layer, state in zip(layers, after, strict=True):
            vars(layer).update(state)
        return out


@dataclass
class Enumeration:
    distribution: dict[tuple[int, ...], float]
    runs: int = 0  # phase executions
    paths: int = 0  # complete paths of draws through a step (summed over states)
    states: int = 0  # session states expanded (after merging)
    # How many proposals (over all states and draft paths, unweighted) had each size.
    proposal_sizes: Counter[int] = field(default_factory=Counter)


def _shared(session: DecodeSession) -> dict[int, Any]:
    """What copies share: the models and the policy's (read-only) artifacts."""
    pair = session.pair
    keep: list[Any] = [pair, pair.target, pair.draft]
    for value in vars(session.policy).values():
        if isinstance(value, torch.nn.Module | CostModel) or hasattr(value, "predict_many"):
            keep.append(value)
    return {id(x): x for x in keep}


def _state_key(obj: Any, shared: dict[int, Any]) -> Any:
    """A hashable image of a policy's state (its trace of the last proposal left out)."""
    if id(obj) in shared:
        return ("shared", id(obj))
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, np.ndarray):
        return (obj.dtype.str, obj.shape, obj.tobytes())
    if isinstance(obj, torch.Tensor):
        return _bytes(obj)
    if isinstance(obj, list | tuple):
        return tuple(_state_key(v, shared) for v in obj)
    if isinstance(obj, set | frozenset):
        return tuple(sorted(_state_key(v, shared) for v in obj))
    if isinstance(obj, dict):
        return tuple(sorted((k, _state_key(v, shared)) for k, v in obj.items() if k != "trace"))
    return (type(obj).__name__, _state_key(vars(obj), shared))


def _memo(obj: Any, shared: dict[int, Any]) -> dict[int, Any]:
    """A deepcopy memo: ``shared`` plus every tensor reachable from ``obj``."""
    memo, seen, todo = dict(shared), set(), [obj]
    while todo:
        item = todo.pop()
        if id(item) in seen or id(item) in shared or isinstance(item, bool | int | float | str):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            memo[id(item)] = item
        elif isinstance(item, list | tuple | set):
            todo.extend(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
        elif hasattr(item, "__dict__"):
            todo.extend(vars(item).values())
    return memo


def _mark(session: DecodeSession, shared: dict[int, Any]) -> Any:
    return (
        tuple(session.committed),
        session.target_cache.get_seq_length(),
        len(session.steps),
        _state_key(session.policy, shared),
    )


def _paths(
    snapshot: DecodeSession,
    phase: Callable[[DecodeSession], Any],
    shared: dict[int, Any],
    stats: Enumeration,
    draws_first: bool = False,
) -> Iterator[tuple[float, DecodeSession, Any]]:
    """Every complete path of ``phase``'s draws from ``snapshot``: (probability, the session
    after it, the phase's result). With ``draws_first`` (the phase draws before it changes
    anything, as commit does: accept() comes first) a run that branches leaves its copy as it
    was (checked), so the copy serves the next run."""
    stack: list[tuple[list[Any], float]] = [([], 1.0)]
    memo = _memo(snapshot, shared)
    work = None
    while stack:
        script, prob = stack.pop()
        if work is None:
            work = copy.deepcopy(snapshot, dict(memo))
            mark = _mark(work, shared) if draws_first else None
        work.rng.load(script)
        stats.runs += 1
        assert stats.runs <= MAX_RUNS, "too many paths: give the policy smaller knobs"
        try:
            result = phase(work)
        except Branch as branch:
            stack.extend((script + [o], prob * w) for o, w in branch.outcomes)
            if draws_first:
                assert _mark(work, shared) == mark, "the phase changed the session, then drew"
            else:
                work = None
            continue
        yield prob, work, result
        work = None


def enumerate_outputs(
    pair: ModelPair,
    prompt: list[int],
    policy: Policy,
    sampling: SamplingConfig,
    n: int,
    prepare: Callable[[DecodeSession], None] | None = None,
) -> Enumeration:
    """The exact distribution of the first ``n`` tokens the engine generates. ``prepare``
    adjusts the fresh session before its first step (e.g. what its drafter shows a policy of
    a batch around it); whatever it attaches is copied with the session, so it is part of
    each path's state."""
    pair = dataclasses.replace(pair, draft=MemoDraft(pair.draft))
    start = SpeculativeEngine(pair).start(prompt, policy, sampling, rng=ScriptedRandom())
    if prepare is not None:
        prepare(start)
    shared = _shared(start)
    stats = Enumeration(defaultdict(float))
    frontier: dict[Any, tuple[float, DecodeSession]] = {}

    def arrive(prob: float, session: DecodeSession) -> None:
        if len(session.generated) >= n:
            stats.distribution[tuple(session.generated[:n])] += prob
            return
        key = (tuple(session.committed), _state_key(session.policy, shared))
        seen = frontier.get(key)
        frontier[key] = (seen[0] + prob, seen[1]) if seen else (prob, session)

    def commit(cands, logits, routing, t_draft, t_verify) -> Callable[[DecodeSession], Any]:
        return lambda s: s.commit(cands, logits, routing, t_draft, t_verify)

    arrive(1.0, start)
    with torch.no_grad():
        while frontier:
            # Fewest tokens first: every path into a state arrives before it is expanded.
            prob, state = frontier.pop(min(frontier, key=lambda k: len(k[0])))
            stats.states += 1
            for p_draft, drafted, (cands, t_draft) in _paths(
                state, DecodeSession.draft, shared, stats
            ):
                stats.proposal_sizes[len(cands)] += 1
                logits, routing, t_verify = drafted.verify(cands)
                phase = commit(cands, logits, routing, t_draft, t_verify)
                for p_commit, after, _ in _paths(drafted, phase, shared, stats, True):
                    stats.paths += 1
                    arrive(prob * p_draft * p_commit, after)
    return stats


def target_joint(
    pair: ModelPair, prompt: list[int], sampling: SamplingConfig, n: int
) -> dict[tuple[int, ...], float]:
    """P(y_1..y_n | prompt) of the target at ``sampling``, from direct (uncached) forwards."""
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.no_grad():
        for _ in range(n):
            prefixes = list(joint)
            ids = torch.tensor([prompt + list(p) for p in prefixes])
            probs = sampling.probs(pair.target(ids).logits[:, -1]).double()
            joint = {
                (*p, x): joint[p] * float(probs[row, x])
                for row, p in enumerate(prefixes)
                for x in range(probs.shape[1])
            }
    return joint


def compare(got: dict, want: dict) -> tuple[float, float]:
    """(max abs difference, total variation distance) over every sequence of either."""
    keys = set(got) | set(want)
    diffs = [abs(got.get(k, 0.0) - want.get(k, 0.0)) for k in keys]
    return max(diffs), 0.5 * sum(diffs)
