"""Counterfactual junk tails (DESIGN section 3): which tails a sequence needs, sampling them from
the draft, and the target's routing of them.

A tail diverges after ``x_s``: its first token is drawn from the draft's distribution at
``x_{<=s}`` with the reference token ``x_{s+1}`` removed, the rest freely from the draft. Both
models see the tails as packed chains against a KV cache of the *whole* reference, each chain's
attention limited to its own prefix ``x_{<=s}`` (tree masks with per-root context lengths), so
no prefix is recomputed and no tail gets a forward of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import Cache, PreTrainedModel

from pipeline.extract.keyed_random import exclude_token, sample_from_probs, stable_key, uniforms
from pipeline.models.adapters import MoESpec
from pipeline.models.kvcache import crop_to
from pipeline.models.routing import RoutingCapture
from pipeline.models.treemask import chains_as_tree, tree_attention_inputs

TAIL_MODES = ("shared", "paper")


@dataclass(frozen=True)
class TailSpecs:
    """One entry per tail. ``i, k, a`` are -1 in ``shared`` mode (a tail serves many cells)."""

    s: np.ndarray
    length: np.ndarray
    key: np.ndarray  # uint64 sampling keys
    i: np.ndarray
    k: np.ndarray
    a: np.ndarray

    def __len__(self) -> int:
        return len(self.s)

    def take(self, idx: np.ndarray) -> TailSpecs:
        return TailSpecs(*(getattr(self, f)[idx] for f in ("s", "length", "key", "i", "k", "a")))


def tail_specs(n_tokens: int, lmax: int, mode: str, seed: int, seq_id: str) -> TailSpecs:
    """The tails a reference of ``n_tokens`` response tokens needs for budgets up to ``lmax``.

    ``shared``: one tail per divergence point s of length min(lmax, N - s), the longest any
    cell (i, k, a) with i + a = s uses. ``paper``: an independent tail of length k - a for every
    cell with a < k <= min(lmax, N - i).
    """
    if mode not in TAIL_MODES:
        raise ValueError(f"tail mode {mode!r} is not one of {', '.join(TAIL_MODES)}")
    if lmax < 1:
        raise ValueError(f"lmax must be >= 1, got {lmax}")
    rows: list[tuple[int, int, int, int, int, int]] = []
    if mode == "shared":
        for s in range(n_tokens):
            rows.append((s, min(lmax, n_tokens - s), stable_key(seed, seq_id, s), -1, -1, -1))
    else:
        for i in range(n_tokens):
            for k in range(1, min(lmax, n_tokens - i) + 1):
                for a in range(k):
                    key = stable_key(seed, seq_id, i + a, i, k)
                    rows.append((i + a, k - a, key, i, k, a))
    if not rows:
        empty = np.zeros(0, dtype=np.int64)
        return TailSpecs(empty, empty, empty.astype(np.uint64), empty, empty, empty)
    cols = list(zip(*rows, strict=True))
    return TailSpecs(
        s=np.array(cols[0], dtype=np.int64),
        length=np.array(cols[1], dtype=np.int64),
        key=np.array(cols[2], dtype=np.uint64),
        i=np.array(cols[3], dtype=np.int64),
        k=np.array(cols[4], dtype=np.int64),
        a=np.array(cols[5], dtype=np.int64),
    )


@torch.no_grad()
def sample_tails(
    draft: PreTrainedModel,
    draft_cache: Cache,
    first_probs: torch.Tensor,
    forbidden: torch.Tensor,
    contexts: np.ndarray,
    specs: TailSpecs,
) -> list[np.ndarray]:
    """Sample every tail in ``specs`` from the draft, one packed draft step per tail position.

    ``draft_cache`` holds the whole reference; ``first_probs[b]`` is the draft's distribution at
    tail b's divergence point, ``forbidden[b]`` the reference token there, ``contexts[b]`` how
    many cached positions tail b may see. The cache is returned to its original length.
    """
    device = first_probs.device
    base_len = draft_cache.get_seq_length()
    n = len(specs)
    tokens = np.zeros((n, int(specs.length.max(initial=0))), dtype=np.int64)
    if n == 0:
        return []
    first = exclude_token(first_probs, forbidden)
    tokens[:, 0] = sample_from_probs(first, uniforms(specs.key, 1)).numpy()
    owners = torch.zeros(0, dtype=torch.long, device=device)  # tail owning each appended slot
    ctx = torch.from_numpy(contexts).to(device)
    dtype = draft.dtype
    try:
        for r in range(2, tokens.shape[1] + 1):
            active = np.nonzero(specs.length >= r)[0]
            act = torch.from_numpy(active).to(device)
            appended = owners.numel()
            visible = torch.zeros(len(active), base_len + appended + len(active), dtype=torch.bool)
            visible = visible.to(device)
            visible[:, :base_len] = torch.arange(base_len, device=device) < ctx[act].view(-1, 1)
            visible[:, base_len : base_len + appended] = owners.view(1, -1) == act.view(-1, 1)
            visible[:, base_len + appended :] = torch.eye(len(active), dtype=torch.bool)
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
            probs = torch.softmax(logits.float(), dim=-1)
            tokens[active, r - 1] = sample_from_probs(probs, uniforms(specs.key[active], r)).numpy()
            owners = torch.cat([owners, act])
    finally:
        crop_to(draft_cache, base_len)
    return [tokens[b, : specs.length[b]] for b in range(n)]


@torch.no_grad()
def route_tails(
    target: PreTrainedModel,
    spec: MoESpec,
    target_cache: Cache,
    tails: list[np.ndarray],
    contexts: np.ndarray,
) -> np.ndarray:
    """The target's routing of packed tails, ``[sum of lengths, layers, top_k]`` int16, in tail
    order. One forward for all of them; the cache is returned to its original length."""
    device = next(target.parameters()).device
    base_len = target_cache.get_seq_length()
    lengths = [len(t) for t in tails]
    if not sum(lengths):
        return np.zeros((0, spec.num_moe_layers, spec.top_k), dtype=np.int16)
    parents = chains_as_tree(lengths)
    root_context = np.repeat(contexts, lengths).tolist()
    mask, positions = tree_attention_inputs(
        parents, base_len, target.dtype, device, root_context=root_context
    )
    ids = torch.from_numpy(np.concatenate(tails)).to(device).view(1, -1)
    try:
        with RoutingCapture(target, spec) as capture:
            target(
                ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=target_cache,
                use_cache=True,
            )
            routing = capture.take(1, ids.shape[1])
    finally:
        crop_to(target_cache, base_len)
    return routing[0].to(torch.int16).cpu().numpy()
