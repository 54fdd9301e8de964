"""Timed speculative rounds for the verification-cost model (the ``rounds`` table).

For every prompt and every budget K: greedy speculative decoding with a fixed chain of K draft
tokens (K = 0 is plain autoregressive decoding, the m = 1 rounds the AR baseline needs). Each
round records the target verification time T_T, the draft time T_D, m = K + 1, the routing
signal U (mean over MoE layers of unique experts in the pass), the context length, KV
occupancy, the generation id, the category and the accepted count. Budgets are interleaved per
prompt so slow drifts of the machine do not masquerade as effects of K, and warm-up rounds on
the first prompt are run for every K and discarded.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pyarrow as pa

from pipeline.data.prompts import Prompt, encode
from pipeline.data.schemas import ROUNDS_SCHEMA
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.simple import AutoregressivePolicy, FixedPolicy
from pipeline.models.loading import ModelPair


def _generation_rounds(
    engine: SpeculativeEngine,
    prompt_ids: list[int],
    k: int,
    max_new_tokens: int,
    eos: int | None,
    repeats: int = 1,
) -> list[dict]:
    """One greedy generation with a fixed chain of k (k = 0: plain steps), a row per round."""
    policy = FixedPolicy(k) if k else AutoregressivePolicy()
    session = engine.start(prompt_ids, policy, repeats=repeats)
    max_pos = getattr(engine.pair.target.config, "max_position_embeddings", 0) or 0
    rows: list[dict] = []
    while len(session.generated) < max_new_tokens:
        ctx_len = len(session.committed)
        new = session.step()
        rec = session.steps[-1]
        rows.append(
            {
                "k": k,
                "m": k + 1,
                "t_target_ms": rec.t_verify_ms,
                "t_draft_ms": rec.t_draft_ms if k else 0.0,
                "u_bar": rec.u_bar,
                "ctx_len": ctx_len,
                "kv_tokens": ctx_len - 1,
                "kv_occupancy": (ctx_len - 1) / max_pos if max_pos else 0.0,
                "accepted": rec.accepted,
                "round": len(rows),
            }
        )
        if eos is not None and eos in new:
            break
    return rows


def collect_rounds(
    pair: ModelPair,
    prompts: list[Prompt],
    ks: list[int],
    max_new_tokens: int = 64,
    warmup_tokens: int = 16,
    max_prompt_tokens: int = 512,
    repeats: int = 1,
    log: Callable[[str], None] = print,
) -> pa.Table:
    """``repeats`` > 1 times every pass that many times and records the median."""
    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    if any(k < 0 for k in ks):
        raise ValueError(f"budgets must be >= 0, got {ks}")
    tok = pair.tokenizer
    encoded = [encode(tok, p.text, keep_last=max_prompt_tokens) for p in prompts]
    eos = tok.eos_token_id
    engine = SpeculativeEngine(pair)
    for k in ks:  # warm-up: allocator, kernels, caches; discarded
        _generation_rounds(engine, encoded[0], k, warmup_tokens, eos)
    rows: list[dict] = []
    started = time.perf_counter()
    for n, (prompt, ids) in enumerate(zip(prompts, encoded, strict=True), 1):
        for k in ks:
            for row in _generation_rounds(engine, ids, k, max_new_tokens, eos, repeats):
                rows.append({"gen_id": f"{prompt.prompt_id}|K{k}", "category": prompt.category,
                             **row})  # fmt: skip
        elapsed = time.perf_counter() - started
        eta = elapsed / n * (len(prompts) - n)
        log(f"[calibrate] prompt {n}/{len(prompts)}: {len(rows):,} rounds, ETA {eta:.0f}s")
    return pa.Table.from_pylist(rows, schema=ROUNDS_SCHEMA)
