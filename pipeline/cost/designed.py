"""Designed calibration: timed verification passes whose routing is *set*, not observed.

A verification pass's time depends on which experts it computes, not on what the router would
have chosen. So for each m (positions per pass) the per-layer union of selected experts is
forced to every size U in its feasible range (top_k .. min(m top_k, n_experts); evenly spaced
levels when there are many), with random expert identities and random assignment of tokens to
them (pipeline.models.forced_routing). That spans U fully at every m, which natural routing
never does, and separates alpha(m) from beta0(m); it also calibrates models whose weights are
random, where natural routing means nothing.

This module holds one designed pass and the in-situ design (passes between the rounds of
decoding); pipeline.cost.designed_contexts runs the cells on their own, at set contexts;
pipeline.cost.design_stats summarises them. Rows follow the `rounds` table (ROUNDS_SCHEMA),
one per timed pass, with draft_forwards 0 (no draft runs), so the same fit reads them.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pyarrow as pa
import torch
from torch import nn
from transformers import DynamicCache

from pipeline.data.schemas import ROUNDS_SCHEMA
from pipeline.decode.engine import DecodeSession
from pipeline.models.adapters import MoESpec
from pipeline.models.forced_routing import ForcedRouting, design_plan, feasible_unions
from pipeline.models.kvcache import crop_to
from pipeline.models.routing import verification_forward
from pipeline.models.timing import timed


def union_levels(m: int, top_k: int, num_experts: int, max_levels: int) -> list[int]:
    """The U values to force at m: all feasible ones, or ``max_levels`` evenly spaced between
    the smallest and the largest (both included)."""
    feasible = list(feasible_unions(m, top_k, num_experts))
    if len(feasible) <= max_levels:
        return feasible
    picks = np.linspace(0, len(feasible) - 1, max_levels).round().astype(int)
    return sorted({feasible[i] for i in picks})


class InSituDesign:
    """Designed passes timed at the live states of the observational generations: after every
    round, ``per_round`` passes, each the next (m, U) cell of a shuffled plan (every cell once
    per block, blocks reshuffled), run on the session's own target cache at its current
    context, with the same back-to-back repeats and median as the round itself.

    Each designed pass then shares everything with decoding but the routing: the machine's
    state at that moment, the cache and its warmth, the context length, the code path. Only
    the design differs, so the model it fits prices decoding's rounds and not a bench
    protocol's. The draft never runs for them; the draft line comes from the rounds."""

    def __init__(
        self,
        spec: MoESpec,
        ms: Iterable[int],
        max_levels: int = 8,
        repeats: int = 1,
        per_round: int = 1,
        seed: int = 0,
    ) -> None:
        ms = sorted(set(ms))
        if not ms or ms[0] < 1 or repeats < 1 or per_round < 1:
            raise ValueError("in-situ design needs m >= 1, repeats >= 1 and per_round >= 1")
        self.spec, self.repeats, self.per_round = spec, repeats, per_round
        self.cells = [
            (m, u) for m in ms for u in union_levels(m, spec.top_k, spec.num_experts, max_levels)
        ]
        self._gen = torch.Generator().manual_seed(seed)
        self._order = np.random.default_rng(seed)
        self._next: list[tuple[int, int]] = []
        self.rows: list[dict] = []

    def _cell(self) -> tuple[int, int]:
        if not self._next:
            self._next = [self.cells[i] for i in self._order.permutation(len(self.cells))]
        return self._next.pop()

    def _passes(
        self, session: DecodeSession, cells: list[tuple[int, int]]
    ) -> list[tuple[int, int, float]]:
        model = session.pair.target
        vocab = int(model.config.vocab_size)
        base = len(session.committed) - 1
        out = []
        with torch.no_grad(), ForcedRouting(model, self.spec) as forced:
            for m, u in cells:
                t_ms = designed_pass(
                    model,
                    self.spec,
                    forced,
                    session.target_cache,
                    base,
                    session.committed[-1],
                    m,
                    u,
                    self._gen,
                    vocab,
                    self.repeats,
                )
                out.append((m, u, t_ms))
        return out

    def warm_up(self, session: DecodeSession) -> None:
        """Every cell once at this state, discarded: allocator, kernels, every shape."""
        self._passes(session, self.cells)

    def after_step(self, session: DecodeSession, gen_id: str, category: str) -> None:
        max_pos = getattr(session.pair.target.config, "max_position_embeddings", 0) or 0
        ctx_len = len(session.committed)
        for m, u, t_ms in self._passes(session, [self._cell() for _ in range(self.per_round)]):
            self.rows.append(
                designed_row(
                    f"{gen_id}|m{m}", category, m, u, ctx_len, t_ms, max_pos, len(self.rows)
                )
            )

    def table(self) -> pa.Table:
        return pa.Table.from_pylist(self.rows, schema=ROUNDS_SCHEMA)


def designed_row(
    gen_id: str, category: str, m: int, u: int, ctx_len: int, t_ms: float, max_pos: int, index: int
) -> dict:
    """A `rounds` row for one designed pass: no draft ran (draft_forwards 0)."""
    base = ctx_len - 1
    return {
        "gen_id": gen_id,
        "category": category,
        "k": m - 1,
        "m": m,
        "t_target_ms": t_ms,
        "t_draft_ms": 0.0,
        "draft_forwards": 0,
        "u_bar": float(u),
        "ctx_len": ctx_len,
        "kv_tokens": base,
        "kv_occupancy": base / max_pos if max_pos else 0.0,
        "accepted": 0,
        "round": index,
    }


def designed_pass(
    model: nn.Module,
    spec: MoESpec,
    forced: ForcedRouting,
    cache: DynamicCache,
    base: int,
    last: int,
    m: int,
    u: int,
    gen: torch.Generator,
    vocab: int,
    repeats: int = 1,
) -> float:
    """One verification pass (the last committed token and m - 1 random ones) with the
    routing forced to a union of u experts per layer, run exactly as the engine verifies
    (pipeline.models.routing.verification_forward, routing capture included); its time in ms
    (the median of ``repeats`` back-to-back runs), the cache rolled back after each."""
    tokens = [last, *torch.randint(vocab, (m - 1,), generator=gen).tolist()]
    device = next(model.parameters()).device
    # On the device before the clock starts: decoding pays no host-to-device copy per layer.
    forced.set(design_plan(m, u, spec, gen).to(device))
    batch = torch.tensor([tokens], device=device)
    times = []
    for _ in range(repeats):
        (_, routing), t_ms = timed(device, lambda: verification_forward(model, spec, batch, cache))
        crop_to(cache, base)
        times.append(t_ms)
    got = {len(torch.unique(routing[:, layer])) for layer in range(routing.shape[1])}
    if got != {u}:  # the hooks' order or a family's call changed: the design would be a lie
        raise RuntimeError(f"forced routing missed: m={m} asked U={u}, computed {sorted(got)}")
    return float(np.median(times))
