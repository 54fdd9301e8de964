"""Acceptance traces: what the draft would have proposed at every position of text the target
itself generated, and whether the target would have accepted it.

For each prompt the target decodes a continuation at the given temperature (greedy: exactly
the text T = 0 speculative decoding commits). One teacher-forced pass of each model over
prompt + continuation then gives, at every generated position i, the draft's distribution q_i
and the target's p_i given the true prefix. The label is what verification would do with the
draft's token there: at T = 0 whether the draft's argmax is the target's token (a chain is
accepted up to its first miss, so the label of a position reached by a chain is exactly its
outcome), when sampling the probability sum_x min(p_i(x), q_i(x)) that a token drawn from q_i
is accepted. The target's routing of the same pass gives the mean union of experts per layer
over m consecutive positions, what a verification pass of m positions computes. An EAGLE-3
head's trace holds the chains it drafts from every position instead
(pipeline.acceptance.head_chains): its deeper chain tokens read its own states.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.acceptance.features import FEATURE_NAMES, context_features, distribution_stats
from pipeline.acceptance.head_chains import head_chain_rows
from pipeline.data.prompts import Prompt, encode
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.simple import AutoregressivePolicy
from pipeline.decode.types import SamplingConfig
from pipeline.models.draft_pass import draft_pass
from pipeline.models.eagle3 import HeadCache
from pipeline.models.features import feature_tap
from pipeline.models.loading import ModelPair
from pipeline.models.routing import forward_with_routing, unique_experts_per_layer


@dataclass
class AcceptanceTrace:
    """One generated continuation: per position the draft's distribution stats and the label."""

    prompt_id: str
    temperature: float
    # [n, len(FEATURE_NAMES) - 2]: distribution_stats of q_i, then the context match of its
    # top token (features.context_features)
    stats: np.ndarray
    labels: np.ndarray  # [n] match (T = 0) or sum min(p, q) (T > 0)
    # [n, hidden] the draft's last-layer state that produced q_i (what a SpecDec++-style
    # acceptance head reads)
    hidden: np.ndarray | None = None
    # An EAGLE-3 head's chains (pipeline.acceptance.head_chains): each row's depth in its
    # chain, 1 starting the next chain; None: one sequence of positions (a draft model's).
    depth: np.ndarray | None = None
    # The generated text itself (what the tree ceiling builds trees along); None in traces
    # saved before it was kept.
    tokens: np.ndarray | None = None


@dataclass
class UnionCounts:
    """Sum and count of the mean-over-layers expert union of windows of m positions."""

    sums: np.ndarray  # [max_m]
    counts: np.ndarray  # [max_m]

    def add(self, other: UnionCounts) -> None:
        self.sums += other.sums
        self.counts += other.counts

    def means(self) -> list[float]:
        return [
            float(s / c) if c else float("nan") for s, c in zip(self.sums, self.counts, strict=True)
        ]


def prompt_ids(pair: ModelPair, prompt: Prompt) -> list[int]:
    """As the benchmark encodes a prompt (its last 512 tokens)."""
    return encode(pair.tokenizer, prompt.text, keep_last=512)


@torch.no_grad()
def trace_prompt(
    pair: ModelPair,
    prompt: Prompt,
    sampling: SamplingConfig,
    max_new_tokens: int,
    seed: int,
    max_m: int,
    chains: bool = True,
) -> tuple[AcceptanceTrace, UnionCounts]:
    """The prompt's trace and expert-union counts; with ``chains`` an EAGLE-3 head's trace
    holds the chains it drafts from every position (pipeline.acceptance.head_chains)."""
    ids = prompt_ids(pair, prompt)
    engine = SpeculativeEngine(pair)
    gen = engine.generate(
        ids, AutoregressivePolicy(), max_new_tokens, sampling, seed=seed, stop_at_eos=False
    )
    full = torch.tensor([ids + gen.tokens], device=pair.device)
    start, n = len(ids) - 1, len(gen.tokens)  # logits at start + i predict gen.tokens[i]
    # A head reads the target's features of this same pass: tapped, not run a second time.
    head = pair.draft if pair.draft_is_head else None
    tap = feature_tap(pair.target, head.cfg.aux_layer_ids) if head is not None else None
    out, routing = forward_with_routing(pair.target, pair.spec, full)
    p = sampling.probs(out.logits[0, start : start + n])
    head_cache = HeadCache() if head is not None else None
    features = tap.latest() if tap is not None else None
    draft_logits, draft_hidden = draft_pass(pair, full, features, head_cache)  # model or head
    q = sampling.probs(draft_logits[0, start : start + n])
    hidden = draft_hidden[0, start : start + n]
    if sampling.greedy:
        target_tokens = torch.tensor(gen.tokens, device=q.device)
        labels = (q.argmax(-1) == target_tokens).float()
    else:
        labels = torch.minimum(p, q).sum(-1)
    # The draft's own distribution, then how its top token continues the context.
    proposed = q.argmax(-1).tolist()
    context = np.array(context_features(ids, gen.tokens, proposed), dtype=np.float64)
    stats = np.column_stack([distribution_stats(q).cpu().numpy().astype(np.float64), context])
    # Verification passes start at the last committed token: windows over positions start ...
    routing = routing[0, start : start + n]
    sums, counts = np.zeros(max_m), np.zeros(max_m)
    for m in range(1, max_m + 1):
        for i in range(0, n - m + 1, max(1, m // 2)):
            u = unique_experts_per_layer(routing[i : i + m], pair.spec.num_experts)
            sums[m - 1] += float(u.float().mean())
            counts[m - 1] += 1
    if chains and head_cache is not None:
        stats, chain_labels, chain_hidden, depth = head_chain_rows(
            pair.draft, head_cache, draft_hidden[0], ids, gen.tokens, p, q, sampling
        )
        trace = AcceptanceTrace(
            prompt.prompt_id,
            sampling.temperature,
            stats,
            chain_labels,
            chain_hidden,
            depth,
            tokens=np.asarray(gen.tokens, dtype=np.int64),
        )
        return trace, UnionCounts(sums, counts)
    trace = AcceptanceTrace(
        prompt.prompt_id,
        sampling.temperature,
        stats,
        labels.cpu().numpy().astype(np.float64),
        hidden.float().cpu().numpy(),
        tokens=np.asarray(gen.tokens, dtype=np.int64),
    )
    return trace, UnionCounts(sums, counts)


def collect_traces(
    pair: ModelPair,
    prompts: list[Prompt],
    temperatures: list[float],
    max_new_tokens: int,
    max_m: int,
    seed: int = 0,
    log: Callable[[str], None] = print,
    chains: bool = True,
) -> tuple[list[AcceptanceTrace], UnionCounts]:
    """Traces of every prompt at every temperature (sampled continuations seeded per prompt),
    and the expert-union counts of the greedy ones (or of all when none is greedy). An
    EAGLE-3 head's traces are its chains unless ``chains`` is False (one sequence of its
    teacher-forced rows, as a position-by-position replay needs)."""
    traces: list[AcceptanceTrace] = []
    unions = UnionCounts(np.zeros(max_m), np.zeros(max_m))
    use_all = all(t > 0 for t in temperatures)
    for t_index, temperature in enumerate(temperatures):
        sampling = SamplingConfig(temperature=temperature)
        for p_index, prompt in enumerate(prompts):
            trace, counts = trace_prompt(
                pair,
                prompt,
                sampling,
                max_new_tokens,
                seed + 1000 * t_index + p_index,
                max_m,
                chains,
            )
            traces.append(trace)
            if sampling.greedy or use_all:
                unions.add(counts)
        rate = np.mean(np.concatenate([t.labels for t in traces if t.temperature == temperature]))
        log(f"  T={temperature:g}: {len(prompts)} prompts traced, mean acceptance {rate:.3f}")
    return traces, unions


def save_traces(path: Path, traces: list[AcceptanceTrace], unions: UnionCounts, meta: dict) -> None:
    """One .npz (concatenated arrays and offsets, and ``meta``: the pair and the settings the
    traces came from), so a refit need not decode again."""
    lengths = np.array([len(t.labels) for t in traces])
    texts = {}
    if all(t.tokens is not None for t in traces):
        texts = {
            "tokens": np.concatenate([t.tokens for t in traces]),
            "token_lengths": np.array([len(t.tokens) for t in traces]),
        }
    np.savez_compressed(
        path,
        **texts,
        prompt_ids=np.array([t.prompt_id for t in traces]),
        temperatures=np.array([t.temperature for t in traces]),
        lengths=lengths,
        stats=np.concatenate([t.stats for t in traces]),
        labels=np.concatenate([t.labels for t in traces]),
        hidden=np.concatenate([t.hidden for t in traces]),
        # 0: a row of a draft model's sequence (depth None)
        depth=np.concatenate(
            [np.zeros(len(t.labels), np.int64) if t.depth is None else t.depth for t in traces]
        ),
        union_sums=unions.sums,
        union_counts=unions.counts,
        meta=np.array(json.dumps(meta)),
    )


def load_traces(path: Path) -> tuple[list[AcceptanceTrace], UnionCounts, dict]:
    # Every array read once: an NpzFile decompresses an array again on each access, and a
    # trace's slices of those copies would keep one whole copy alive per trace.
    with np.load(path) as npz:
        data = {name: npz[name] for name in npz.files}
    width = len(FEATURE_NAMES) - 2
    if data["stats"].shape[1] != width:
        raise ValueError(
            f"{path}: traces with {data['stats'].shape[1]} features per position, "
            f"this version reads {width}; remove the file to trace again"
        )
    ends = np.cumsum(data["lengths"])
    starts = ends - data["lengths"]
    depth = data["depth"] if "depth" in data else np.zeros(len(data["labels"]), np.int64)
    texts: list[np.ndarray | None] = [None] * len(ends)
    if "tokens" in data:
        cuts = np.cumsum(data["token_lengths"])[:-1]
        texts = list(np.split(data["tokens"], cuts))
    traces = [
        AcceptanceTrace(
            str(pid),
            float(temp),
            data["stats"][a:b],
            data["labels"][a:b],
            data["hidden"][a:b],
            depth[a:b] if depth[a:b].any() else None,
            text,
        )
        for pid, temp, a, b, text in zip(
            data["prompt_ids"], data["temperatures"], starts, ends, texts, strict=True
        )
    ]
    meta = json.loads(str(data["meta"])) if "meta" in data else {}
    return traces, UnionCounts(data["union_sums"], data["union_counts"]), meta
