"""Per-sequence extraction: the rows of the ``sequences``, ``tokens`` and ``tails`` tables.

For one reference sequence: one teacher-forced target pass (routing of x_0..x_N, the target's
probability of each reference token, and the KV cache the tails are verified against), one
teacher-forced draft pass (the probability of each reference token, the greedy-match flag, and
the first junk token's distribution at every divergence point), then the junk tails of every
acceptance rule and draw in packed chunks (pipeline.extract.junk_tails). ``extract_sequences``
runs the teacher-forced passes of several sequences in one batch (pipeline.extract.
teacher_forced) and each sequence's tails on its own slice of the batch's caches. With an
EAGLE-3 head as the draft, its teacher-forced pass reads the target's features of the reference
and its tails continue from its own states (pipeline.extract.head_tails).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np
import pyarrow as pa
import torch

from pipeline.data.references import ReferenceSequence
from pipeline.data.schemas import (
    SEQUENCES_SCHEMA,
    TAILS_SCHEMA,
    TOKENS_SCHEMA,
    TREES_SCHEMA,
    experts_array,
)
from pipeline.extract.draft_trees import TreeRule
from pipeline.extract.head_tails import sample_head_tails
from pipeline.extract.junk_tails import (
    ACCEPTANCES,
    TailSpecs,
    first_tokens,
    route_tails,
    sample_tails,
    tail_specs,
)
from pipeline.extract.teacher_forced import TeacherForced, teacher_forced, teacher_forced_batch
from pipeline.extract.tree_rows import tree_rows
from pipeline.models.loading import ModelPair
from pipeline.predictor.model import ExpertPredictor


@dataclass
class ExtractStats:
    sequences: int = 0
    reference_tokens: int = 0
    prompt_tokens: int = 0
    tail_tokens: int = 0
    tails: int = 0
    target_token_forwards: int = 0
    draft_token_forwards: int = 0
    tree_nodes: int = 0  # rows of the trees table (over rules)
    tree_target_token_forwards: int = 0  # of target_token_forwards: the trees' off-path nodes
    seconds: float = 0.0

    def add(self, other: ExtractStats) -> None:
        for name in (f.name for f in fields(self)):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class SequenceTables:
    sequences: pa.Table
    tokens: pa.Table
    tails: pa.Table
    stats: ExtractStats
    trees: pa.Table = field(default_factory=TREES_SCHEMA.empty_table)


def _chunks(specs: TailSpecs, max_tokens: int) -> list[np.ndarray]:
    """Consecutive groups of tails holding at most ``max_tokens`` tokens each."""
    groups, start, total = [], 0, 0
    for b, length in enumerate(specs.length.tolist()):
        if total + length > max_tokens and b > start:
            groups.append(np.arange(start, b))
            start, total = b, 0
        total += length
    if start < len(specs):
        groups.append(np.arange(start, len(specs)))
    return groups


def _check_sliding_window(pair: ModelPair, length: int) -> None:
    """Packed tails use one 4D mask for every layer and roll caches back by cropping; a
    sliding-window layer (GPT-OSS) keeps only its window, so both break past it."""
    cfg = pair.target.config
    window = getattr(cfg, "sliding_window", None)
    sliding = "sliding_attention" in (getattr(cfg, "layer_types", None) or [])
    if sliding and window and length > window:
        raise ValueError(
            f"sequence of {length} positions exceeds the target's sliding window ({window}); "
            "extraction supports sliding-window layers only within the window"
        )


def _check_draft_trees(pair: ModelPair, trees: tuple[TreeRule, ...]) -> None:
    """Draft trees are built by a draft model's packed tree forwards; a head's tree nodes would
    read their parents' head states, which the tree extraction does not carry yet."""
    if trees:
        pair.require_draft_model("draft-tree extraction (--trees)")


@torch.no_grad()
def extract_sequence(
    pair: ModelPair,
    ref: ReferenceSequence,
    lmax: int,
    mode: str,
    seed: int,
    chunk_tokens: int = 2048,
    *,
    acceptances: tuple[str, ...] = ACCEPTANCES,
    draws: int = 2,
    temperature: float = 1.0,
    forced: TeacherForced | None = None,
    trees: tuple[TreeRule, ...] = (),
    tree_budget: int = 12,
    predictor: ExpertPredictor | None = None,
) -> SequenceTables:
    """All rows for one reference sequence: tails for every acceptance in ``acceptances`` and
    ``draws`` independent draws of each (greedy: one), probabilities at ``temperature``.
    Deterministic for a given (seed, seq_id), whatever ``chunk_tokens`` packs together.
    ``forced``: the sequence's teacher-forced passes, if already run (in a batch). ``trees``:
    selection rules whose first ``tree_budget`` nodes at every state go to the ``trees`` table
    (pipeline.extract.tree_rows; ``predictor`` for EcoSpec's rule)."""
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive number, got {temperature}")
    _check_draft_trees(pair, trees)
    _check_sliding_window(pair, len(ref.all_ids) + max(lmax, tree_budget if trees else 0))
    device = pair.device
    n = ref.n_tokens
    ref_tokens = torch.tensor(ref.all_ids[ref.prompt_len - 1 :], device=device)  # x_0 .. x_N
    if forced is None:
        forced = teacher_forced(pair, ref)
    token_routing = forced.routing
    target_cache, draft_cache = forced.target_cache, forced.draft_cache
    # Row j of `tat` / `at` is the target's / draft's prediction after x_j, i.e. for x_{j+1}.
    tat, at = forced.target_logits, forced.draft_logits
    nxt = ref_tokens[1:]

    def prob_of_reference(logits: torch.Tensor) -> np.ndarray:
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        return logp.gather(1, nxt.view(-1, 1)).view(-1).exp().cpu().numpy()

    draft_prob, target_prob = prob_of_reference(at), prob_of_reference(tat)
    draft_match = (at.argmax(-1) == nxt).cpu().numpy()

    specs = tail_specs(n, lmax, mode, seed, ref.seq_id, acceptances, draws)
    contexts_all = ref.prompt_len + specs.s  # cached positions x_{<=s} a tail may see
    tail_tokens: list[np.ndarray] = []
    tail_routing: list[np.ndarray] = []
    for group in _chunks(specs, chunk_tokens):
        part = specs.take(group)
        ctx = contexts_all[group]
        s_idx = torch.from_numpy(part.s).to(device)
        first = first_tokens(at[s_idx], tat[s_idx], nxt[s_idx], part, temperature)
        if pair.draft_is_head:
            tails = sample_head_tails(
                pair.draft, draft_cache, forced.draft_hidden, first, ctx, part, temperature
            )
        else:
            tails = sample_tails(pair.draft, draft_cache, first, ctx, part, temperature)
        tail_routing.append(route_tails(pair.target, pair.spec, target_cache, tails, ctx))
        tail_tokens.extend(tails)

    lengths = specs.length
    total_tail = int(lengths.sum())
    reps = lambda col: np.repeat(col, lengths)  # noqa: E731 (per-tail value on every token)
    r = (
        np.concatenate([np.arange(1, length + 1) for length in lengths.tolist()])
        if total_tail
        else np.zeros(0, dtype=np.int64)
    )

    def cell_column(values: np.ndarray) -> pa.Array:
        # Paper-mode tails belong to one (i, k, a) cell; shared ones serve many: null.
        if mode == "shared":
            return pa.nulls(total_tail, pa.int32())
        return pa.array(reps(values), pa.int32())

    tails_table = pa.table(
        {
            "seq_id": pa.array([ref.seq_id] * total_tail, pa.string()),
            "mode": pa.array([mode] * total_tail, pa.string()),
            "acceptance": pa.array(reps(specs.acceptance), pa.string()),
            "draw": pa.array(reps(specs.draw), pa.int32()),
            "s": pa.array(reps(specs.s), pa.int32()),
            "r": pa.array(r, pa.int32()),
            "token_id": pa.array(
                np.concatenate(tail_tokens) if tail_tokens else np.zeros(0, np.int64), pa.int32()
            ),
            "experts": experts_array(
                np.concatenate(tail_routing)
                if tail_routing
                else np.zeros((0, pair.spec.num_moe_layers, pair.spec.top_k), np.int16)
            ),
            "i": cell_column(specs.i),
            "k": cell_column(specs.k),
            "a": cell_column(specs.a),
        },
        schema=TAILS_SCHEMA,
    )
    tokens_table = pa.table(
        {
            "seq_id": pa.array([ref.seq_id] * (n + 1), pa.string()),
            "t": pa.array(np.arange(n + 1), pa.int32()),
            "token_id": pa.array(ref_tokens.cpu().numpy(), pa.int32()),
            "draft_prob": pa.array([None, *draft_prob.tolist()], pa.float32()),
            "draft_match": pa.array([None, *draft_match.tolist()], pa.bool_()),
            "target_prob": pa.array([None, *target_prob.tolist()], pa.float32()),
            "experts": experts_array(token_routing),
        },
        schema=TOKENS_SCHEMA,
    )
    sequences_table = pa.table(
        {
            "seq_id": [ref.seq_id],
            "category": [ref.category],
            "prompt_len": [ref.prompt_len],
            "n_tokens": [n],
            "source": [ref.source],
            "prompt_ids": [list(ref.prompt_ids)],
        },
        schema=SEQUENCES_SCHEMA,
    )
    n_tails = len(specs)
    trees_table, tree_stats = (
        tree_rows(pair, ref, forced, list(trees), tree_budget, predictor, chunk_tokens)
        if trees
        else (None, None)
    )
    stats = ExtractStats(
        sequences=1,
        reference_tokens=n,
        prompt_tokens=ref.prompt_len,
        tail_tokens=total_tail,
        tails=n_tails,
        target_token_forwards=len(ref.all_ids) + total_tail,
        draft_token_forwards=len(ref.all_ids) + total_tail - n_tails,
    )
    if tree_stats is None:
        return SequenceTables(sequences_table, tokens_table, tails_table, stats)
    stats.tree_nodes = tree_stats.nodes
    stats.tree_target_token_forwards = tree_stats.target_token_forwards
    stats.target_token_forwards += tree_stats.target_token_forwards
    stats.draft_token_forwards += tree_stats.draft_token_forwards
    return SequenceTables(sequences_table, tokens_table, tails_table, stats, trees_table)


def extract_sequences(
    pair: ModelPair,
    refs: list[ReferenceSequence],
    lmax: int,
    mode: str,
    seed: int,
    chunk_tokens: int = 2048,
    *,
    acceptances: tuple[str, ...] = ACCEPTANCES,
    draws: int = 2,
    temperature: float = 1.0,
    batch_size: int = 16,
    trees: tuple[TreeRule, ...] = (),
    tree_budget: int = 12,
    predictor: ExpertPredictor | None = None,
) -> list[SequenceTables]:
    """``extract_sequence`` of every reference, in order, the teacher-forced passes
    ``batch_size`` sequences at a time (1: each alone, the original path)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive number, got {temperature}")
    _check_draft_trees(pair, trees)
    for ref in refs:  # refuse before the batch's forwards, as a lone sequence does
        _check_sliding_window(pair, len(ref.all_ids) + max(lmax, tree_budget if trees else 0))
    tails = {
        "acceptances": acceptances,
        "draws": draws,
        "temperature": temperature,
        "trees": trees,
        "tree_budget": tree_budget,
        "predictor": predictor,
    }
    out: list[SequenceTables] = []
    for start in range(0, len(refs), batch_size):
        group = refs[start : start + batch_size]
        forced = teacher_forced_batch(pair, group) if batch_size > 1 else [None] * len(group)
        for ref, one in zip(group, forced, strict=True):
            out.append(
                extract_sequence(pair, ref, lmax, mode, seed, chunk_tokens, forced=one, **tails)
            )
    return out
