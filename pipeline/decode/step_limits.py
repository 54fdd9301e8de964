"""How much work one speculative step may do, bounded jointly over a policy's knobs.

Each knob alone is bounded (knobs.MAX_STEP_KNOB), but a step's work is their product: a tree
of depth 64 and branch 64 feeds a quarter of a million tokens to the draft per step. So every
policy declares the most work one of its steps can do (``Policy.step_work``: draft forwards,
tokens the draft processes, positions verified) and a server refuses a request whose policy
may exceed its ``StepLimits`` before decoding (``check_step_limits``, a KnobError: a 400).
The drafter and the engine also enforce the limits while decoding (``StepLimitExceeded``), so
a policy that under-declares still cannot take a replica down.

The draft's tokens per step include its catch-up: the draft cache holds only committed tokens
fed by an earlier step, so a step first feeds the tokens the last step committed (its accepted
ones plus the bonus token, at most the positions it verified) and then what it drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pipeline.decode.policies.knobs import KnobError


@dataclass(frozen=True)
class StepWork:
    """The most work one step of a policy can do, with its knobs resolved."""

    draft_forwards: int  # draft model forward passes
    draft_tokens: int  # tokens the draft processes, summed over its forwards (catch-up too)
    verified: int  # positions in the verification pass, the root (last committed token) included
    why: str  # the knobs that set it, e.g. "depth 64, branch 64"
    why_verified: str = ""  # the knobs that set ``verified`` when not ``why`` (trees: gamma)
    # Draft-tree nodes built and scored (the last level too, never fed): what node selection
    # (EAGLE-2's top-gamma, EcoSpec's expert-aware scoring) works through. 0 for chains.
    tree_nodes: int = 0


class StepLimitError(KnobError):
    """A policy whose knobs allow steps beyond the server's limits (refused before decoding)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, None)


class StepLimitExceeded(RuntimeError):
    """A step that tried to do more than the limits allow while decoding (a policy whose
    ``step_work`` under-declares); the step is stopped before the forward that would."""


def _lower(why: str) -> str:
    """'depth 64, branch 2' -> 'depth or branch': the knobs a client can lower."""
    names = [part.split()[0] for part in why.split(", ") if part]
    if len(names) <= 1:
        return names[0] if names else "the policy's knobs"
    return ", ".join(names[:-1]) + " or " + names[-1]


@dataclass(frozen=True)
class StepLimits:
    """The most work a server lets one step do. The defaults admit every policy's defaults and
    any chain up to k = 64 (64 forwards, 128 draft tokens, 65 positions)."""

    max_draft_forwards: int = 65
    max_draft_tokens: int = 256
    max_verified: int = 65
    max_tree_nodes: int = 256

    def __post_init__(self) -> None:
        # 0 draft forwards / tokens admits plain steps only; every step verifies its root.
        if (
            min(self.max_draft_forwards, self.max_draft_tokens, self.max_tree_nodes) < 0
            or self.max_verified < 1
        ):
            raise ValueError(f"step limits must be >= 0 (verified >= 1), got {self}")

    def check(self, policy_name: str, work: StepWork) -> None:
        """Raise StepLimitError naming the policy, the knobs, the amount, the limit and what
        to lower, when ``work`` exceeds a limit."""
        checks = (
            (work.draft_forwards, self.max_draft_forwards, work.why, "runs {n} draft forwards"),
            (work.draft_tokens, self.max_draft_tokens, work.why, "feeds {n} tokens to the draft"),
            (
                work.verified,
                self.max_verified,
                work.why_verified or work.why,
                "verifies {n} positions",
            ),
            (work.tree_nodes, self.max_tree_nodes, work.why, "builds a draft tree of {n} nodes"),
        )
        for amount, limit, why, what in checks:
            if amount > limit:
                raise StepLimitError(
                    f"{policy_name}: {why} {what.format(n=f'{amount:,}')} per step; this "
                    f"server allows at most {limit:,} (lower {_lower(why)})"
                )

    def check_forward(self, forwards: int, tokens: int) -> None:
        """Before a draft forward: ``forwards`` and ``tokens`` are the step's totals with it."""
        if forwards > self.max_draft_forwards:
            raise StepLimitExceeded(
                f"the draft would run {forwards} forwards this step; this server allows at "
                f"most {self.max_draft_forwards} (the policy under-declares its step work)"
            )
        if tokens > self.max_draft_tokens:
            raise StepLimitExceeded(
                f"the draft would process {tokens} tokens this step; this server allows at "
                f"most {self.max_draft_tokens} (the policy under-declares its step work)"
            )

    def check_verified(self, positions: int) -> None:
        """Before the verification pass over ``positions`` positions (root included)."""
        if positions > self.max_verified:
            raise StepLimitExceeded(
                f"the verification pass would verify {positions} positions; this server "
                f"allows at most {self.max_verified} (the policy under-declares its step work)"
            )


class DeclaresStepWork(Protocol):
    """What the check reads of a policy (pipeline.decode.policies.base.Policy has both); a
    protocol so this module sits below the drafter and the policies, importing neither."""

    name: str

    def step_work(self) -> StepWork: ...


def check_step_limits(policy: DeclaresStepWork, limits: StepLimits) -> None:
    """StepLimitError (a KnobError) when ``policy``'s knobs allow steps beyond ``limits``."""
    limits.check(policy.name, policy.step_work())


def chain_work(k: int, why: str) -> StepWork:
    """A chain of at most k tokens drafted after a step that committed at most k + 1: k
    forwards (begin, then k - 1 extends; a chain that stops early looked once more but
    drafted less), the catch-up of <= k + 1 tokens plus k - 1 extended ones, k + 1 positions.
    k = 0 (no draft at all) runs no forward."""
    if k <= 0:
        return StepWork(0, 0, 1, why)
    return StepWork(k, (k + 1) + (k - 1), k + 1, why)


def tree_work(depth: int, branch: int, gamma: int) -> StepWork:
    """build_tree's EAGLE-2 expansion, then at most gamma - 1 nodes verified.

    Level 0 has ``branch`` nodes, every later level branch * branch (the top-branch children
    of ``branch`` frontier nodes). One forward per level: begin, then an expand feeding every
    node of levels 0 .. depth - 2 (the last level is scored, never fed). The catch-up is the
    previous step's accepted path (<= min(depth, gamma - 1)) plus its bonus token."""
    nodes = branch + (depth - 1) * branch * branch
    fed = 0 if depth < 2 else branch + (depth - 2) * branch * branch
    catch_up = min(depth, gamma - 1) + 1
    verified = min(gamma - 1, nodes) + 1
    why_verified = f"gamma {gamma}" if gamma - 1 <= nodes else f"depth {depth}, branch {branch}"
    return StepWork(
        depth, catch_up + fed, verified, f"depth {depth}, branch {branch}", why_verified, nodes
    )
