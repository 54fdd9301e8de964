"""Timed speculative rounds for the verification-cost model (the ``rounds`` table).

For every prompt and every budget K: speculative decoding with a fixed chain of K draft tokens
(K = 0 is plain autoregressive decoding, the m = 1 rounds the AR baseline needs), in every
decoding mode asked for (greedy, sampled at a temperature and top-p: the draft's sampling is
then in its timed draft work, the target's distributions and the acceptance walk in the
round's t_accept_ms), and for every K in ``look_ks`` a generation of "look" rounds:
the chain of K tokens then looks at one more draft distribution before stopping, as a policy
that decides from the next token's distribution does (K + 1 draft forwards; K = 0: one look,
no draft token). Each round records the target verification time T_T, the draft time T_D,
the draft forwards it ran, m = K + 1, the routing signal U (mean over MoE layers of unique
experts in the pass), the context length, KV occupancy, the generation id, the category,
the accepted count and the mode's temperature. Budgets and modes are interleaved per prompt
so slow drifts of the machine do not masquerade as effects of K or of the mode, and warm-up
rounds on the first prompt are run for every kind of round and discarded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import pyarrow as pa

from pipeline.data.prompts import Prompt, encode
from pipeline.data.schemas import ROUNDS_SCHEMA
from pipeline.decode.drafter import Drafter
from pipeline.decode.engine import DecodeSession, SpeculativeEngine
from pipeline.decode.heap import frozen_heap
from pipeline.decode.policies.base import Policy, draft_chain
from pipeline.decode.policies.simple import AutoregressivePolicy, FixedPolicy
from pipeline.decode.types import Candidates, SamplingConfig
from pipeline.models.loading import ModelPair


@dataclass
class LookProposer(Policy):
    """Calibration only, not a registered policy (like decode.policies.replay): a chain of k
    draft tokens, then one more draft forward whose distribution it looks at and drops, the
    way `confidence` or `marginal` stop. k + 1 forwards for k tokens; k = 0 is a single look."""

    k: int
    name = "calibration-look"

    def propose(self, drafter: Drafter, committed: list[int]) -> Candidates:
        if self.k == 0:
            drafter.begin(committed)
            return Candidates()
        cands = draft_chain(drafter, committed, self.k)
        drafter.extend(cands.tokens[-1])  # the look: the distribution after the last token
        return cands


class StepObserver(Protocol):
    """Runs at the live state between rounds (designed calibration's in-situ passes)."""

    def warm_up(self, session: DecodeSession) -> None: ...

    def after_step(self, session: DecodeSession, gen_id: str, category: str) -> None: ...


def _policy(k: int, look: bool) -> Policy:
    if look:
        return LookProposer(k)
    return FixedPolicy(k) if k else AutoregressivePolicy()


def _generation_rounds(
    engine: SpeculativeEngine,
    prompt_ids: list[int],
    k: int,
    max_new_tokens: int,
    eos: int | None,
    repeats: int = 1,
    look: bool = False,
    observe: Callable[[DecodeSession], None] | None = None,
    sampling: SamplingConfig | None = None,
    seed: int = 0,
) -> list[dict]:
    """One generation (greedy unless ``sampling`` says otherwise, seeded) with a fixed chain of
    k (k = 0: plain steps), or of look rounds (``look``: k tokens and k + 1 forwards), a row
    per round."""
    session = engine.start(prompt_ids, _policy(k, look), sampling, seed, repeats=repeats)
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
                # No forward, no draft time: what is timed then is only the policy's bookkeeping.
                "t_draft_ms": rec.t_draft_ms if rec.draft_forwards else 0.0,
                "draft_forwards": rec.draft_forwards,
                "u_bar": rec.u_bar,
                "ctx_len": ctx_len,
                "kv_tokens": ctx_len - 1,
                "kv_occupancy": (ctx_len - 1) / max_pos if max_pos else 0.0,
                "accepted": rec.accepted,
                "round": len(rows),
                "temperature": sampling.temperature if sampling is not None else 0.0,
                "t_accept_ms": rec.t_accept_ms,
            }
        )
        if observe is not None:
            observe(session)
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
    look_ks: Iterable[int] = (),
    observer: StepObserver | None = None,
    modes: Sequence[SamplingConfig] = (),
) -> pa.Table:
    """``repeats`` > 1 times every pass that many times and records the median; ``look_ks``
    (a subset of ``ks``) adds a generation of look rounds per prompt for each of its K;
    ``observer`` runs after every round (and once in the warm-up) at the session's state;
    ``modes``: the decoding modes (() : greedy only), every kind of generation run in each,
    each generation seeded by its position in the run so that a calibration repeats."""
    look_ks = sorted(set(look_ks))
    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    if any(k < 0 for k in ks):
        raise ValueError(f"budgets must be >= 0, got {ks}")
    if set(look_ks) - set(ks):
        raise ValueError(f"look budgets {look_ks} must be among the budgets {ks}")
    modes = list(modes) or [SamplingConfig()]
    temperatures = [mode.temperature for mode in modes]
    if len(set(temperatures)) < len(temperatures):
        raise ValueError(f"each decoding mode once: temperatures {temperatures} repeat")
    if repeats > 1 and any(not mode.greedy for mode in modes):
        # A repeat reruns a pass; with draws in it, the repeat would not be the same pass.
        raise ValueError("timing repeats (repeats > 1) need greedy rounds, not sampled ones")
    # Interleaved per prompt: the look generation right after the fixed one of the same K, the
    # modes side by side.
    kinds = [
        (k, look, mode)
        for k in ks
        for look in (False, True)
        for mode in modes
        if not look or k in look_ks
    ]
    tok = pair.tokenizer
    encoded = [encode(tok, p.text, keep_last=max_prompt_tokens) for p in prompts]
    eos = tok.eos_token_id
    engine = SpeculativeEngine(pair)
    for k, look, mode in kinds:  # warm-up: allocator, kernels, caches; discarded
        _generation_rounds(engine, encoded[0], k, warmup_tokens, eos, look=look, sampling=mode)
    if observer is not None:
        session = engine.start(encoded[0], _policy(0, False))
        session.step()
        observer.warm_up(session)
    rows: list[dict] = []
    started = time.perf_counter()
    with frozen_heap():  # no full collection of the loaded libraries inside a timed round
        for n, (prompt, ids) in enumerate(zip(prompts, encoded, strict=True), 1):
            for k, look, mode in kinds:
                gen_id = f"{prompt.prompt_id}|K{k}" + ("+look" if look else "")
                if len(modes) > 1:
                    gen_id += f"|T{mode.temperature:g}"
                observe = (
                    None
                    if observer is None
                    else partial(observer.after_step, gen_id=gen_id, category=prompt.category)
                )
                seed = (n - 1) * len(kinds) + kinds.index((k, look, mode))  # per generation
                for row in _generation_rounds(
                    engine, ids, k, max_new_tokens, eos, repeats, look, observe, mode, seed
                ):
                    rows.append({"gen_id": gen_id, "category": prompt.category, **row})
            elapsed = time.perf_counter() - started
            eta = elapsed / n * (len(prompts) - n)
            log(f"[calibrate] prompt {n}/{len(prompts)}: {len(rows):,} rounds, ETA {eta:.0f}s")
    return pa.Table.from_pylist(rows, schema=ROUNDS_SCHEMA)
