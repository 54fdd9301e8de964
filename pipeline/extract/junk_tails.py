"""Counterfactual junk tails (docs/contract.md): which tails a sequence needs, sampling them from
the draft, and the target's routing of them.

A tail diverges after ``x_s``: what the verifier is shown after the chain matched ``x_1..x_s``
and failed at ``x_{s+1}``. Its first token depends on the verification rule being bounded
(``acceptance``): ``surrogate`` (the paper's) draws from the draft at ``x_{<=s}`` with
``x_{s+1}`` removed, ``greedy`` takes the draft's argmax, ``sampling`` draws from the rejected
proposals ``norm(max(q - pi, 0))``; the rest is the draft's greedy continuation for ``greedy``
and free draft samples otherwise. Both models see the tails as packed chains against a KV cache
of the *whole* reference, each chain's attention limited to its own prefix ``x_{<=s}`` (tree
masks with per-root context lengths), so no prefix is recomputed and no tail gets a forward of
its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import Cache, PreTrainedModel

from pipeline.extract.keyed_random import (
    exclude_token,
    residual_probs,
    sample_from_probs,
    stable_key,
    uniforms,
)
from pipeline.models.adapters import MoESpec
from pipeline.models.forest import forest_forward
from pipeline.models.kvcache import crop_to
from pipeline.models.treemask import chains_as_tree

TAIL_MODES = ("shared", "paper")
# The verification rules a tail can stand for (docs/contract.md, "Junk tail").
ACCEPTANCES = ("surrogate", "greedy", "sampling")
_FIELDS = ("s", "length", "key", "i", "k", "a", "acceptance", "draw")


@dataclass(frozen=True)
class TailSpecs:
    """One entry per tail. ``i, k, a`` are -1 in ``shared`` mode (a tail serves many cells)."""

    s: np.ndarray
    length: np.ndarray
    key: np.ndarray  # uint64 sampling keys
    i: np.ndarray
    k: np.ndarray
    a: np.ndarray
    acceptance: np.ndarray  # str, one of ACCEPTANCES
    draw: np.ndarray  # independent draw number, 0-based (greedy: always 0)

    def __len__(self) -> int:
        return len(self.s)

    def take(self, idx: np.ndarray) -> TailSpecs:
        return TailSpecs(*(getattr(self, f)[idx] for f in _FIELDS))


def draws_per_acceptance(acceptances: tuple[str, ...], draws: int) -> list[tuple[str, int]]:
    """The (acceptance, draw) pairs an extraction holds: greedy tails are deterministic, so
    greedy gets draw 0 only."""
    unknown = [a for a in acceptances if a not in ACCEPTANCES]
    if unknown or not acceptances or len(set(acceptances)) != len(acceptances):
        raise ValueError(
            f"acceptances {list(acceptances)!r}: give distinct values from {', '.join(ACCEPTANCES)}"
        )
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    return [(acc, d) for acc in acceptances for d in range(1 if acc == "greedy" else draws)]


def tail_specs(
    n_tokens: int,
    lmax: int,
    mode: str,
    seed: int,
    seq_id: str,
    acceptances: tuple[str, ...] = ACCEPTANCES,
    draws: int = 2,
) -> TailSpecs:
    """The tails a reference of ``n_tokens`` response tokens needs for budgets up to ``lmax``,
    for every (acceptance, draw) in that order, each with the same layout:

    ``shared``: one tail per divergence point s of length min(lmax, N - s), the longest any
    cell (i, k, a) with i + a = s uses. ``paper``: an independent tail of length k - a for every
    cell with a < k <= min(lmax, N - i). Every tail has its own key, so draws are independent.
    """
    if mode not in TAIL_MODES:
        raise ValueError(f"tail mode {mode!r} is not one of {', '.join(TAIL_MODES)}")
    if lmax < 1:
        raise ValueError(f"lmax must be >= 1, got {lmax}")
    rows: list[tuple] = []
    for acc, d in draws_per_acceptance(tuple(acceptances), draws):
        if mode == "shared":
            for s in range(n_tokens):
                key = stable_key(seed, seq_id, acc, d, s)
                rows.append((s, min(lmax, n_tokens - s), key, -1, -1, -1, acc, d))
        else:
            for i in range(n_tokens):
                for k in range(1, min(lmax, n_tokens - i) + 1):
                    for a in range(k):
                        key = stable_key(seed, seq_id, acc, d, i + a, i, k)
                        rows.append((i + a, k - a, key, i, k, a, acc, d))
    dtypes = (np.int64, np.int64, np.uint64, np.int64, np.int64, np.int64, np.str_, np.int64)
    if not rows:
        return TailSpecs(*(np.zeros(0, dtype=t) for t in dtypes))
    cols = list(zip(*rows, strict=True))
    return TailSpecs(*(np.array(c, dtype=t) for c, t in zip(cols, dtypes, strict=True)))


def first_tokens(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    forbidden: torch.Tensor,
    specs: TailSpecs,
    temperature: float,
) -> np.ndarray:
    """Each tail's first token ``y_1`` at its divergence point (rows of the logits: the draft's
    and the target's predictions after ``x_s``; ``forbidden``: the reference token ``x_{s+1}``).

    surrogate: ``q`` with ``x_{s+1}`` zeroed and renormalised; greedy: ``argmax q``; sampling:
    ``norm(max(q - pi, 0))``, or the surrogate's rule where the residual has no mass (q <= pi
    everywhere: that position never rejects, so its tail carries no weight).
    """
    device = draft_logits.device
    out = np.zeros(len(specs), dtype=np.int64)
    greedy = specs.acceptance == "greedy"
    if greedy.any():
        rows = torch.from_numpy(np.nonzero(greedy)[0]).to(device)
        out[greedy] = draft_logits[rows].argmax(-1).cpu().numpy()
    rest = ~greedy
    if not rest.any():
        return out
    sel = torch.from_numpy(np.nonzero(rest)[0]).to(device)
    q = torch.softmax(draft_logits[sel].float() / temperature, dim=-1)
    dist = exclude_token(q, forbidden[sel])
    sampling = torch.from_numpy(specs.acceptance[rest] == "sampling").to(device)
    if sampling.any():
        pi = torch.softmax(target_logits[sel][sampling].float() / temperature, dim=-1)
        residual = residual_probs(q[sampling], pi)
        has_mass = residual.sum(-1) > 0
        dist[sampling] = torch.where(has_mass.view(-1, 1), residual, dist[sampling])
    out[rest] = sample_from_probs(dist, uniforms(specs.key[rest], 1)).numpy()
    return out


@torch.no_grad()
def sample_tails(
    draft: PreTrainedModel,
    draft_cache: Cache,
    first: np.ndarray,
    contexts: np.ndarray,
    specs: TailSpecs,
    temperature: float = 1.0,
) -> list[np.ndarray]:
    """Continue every tail in ``specs`` from its first token ``first[b]`` with the draft, one
    packed draft step per tail position: greedy tails take the argmax, the others sample at
    ``temperature``.

    ``draft_cache`` holds the whole reference; ``contexts[b]`` is how many cached positions tail
    b may see. The cache is returned to its original length.
    """
    n = len(specs)
    if n == 0:
        return []
    device = draft.device
    base_len = draft_cache.get_seq_length()
    tokens = np.zeros((n, int(specs.length.max())), dtype=np.int64)
    tokens[:, 0] = first
    owners = torch.zeros(0, dtype=torch.long, device=device)  # tail owning each appended slot
    ctx = torch.from_numpy(contexts).to(device)
    dtype = draft.dtype
    try:
        for r in range(2, tokens.shape[1] + 1):
            active = np.nonzero(specs.length >= r)[0]
            act = torch.from_numpy(active).to(device)
            visible = packed_visibility(base_len, ctx[act], owners, act)
            mask = torch.zeros(visible.shape, dtype=dtype, device=device)
            mask.masked_fill_(~visible, torch.finfo(dtype).min)
            positions = (ctx[act] + (r - 2)).view(1, -1)
            step_ids = torch.from_numpy(tokens[active, r - 2]).to(device).view(1, -1)
            logits = draft(
                step_ids,
                attention_mask=mask.view(1, 1, *mask.shape),
                position_ids=positions,
                past_key_values=draft_cache,
                use_cache=True,
            ).logits[0]
            pick_next(tokens, logits, active, r, specs, temperature)
            owners = torch.cat([owners, act])
    finally:
        crop_to(draft_cache, base_len)
    return [tokens[b, : specs.length[b]] for b in range(n)]


def packed_visibility(
    base_len: int, contexts: torch.Tensor, owners: torch.Tensor, active: torch.Tensor
) -> torch.Tensor:
    """Which cached positions each active tail's next token sees, [active, base + appended +
    active] bool: the first ``contexts[b]`` of the ``base_len`` cached ones (its own prefix),
    the slots appended for its earlier tokens (``owners`` names each slot's tail), itself."""
    device = contexts.device
    appended = owners.numel()
    visible = torch.zeros(len(active), base_len + appended + len(active), dtype=torch.bool)
    visible = visible.to(device)
    visible[:, :base_len] = torch.arange(base_len, device=device) < contexts.view(-1, 1)
    visible[:, base_len : base_len + appended] = owners.view(1, -1) == active.view(-1, 1)
    visible[:, base_len + appended :] = torch.eye(len(active), dtype=torch.bool)
    return visible


def pick_next(
    tokens: np.ndarray,
    logits: torch.Tensor,
    active: np.ndarray,
    r: int,
    specs: TailSpecs,
    temperature: float,
) -> None:
    """Set token r (1-based) of each active tail from its row of ``logits``: the argmax for a
    greedy tail (a greedy continuation is sampling with argmax: same packed forward, other
    pick), else a draw at ``temperature`` with the tail's keyed uniform."""
    device = logits.device
    pick = specs.acceptance[active] == "greedy"
    if pick.any():
        rows = torch.from_numpy(np.nonzero(pick)[0]).to(device)
        tokens[active[pick], r - 1] = logits[rows].argmax(-1).cpu().numpy()
    if not pick.all():
        rows = torch.from_numpy(np.nonzero(~pick)[0]).to(device)
        probs = torch.softmax(logits[rows].float() / temperature, dim=-1)
        u = uniforms(specs.key[active[~pick]], r)
        tokens[active[~pick], r - 1] = sample_from_probs(probs, u).numpy()


def route_tails(
    target: PreTrainedModel,
    spec: MoESpec,
    target_cache: Cache,
    tails: list[np.ndarray],
    contexts: np.ndarray,
) -> np.ndarray:
    """The target's routing of packed tails, ``[sum of lengths, layers, top_k]`` int16, in tail
    order. One forward for all of them; the cache is returned to its original length."""
    lengths = [len(t) for t in tails]
    if not sum(lengths):
        return np.zeros((0, spec.num_moe_layers, spec.top_k), dtype=np.int16)
    root_context = np.repeat(contexts, lengths).tolist()
    return route_forest(
        target, spec, target_cache, np.concatenate(tails), chains_as_tree(lengths), root_context
    )


def route_forest(
    target: PreTrainedModel,
    spec: MoESpec,
    target_cache: Cache,
    tokens: np.ndarray,
    parents: list[int],
    root_context: list[int],
) -> np.ndarray:
    """The target's routing of a packed forest (tails as chains, or the off-path nodes of
    draft trees), ``[nodes, layers, top_k]`` int16: node j follows its ancestors after the
    cache's first ``root_context[j]`` positions. One forward (pipeline.models.forest); the
    cache is returned to its original length."""
    _, routing = forest_forward(target, target_cache, tokens, parents, root_context, spec)
    assert routing is not None
    return routing.to(torch.int16).cpu().numpy()
