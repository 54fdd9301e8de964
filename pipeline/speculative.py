"""One speculative round on HF models with KV caches: propose a chain with the draft, verify it
with the target in one forward, accept greedily, roll both caches back.

Shared by the calibration (timed rounds) and the online engine. Invariants between rounds:
the target cache holds every committed token but the last (the verification pass feeds the last
committed token first, so it covers m = k + 1 positions); the draft cache holds a prefix of the
committed tokens, and the draft catches up on the rest when it next proposes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

from pipeline.kvcache import crop_to
from pipeline.models import ModelPair
from pipeline.routing import RoutingCapture
from pipeline.timing import timed


@dataclass
class ChainState:
    committed: list[int]
    target_cache: DynamicCache
    draft_cache: DynamicCache
    prompt_len: int

    @property
    def generated(self) -> int:
        return len(self.committed) - self.prompt_len


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    confidences: list[float]  # the draft's probability of each proposed token
    t_ms: float


@dataclass(frozen=True)
class Verification:
    accepted: int
    new_tokens: list[int]  # accepted draft tokens, then the target's bonus token
    routing: np.ndarray  # [m, MoE layers, top_k] experts selected in the pass
    u_bar: float  # mean over MoE layers of unique experts in the pass
    t_ms: float
    kv_tokens: int  # target cache length before the pass


@torch.no_grad()
def start(pair: ModelPair, prompt_ids: list[int]) -> ChainState:
    """Prefill both caches with the prompt but its last token."""
    if not prompt_ids:
        raise ValueError("the prompt has no tokens")
    target_cache = DynamicCache(config=pair.target.config)
    draft_cache = DynamicCache(config=pair.draft.config)
    if len(prompt_ids) > 1:
        ids = torch.tensor([prompt_ids[:-1]], device=pair.device)
        pair.target(ids, past_key_values=target_cache, use_cache=True)
        pair.draft(ids, past_key_values=draft_cache, use_cache=True)
    return ChainState(list(prompt_ids), target_cache, draft_cache, len(prompt_ids))


@torch.no_grad()
def propose_greedy(pair: ModelPair, state: ChainState, k: int, repeats: int = 1) -> Proposal:
    """k greedy draft tokens; the first forward also feeds committed tokens the draft lacks.

    ``repeats`` > 1 re-runs the proposal from the same cache and reports the median time.
    """
    if k == 0:
        return Proposal([], [], 0.0)
    draft_len = state.draft_cache.get_seq_length()

    def run() -> tuple[list[int], list[float]]:
        pending = state.committed[state.draft_cache.get_seq_length() :]
        tokens, confidences = [], []
        for _ in range(k):
            ids = torch.tensor([pending], device=pair.device)
            logits = pair.draft(ids, past_key_values=state.draft_cache, use_cache=True).logits
            probs = torch.softmax(logits[0, -1].float(), dim=-1)
            token = int(probs.argmax())
            tokens.append(token)
            confidences.append(float(probs[token]))
            pending = [token]
        return tokens, confidences

    times = []
    for attempt in range(repeats):
        if attempt:
            crop_to(state.draft_cache, draft_len)
        (tokens, confidences), t_ms = timed(pair.device, run)
        times.append(t_ms)
    return Proposal(tokens, confidences, float(np.median(times)))


@torch.no_grad()
def verify_greedy(
    pair: ModelPair, state: ChainState, drafted: list[int], repeats: int = 1
) -> Verification:
    """Verify ``drafted`` after the last committed token in one target forward; greedy accept.

    ``repeats`` > 1 re-runs the same pass (rolling the cache back in between) and reports the
    median time: a steadier measurement on a shared CPU, for calibration.
    """
    ids = torch.tensor([[state.committed[-1], *drafted]], device=pair.device)
    kv_tokens = state.target_cache.get_seq_length()

    def run():
        with RoutingCapture(pair.target, pair.spec) as capture:
            logits = pair.target(ids, past_key_values=state.target_cache, use_cache=True).logits
            return logits[0].argmax(-1), capture.take(1, ids.shape[1])[0]

    times = []
    for attempt in range(repeats):
        if attempt:
            crop_to(state.target_cache, kv_tokens)
        (choice, routing), t_ms = timed(pair.device, run)
        times.append(t_ms)
    t_ms = float(np.median(times))
    choice = choice.tolist()
    accepted = 0
    while accepted < len(drafted) and drafted[accepted] == choice[accepted]:
        accepted += 1
    routing_np = routing.to(torch.int16).cpu().numpy()
    return Verification(
        accepted=accepted,
        new_tokens=[*drafted[:accepted], choice[accepted]],
        routing=routing_np,
        u_bar=unique_mean(routing_np),
        t_ms=t_ms,
        kv_tokens=kv_tokens,
    )


def unique_mean(routing: np.ndarray) -> float:
    """Mean over MoE layers of the number of unique experts over all positions."""
    return float(np.mean([len(np.unique(routing[:, layer])) for layer in range(routing.shape[1])]))


def commit(state: ChainState, verification: Verification) -> None:
    """Append the accepted tokens and bonus; drop rejected positions from both caches."""
    before = len(state.committed)
    keep = before + verification.accepted  # last committed + accepted drafts
    crop_to(state.target_cache, keep)
    crop_to(state.draft_cache, min(keep, state.draft_cache.get_seq_length()))
    state.committed.extend(verification.new_tokens)
