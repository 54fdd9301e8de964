"""Acceptance traces of an EAGLE-3 head along the chains it really drafts.

A draft model's distribution at a position depends only on the text before it, so the
teacher-forced pass gives the state of every chain depth at once, and a trace is one sequence
of positions (pipeline.acceptance.traces). A head's d-th chain token reads its own states of
the d - 1 tokens before it, and is accepted less often than its teacher-forced row says. So
for a head every generated position i starts a chain of up to ``depth`` tokens: row 1 is the
teacher-forced distribution of token i, row d the head's distribution of token i + d - 1
after drafting tokens i .. i + d - 2 (forced to the text: a chain reaches depth d only when
those were accepted). The trace holds the chains one after another, ``depth`` numbering the
rows, so that `next` pairs stay inside a chain and recent acceptance moves once per chain
(pipeline.acceptance.training.design).
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.acceptance.features import context_features, distribution_stats
from pipeline.decode.types import SamplingConfig
from pipeline.extract.head_tails import head_chains
from pipeline.models.eagle3 import Eagle3Head, HeadCache

HEAD_CHAIN_DEPTH = 6  # the deepest chain row traced: past it, chains rarely survive


@torch.no_grad()
def head_chain_rows(
    head: Eagle3Head,
    head_cache: HeadCache,
    head_states: torch.Tensor,
    ids: list[int],
    text: list[int],
    target_probs: torch.Tensor,
    first_probs: torch.Tensor,
    sampling: SamplingConfig,
    depth: int = HEAD_CHAIN_DEPTH,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(stats [rows, features], labels [rows], hidden [rows, H], depth [rows]) of the chains
    started at every position of ``text`` (generated after ``ids``), chain by chain.

    ``head_cache`` / ``head_states``: the head's teacher-forced cache and pre-norm states over
    ids + text (pipeline.models.draft_pass); ``target_probs`` [n, V] and ``first_probs`` [n, V]
    the target's and the head's teacher-forced distributions of each text token."""
    n, start = len(text), len(ids)
    lengths = np.minimum(depth, n - np.arange(n))
    # Per depth d (0-based), per chain: the distribution's stats, its top token, the label.
    dists: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(depth)]
    dists[0] = {i: (first_probs[i], head_states[start + i - 1]) for i in range(n)}
    text_arr = np.asarray(text, dtype=np.int64)

    def choose(r: int, active: np.ndarray, logits: torch.Tensor, states: torch.Tensor):
        probs = sampling.probs(logits)
        for row, chain in enumerate(active.tolist()):
            dists[r - 1][chain] = (probs[row], states[row])
        return text_arr[active + r - 1]  # forced: the chain goes on only where accepted

    contexts = start + np.arange(n)  # target positions before each chain's first token
    head_chains(head, head_cache, head_states, contexts, text_arr, lengths, choose)
    stats, labels, hidden, depths = [], [], [], []
    for d in range(depth):
        chains = sorted(dists[d])
        if not chains:
            continue
        q = torch.stack([dists[d][i][0] for i in chains])
        pos = np.asarray(chains) + d  # the text position each row predicts
        proposed = np.zeros(n, dtype=np.int64)
        proposed[pos] = q.argmax(-1).cpu().numpy()
        context = np.array(context_features(ids, text, proposed.tolist()))[pos]
        if sampling.greedy:
            label = (q.argmax(-1).cpu().numpy() == text_arr[pos]).astype(np.float64)
        else:
            label = torch.minimum(target_probs[pos], q).sum(-1).cpu().numpy()
        row_stats = distribution_stats(q).cpu().numpy().astype(np.float64)
        stats.append((np.asarray(chains), np.column_stack([row_stats, context])))
        labels.append(label)
        hidden.append(torch.stack([dists[d][i][1] for i in chains]).float().cpu().numpy())
        depths.append(np.full(len(chains), d + 1))
    # Chain by chain: order the rows by (chain, depth).
    chain_of = np.concatenate([c for c, _ in stats])
    depth_of = np.concatenate(depths)
    order = np.lexsort((depth_of, chain_of))
    return (
        np.concatenate([s for _, s in stats])[order],
        np.concatenate(labels)[order],
        np.concatenate(hidden)[order],
        depth_of[order],
    )
