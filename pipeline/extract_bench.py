"""Benchmark of the two junk-tail modes on the same reference sequences, in one run."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pipeline.extract import extract_sequence
from pipeline.models import ModelPair
from pipeline.reference import ReferenceSequence
from pipeline.union_from_tables import sequence_union_table


@dataclass(frozen=True)
class ModeResult:
    mode: str
    seconds: float
    reference_tokens: int
    tail_tokens: int
    target_forwards_per_ref_token: float
    # The same without the prompt prefill (x_1..x_{L_prompt-1}), which any method pays once.
    target_forwards_per_ref_token_excl_prompt: float
    mean_u: float
    cells: int


def bench_mode(
    pair: ModelPair, refs: list[ReferenceSequence], lmax: int, mode: str, seed: int
) -> ModeResult:
    u_values: list[np.ndarray] = []
    ref_tokens = tail_tokens = target_forwards = prompt_tokens = 0
    seconds = 0.0
    for ref in refs:
        started = time.perf_counter()
        out = extract_sequence(pair, ref, lmax, mode, seed)
        seconds += time.perf_counter() - started
        table = sequence_union_table(out.tokens, out.tails, pair.spec, lmax)
        u_values.append(table[~np.isnan(table)])
        ref_tokens += out.stats.reference_tokens
        tail_tokens += out.stats.tail_tokens
        target_forwards += out.stats.target_token_forwards
        prompt_tokens += out.stats.prompt_tokens - 1  # x_0 is verified in round 0
    all_u = np.concatenate(u_values)
    return ModeResult(
        mode=mode,
        seconds=seconds,
        reference_tokens=ref_tokens,
        tail_tokens=tail_tokens,
        target_forwards_per_ref_token=target_forwards / max(1, ref_tokens),
        target_forwards_per_ref_token_excl_prompt=(target_forwards - prompt_tokens)
        / max(1, ref_tokens),
        mean_u=float(all_u.mean()),
        cells=len(all_u),
    )
