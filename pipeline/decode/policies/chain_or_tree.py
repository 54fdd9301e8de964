"""`chain-or-tree`: `throughput`'s chain, made a small tree where the tree is worth more.

The tree ceiling (pipeline.acceptance.tree_ceiling) puts choosing a tree where it pays at 3-15
points over chains at T = 0. The cheapest tree to add to a chain: at every drafted position
the draft's distribution is already computed, so its runner-up token there costs no draft
forward, only one more verified position. Under greedy verification the runner-up is accepted
when the chain before it was accepted, the chain's own token was not, and the target's argmax
is the runner-up:

    P(runner-up at j accepted) = prod_{i<j} a_i * (1 - a_j) * s

with a_i the chain's acceptances as `throughput` models them and s the runner-up's share of
the draft's misses. The draft's own probabilities say little about s: on held-out prompts
(8-15 of each domain, the 1-layer draft) the runner-up was the target's token at 53-74% of the
misses while q(x') / (1 - q(x_j)) averaged 0.05-0.13. So s starts at the ``runner_up`` knob and
follows this generation's judged runner-ups (a Beta estimate). An accepted runner-up adds one
token (the path ends there with its bonus token), so the step adds the n runner-ups of highest
probability that maximise rho * sum P - [T_T(m + n) - T_T(m)], rho the rate `throughput`
already prices tokens at; n = 0 keeps the chain. The tree is verified with the engine's tree
mask, as `tree` is.

At T > 0 the draft's top tokens carry little of the target's p, so the leaves are further
draws from the distribution the chain token at that position was drawn from, verified with it
by recursive rejection sampling (pipeline.decode.acceptance): a draw beside position j is
accepted with prod_{i<j} a_i * (1 - a_j) * s, s now the chance that a second draw is accepted
where the first was not (measured 0.28-0.31 on held-out prompts: the ``second_draw`` knob,
then this generation's judged draws). The leaves are chosen by their worth before they are
drawn, never after, which keeps sampling lossless.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pipeline.decode.drafter import Drafter
from pipeline.decode.policies.knobs import Knob
from pipeline.decode.policies.labels import EXPERIMENTAL
from pipeline.decode.policies.throughput import ThroughputPolicy
from pipeline.decode.types import Candidates, StepOutcome

# The runner-up's share starts at the knob with the weight of this many judged runner-ups,
# so that a few cannot swing it.
SHARE_PRIOR = 4.0


@dataclass(frozen=True)
class Alternative:
    position: int  # the chain position it stands at (its parent is the chain node before)
    token: int
    worth: float  # P(accepted): the chain before it accepted and the target's token is this
    runner_up: bool = True  # False: the top token of a position the chain declined


def alternatives(
    chain: Sequence[int], dists: Sequence[torch.Tensor], accs: Sequence[float], share: float
) -> list[Alternative]:
    """The leaves a step may add beside its chain, highest worth first: the draft's best other
    token at every chain position, and where `throughput` looked at one more position and
    declined it (``dists`` one longer than the chain), that position's top two. ``accs[j]``:
    P(the top token at position j is accepted | the chain before it is), as modelled when
    drafted; ``share``: P(the runner-up is the target's token | the top one is not)."""
    out, prefix = [], 1.0
    for j, (probs, a) in enumerate(zip(dists, accs, strict=True)):
        top = torch.topk(probs, 2).indices.tolist()
        if j == len(chain):  # the declined position: both its top tokens, as leaves
            out.append(Alternative(j, top[0], prefix * a, runner_up=False))
            out.append(Alternative(j, top[1], prefix * (1.0 - a) * share))
            break
        other = top[1] if top[0] == chain[j] else top[0]  # at T = 0: the second
        out.append(Alternative(j, other, prefix * (1.0 - a) * share))
        prefix *= a
    return sorted(out, key=lambda alt: -alt.worth)


def best_alternatives(
    options: Sequence[Alternative], tt: Sequence[float], m: int, rho: float, most: int
) -> list[Alternative]:
    """The prefix of ``options`` (highest worth first) that maximises rho * E[tokens added]
    minus the verification time it adds to a pass of m positions; at most ``most``, and only
    as far as ``tt`` prices (T_T(m) for m < len(tt))."""
    best_n, best, gain = 0, 0.0, 0.0
    for n, alt in enumerate(options[:most], 1):
        if m + n >= len(tt):
            break
        gain += rho * alt.worth
        if gain - (tt[m + n] - tt[m]) > best:
            best_n, best = n, gain - (tt[m + n] - tt[m])
    return list(options[:best_n])


class _Recording:
    """The drafter as `throughput` drafts with it, keeping each chain position's distribution
    (the draft's work is unchanged: the same forwards, the same draws). ``before_draw`` is
    told of each draw of a chain token before it is made (position, distribution)."""

    def __init__(self, drafter: Drafter, before_draw=None) -> None:
        self._drafter = drafter
        self.dists: list[torch.Tensor] = []
        self._before_draw = before_draw

    def sample(self, probs: torch.Tensor) -> int:
        if self._before_draw is not None:
            self._before_draw(len(self.dists) - 1, probs)
        return self._drafter.sample(probs)

    def __getattr__(self, name: str):
        return getattr(self._drafter, name)

    def begin(self, committed: list[int]) -> torch.Tensor:
        self.dists = [self._drafter.begin(committed)]
        return self.dists[-1]

    def extend(self, token: int) -> torch.Tensor:
        self.dists.append(self._drafter.extend(token))
        return self.dists[-1]


@dataclass
class ChainOrTreePolicy(ThroughputPolicy):
    max_alternatives: int = 4
    runner_up: float = 0.6
    second_draw: float = 0.3
    name = "chain-or-tree"
    label = EXPERIMENTAL
    summary = (
        "ours: throughput's chain, with the draft's runner-up tokens (T = 0) or further draws "
        "(T > 0) added beside it where their modelled worth beats their verification"
    )
    knobs = (
        *ThroughputPolicy.knobs,
        Knob(
            "max_alternatives",
            int,
            4,
            0,
            12,
            help="most runner-up tokens added beside the chain per step (0: throughput's "
            "chain; the pass never verifies more than max_k + 1 positions)",
        ),
        Knob(
            "runner_up",
            float,
            0.6,
            0.0,
            1.0,
            help="P(the draft's runner-up is the target's token | its top token is not) "
            "before this generation's own runner-ups are judged (measured 0.53-0.74 with "
            "the 1-layer draft)",
        ),
        Knob(
            "second_draw",
            float,
            0.3,
            0.0,
            1.0,
            help="at T > 0, P(a second draw from the draft is accepted | the first is not) "
            "before this generation's own are judged (measured 0.28-0.31)",
        ),
    )
    # (position, share used, accepted) of every runner-up the walk judged this generation.
    judged: list[tuple[int, float, bool]] = field(default_factory=list, init=False)

    def reset(self) -> None:
        super().reset()
        self._chain = Candidates()
        self._added: list[Alternative] = []
        self._added_nodes: dict[int, Alternative] = {}  # candidate index -> the leaf there
        self._drawn: list[tuple[Alternative, torch.Tensor]] = []  # T > 0: this step's leaves
        self.judged = []

    def share(self, greedy: bool = True) -> float:
        """s: the mode's knob as SHARE_PRIOR judged leaves, plus this generation's."""
        hits = sum(hit for *_, hit in self.judged)
        prior = self.runner_up if greedy else self.second_draw
        return (SHARE_PRIOR * prior + hits) / (SHARE_PRIOR + len(self.judged))

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        greedy = drafter.sampling.greedy
        self._used = self.share(greedy)
        self._drawn = []

        def hook(position: int, probs: torch.Tensor) -> None:
            self._draw_beside(drafter, position, probs)

        recording = _Recording(drafter, None if greedy or self.max_alternatives == 0 else hook)
        chain = super().propose(recording, committed)  # type: ignore[arg-type]
        self._chain, self._added, self._added_nodes = chain, [], {}
        if not recording.dists or self.max_alternatives == 0:
            return chain
        dists = recording.dists
        if greedy:
            options = alternatives(chain.tokens, dists, self.outcomes.predicted, self._used)
            chosen = best_alternatives(
                options, self._tt, len(chain) + 1, self._rate(), self.max_alternatives
            )
            leaves = [(alt, None) for alt in chosen]
        else:  # drawn before the chain tokens beside them (a declined position's first
            # draw would be worth what `throughput` just found not to pay)
            leaves = list(self._drawn)
        if not leaves:
            return chain
        tree = Candidates(
            list(chain.tokens), list(chain.parents), list(chain.q), list(chain.confidences)
        )
        # A position's first draw before its second (the order recursive rejection tries).
        for alt, q in sorted(leaves, key=lambda leaf: (leaf[0].position, leaf[0].runner_up)):
            self._added.append(alt)
            self._added_nodes[len(tree.tokens)] = alt
            tree.tokens.append(alt.token)
            tree.parents.append(alt.position - 1)  # the chain node before it (-1: the root)
            tree.q.append(q)
            tree.confidences.append(alt.worth)
        return tree

    def _room(self) -> int:
        # At T > 0 a drawn leaf takes a position of the pass the chain could have had.
        return super()._room() - len(self._drawn)

    # -- T > 0: a leaf beside a chain token is chosen before that token is drawn, so that
    # how many siblings a node has never depends on what they are (recursive rejection
    # sampling is lossless for a number of draws fixed before them).
    def _draw_beside(self, drafter: Drafter, position: int, probs: torch.Tensor) -> None:
        """Before the chain's draw at ``position``: a second draw there, if rho x its worth
        beats the position it adds to the pass (the chain up to and including this position,
        the root and the leaves drawn so far)."""
        accs = self.outcomes.predicted
        worth = math.prod(accs[:position]) * (1.0 - accs[position]) * self._used
        m = position + 2 + len(self._drawn)
        if len(self._drawn) >= self.max_alternatives or m + 1 >= len(self._tt):
            return
        if self._rate() * worth <= self._tt[m + 1] - self._tt[m]:
            return
        self._drawn.append((Alternative(position, drafter.sample(probs), worth), probs))

    def update(self, outcome: StepOutcome) -> None:
        k = len(self._chain)
        path = outcome.accepted_nodes or tuple(range(outcome.accepted))
        chain_accepted = sum(1 for node in path if node < k)
        # The runner-up at the position where the walk stopped on the chain was judged when
        # the top token there was rejected: the chain's, or at a declined position the top
        # leaf (judged only if verified); it was accepted when the path ends on it.
        end = self._added_nodes.get(path[-1]) if len(path) > chain_accepted else None
        tops = {alt.position for alt in self._added if not alt.runner_up}
        if chain_accepted < k or chain_accepted in tops:
            for alt in self._added:
                if alt.runner_up and alt.position == chain_accepted and (end is None or end is alt):
                    self.judged.append((alt.position, self._used, end is alt))
        # `throughput` learns from its chain alone: an accepted runner-up is a rejection of the
        # chain's token at that position.
        super().update(
            StepOutcome(self._chain, chain_accepted, outcome.record, path[:chain_accepted])
        )
