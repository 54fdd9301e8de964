"""Designed passes in a run of their own: every (context, m, U) cell, several repeats each, in
one shuffled order after a warm-up, at contexts of set lengths (real prompt text, or random ids
for a target without a tokenizer or with random weights). Only the target runs.

Decoding's own state is not reproduced here (pipeline.cost.designed.InSituDesign does that for
a model pair); this is the design for a target alone (jobs.calibrate_random) and
`jobs.calibrate --design forced-contexts`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from pipeline.cost.designed import designed_pass, designed_row, union_levels
from pipeline.data.prompts import Prompt, encode
from pipeline.data.schemas import ROUNDS_SCHEMA
from pipeline.models.adapters import MoESpec
from pipeline.models.forced_routing import ForcedRouting


def context_ids(prompt_ids: list[list[int]], index: int, length: int) -> list[int]:
    """A context of exactly ``length`` tokens ending with prompt ``index``: its last tokens,
    or, when it is shorter, the other prompts' tokens before it (real text, cycled)."""
    n = len(prompt_ids)
    # The other prompts in order (this one when it is alone): prepended, again and again.
    filler = [t for j in range(1, n) for t in prompt_ids[(index + j) % n]] or prompt_ids[index]
    if not filler:
        raise ValueError("the prompts have no tokens to build a context from")
    ids = list(prompt_ids[index])
    while len(ids) < length:
        ids = filler[-(length - len(ids)) :] + ids
    return ids[-length:]


@dataclass(frozen=True)
class DesignedContext:
    """One context the designed passes run at: its token ids (the last one is the pass's
    committed token), the prefix of its rows' gen_id and the category they carry."""

    name: str
    category: str
    ids: list[int]


def prompt_contexts(
    tokenizer, prompts: list[Prompt], lengths: Iterable[int] = (), max_prompt_tokens: int = 512
) -> list[DesignedContext]:
    """Contexts built from real prompt text: every prompt at every length in ``lengths``
    (none given: at its own length)."""
    lengths = sorted(set(lengths))
    if lengths and lengths[0] < 2:
        raise ValueError(f"designed contexts need >= 2 tokens, got {lengths[0]}")
    encoded = [encode(tokenizer, p.text, keep_last=max_prompt_tokens) for p in prompts]
    out = []
    for i, prompt in enumerate(prompts):
        for length in lengths or [len(encoded[i])]:
            if length >= 2:
                ids = context_ids(encoded, i, length)
                out.append(DesignedContext(f"{prompt.prompt_id}|L{len(ids)}", prompt.category, ids))
    return out


def random_contexts(
    vocab_size: int, lengths: Iterable[int], per_length: int = 2, seed: int = 0
) -> list[DesignedContext]:
    """Contexts of random token ids, ``per_length`` at every length: for a target with random
    weights (no text means anything to it) or without a tokenizer. Attention's cost depends on
    the length, not on the ids."""
    lengths = sorted(set(lengths))
    if not lengths or lengths[0] < 2 or per_length < 1:
        raise ValueError("random contexts need lengths >= 2 tokens and per_length >= 1")
    gen = torch.Generator().manual_seed(seed)
    return [
        DesignedContext(
            f"random{j}|L{length}",
            "random",
            torch.randint(vocab_size, (length,), generator=gen).tolist(),
        )
        for length in lengths
        for j in range(per_length)
    ]


def collect_designed_rounds(
    model: nn.Module,
    spec: MoESpec,
    contexts: list[DesignedContext],
    ms: Iterable[int],
    repeats: int = 5,
    max_levels: int = 8,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> pa.Table:
    """Every (context, m, U) cell ``repeats`` times, all in one shuffled order after a
    warm-up; a row per timed pass. Only the target runs (no draft, no tokenizer), so this
    also calibrates a model with random weights.
    Setting L as well (contexts of several lengths) spans the context term, which would
    otherwise trade off against beta0(m) over a few lengths. gen_id is context|m, so that the
    fit's clustering and cross-validation hold out whole groups as they hold out generations."""
    ms = sorted(set(ms))
    if not contexts or not ms or min(ms) < 1 or repeats < 1:
        raise ValueError("designed calibration needs contexts, m >= 1 and repeats >= 1")
    if min(len(c.ids) for c in contexts) < 2:
        raise ValueError("designed contexts need >= 2 tokens")
    cells = [(m, u) for m in ms for u in union_levels(m, spec.top_k, spec.num_experts, max_levels)]
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    order = np.random.default_rng(seed)
    max_pos = getattr(model.config, "max_position_embeddings", 0) or 0
    vocab = int(model.config.vocab_size)
    rows: list[dict] = []
    with torch.no_grad(), ForcedRouting(model, spec) as forced:
        # Every context's cache stays alive, so that one shuffled order interleaves all the
        # (context, m, U) cells: a drift in the machine's speed during the run then spreads
        # over every cell instead of lining up with the context length or the prompt.
        caches = [_prefill(model, c.ids[:-1], device) for c in contexts]
        log(
            f"[calibrate:designed] {len(contexts)} contexts x {len(cells)} (m, U) cells x "
            f"{repeats} repeats = {len(contexts) * len(cells) * repeats:,} passes"
        )

        def run(s_: int, m: int, u: int) -> float:
            ids = contexts[s_].ids
            return designed_pass(
                model, spec, forced, caches[s_], len(ids) - 1, ids[-1], m, u, gen, vocab
            )

        for m, u in cells:  # warm-up: allocator, kernels, every shape once; discarded
            run(0, m, u)
        plan = [(s_, cell) for s_ in range(len(contexts)) for cell in cells for _ in range(repeats)]
        started, report_every = time.perf_counter(), max(1, len(plan) // 10)
        for done, j in enumerate(order.permutation(len(plan)), 1):
            s_, (m, u) = plan[j]
            ctx = contexts[s_]
            rows.append(
                designed_row(
                    f"{ctx.name}|m{m}",
                    ctx.category,
                    m,
                    u,
                    len(ctx.ids),
                    run(s_, m, u),
                    max_pos,
                    len(rows),
                )
            )
            if done % report_every == 0 or done == len(plan):
                elapsed = time.perf_counter() - started
                log(
                    f"[calibrate:designed] {done:,}/{len(plan):,} passes, "
                    f"ETA {elapsed / done * (len(plan) - done):.0f}s"
                )
    return pa.Table.from_pylist(rows, schema=ROUNDS_SCHEMA)


def _prefill(model: nn.Module, ids: list[int], device: torch.device):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if ids:
        model(torch.tensor([ids], device=device), past_key_values=cache, use_cache=True)
    return cache
