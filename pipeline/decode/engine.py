"""A lossless speculative decoder over HF models with KV caches, the whole loop in one step():
the policy (pipeline.decode.policies) proposes candidates with the draft (a chain, or a tree
given by parent indices); the target verifies the last committed token plus every candidate in
one forward (a 4D tree mask for trees); pipeline.decode.acceptance walks the candidates from the
root; both caches are rolled back to the accepted path. Every step records what was drafted and
verified, the accepted tokens, the unique experts per MoE layer in the verification pass, and
the draft and verification times.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache

from pipeline.decode.acceptance import accept
from pipeline.decode.drafter import Drafter
from pipeline.decode.head_drafter import HeadDrafter
from pipeline.decode.randomness import RandomSource, TorchRandom
from pipeline.decode.step_limits import StepLimitExceeded, StepLimits
from pipeline.decode.stream import GenerationStream
from pipeline.decode.types import Candidates, Generation, SamplingConfig, StepOutcome, StepRecord
from pipeline.models.kvcache import crop_to, keep_positions
from pipeline.models.loading import ModelPair
from pipeline.models.routing import verification_forward
from pipeline.models.timing import timed
from pipeline.models.treemask import tree_attention_inputs


class DecodeSession:
    """One generation in progress: both caches, the committed tokens, the step records."""

    def __init__(
        self,
        pair: ModelPair,
        prompt_ids: list[int],
        policy,
        sampling,
        seed,
        repeats: int = 1,
        rng: RandomSource | None = None,
        limits: StepLimits | None = None,
    ):
        """``repeats`` > 1 (calibration) runs every draft proposal and verification pass that
        many times, rolling the caches back in between, and records the median times; only
        greedy decoding, whose repeats are identical, allows it. ``rng`` is where every random
        draw comes from (default: a torch.Generator seeded with ``seed``, 0 when None).
        ``limits`` bound every step's work as it runs (StepLimitExceeded; None: unbounded)."""
        if not prompt_ids:
            raise ValueError("the prompt has no tokens")
        self.pair = pair
        self.policy = policy
        self.sampling = sampling
        self.rng = rng if rng is not None else TorchRandom(0 if seed is None else seed)
        self.committed = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.limits = limits
        self.drafter = self._new_drafter()
        with torch.no_grad():
            self._prefill_target(self.committed[:-1])
            self.drafter.prefill(self.committed[:-1])
        self.steps: list[StepRecord] = []
        if repeats > 1 and not sampling.greedy:
            raise ValueError("timing repeats need greedy decoding (sampling would differ)")
        self.repeats = repeats
        policy.reset()

    # The target's cache and forwards, the only parts a batched session replaces
    # (pipeline.decode.batched).
    def _new_drafter(self) -> Drafter:
        if self.pair.draft_is_head:
            return HeadDrafter(self.pair, self.sampling, self.rng, self.limits)
        return Drafter(self.pair, self.sampling, self.rng, self.limits)

    def _prefill_target(self, ids: list[int]) -> None:
        self.target_cache = DynamicCache(config=self.pair.target.config)
        if ids:
            t = torch.tensor([ids], device=self.pair.device)
            self.pair.target(t, past_key_values=self.target_cache, use_cache=True)

    def _verify_forward(self, ids: list[int], **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tensor([ids], device=self.pair.device)
        return verification_forward(
            self.pair.target, self.pair.spec, t, self.target_cache, **kwargs
        )

    def _keep_target(self, base: int, extra: list[int]) -> None:
        keep_positions(self.target_cache, base, extra)

    def close(self) -> None:
        """Give back what the session holds (a batched session's cache slots)."""

    def _timed_repeats(self, fn, rollback):
        times = []
        for attempt in range(self.repeats):
            if attempt:
                rollback()
            result, t_ms = timed(self.pair.device, fn)
            times.append(t_ms)
        return result, float(np.median(times))

    @torch.no_grad()
    def step(self) -> list[int]:
        """Draft, verify in one target forward, accept, roll back; the new tokens."""
        cands, t_draft = self.draft()
        logits, routing, t_verify = self.verify(cands)
        return self.commit(cands, logits, routing, t_draft, t_verify)

    # The step's three phases, separate so that a test can enumerate each one's random draws
    # from a snapshot of the session without re-running the phases before it.
    @torch.no_grad()
    def draft(self) -> tuple[Candidates, float]:
        """The policy's proposal (the draft cache rolled back after it) and its time in ms."""

        def propose() -> Candidates:
            self.drafter.start_step()
            try:
                return self.policy.propose(self.drafter, self.committed)
            except StepLimitExceeded as exc:
                raise StepLimitExceeded(f"{self.policy.name}: {exc}") from None
            finally:
                self.drafter.end()

        draft_len = self.drafter.cached()
        return self._timed_repeats(propose, lambda: self.drafter._crop(draft_len))

    @torch.no_grad()
    def verify(self, cands: Candidates) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One target forward over the last committed token and every candidate: its logits,
        the routing of the pass and its time in ms (the target cache holds all positions)."""
        pair = self.pair
        if self.limits is not None:
            try:
                self.limits.check_verified(len(cands) + 1)
            except StepLimitExceeded as exc:
                raise StepLimitExceeded(f"{self.policy.name}: {exc}") from None
        base = len(self.committed) - 1
        ids = [self.committed[-1], *cands.tokens]
        kwargs = {}
        if not cands.is_chain:
            parents = [-1] + [p + 1 for p in cands.parents]
            mask, positions = tree_attention_inputs(parents, base, pair.target.dtype, pair.device)
            kwargs = {"attention_mask": mask, "position_ids": positions}

        def run():
            return self._verify_forward(ids, **kwargs)

        (logits, routing), t_verify = self._timed_repeats(
            run, lambda: crop_to(self.target_cache, base)
        )
        return logits, routing, t_verify

    def commit(
        self,
        cands: Candidates,
        logits: torch.Tensor,
        routing: torch.Tensor,
        t_draft: float,
        t_verify: float,
    ) -> list[int]:
        """Accept (the step's only draws after drafting), keep the accepted path in the target
        cache, record the step, let the policy adapt; the new tokens."""
        base = len(self.committed) - 1
        # Timed: at T > 0 the target's distributions and the acceptance walk are work a
        # step pays beside the forward (the cost model prices them per decoding mode).
        (new, accepted), t_accept = timed(
            self.pair.device,
            lambda: accept(cands, self.sampling.probs(logits), self.sampling, self.rng),
        )
        path = [0] + [n + 1 for n in accepted]
        self._keep_target(base, path)
        self.drafter.observe(path)
        self.committed.extend(new)
        routing_np = routing.cpu().numpy()
        unique = [len(np.unique(routing_np[:, layer])) for layer in range(routing_np.shape[1])]
        record = StepRecord(
            len(cands),
            len(cands) + 1,
            len(accepted),
            len(new),
            unique,
            t_draft,
            t_verify,
            self.drafter.forwards,
            self.drafter.tokens,
            t_accept,
        )
        self.steps.append(record)
        self.policy.update(StepOutcome(cands, len(accepted), record, tuple(accepted)))
        return new

    @property
    def generated(self) -> list[int]:
        return self.committed[self.prompt_len :]


class SpeculativeEngine:
    """Decodes with ``pair``; with ``limits`` every session's steps are bounded as they run
    (a server also refuses policies whose declared step work exceeds them, before decoding:
    pipeline.decode.step_limits.check_step_limits)."""

    def __init__(self, pair: ModelPair, limits: StepLimits | None = None):
        self.pair = pair
        self.limits = limits

    def start(
        self,
        prompt_ids: list[int],
        policy,
        sampling=None,
        seed=None,
        repeats: int = 1,
        rng: RandomSource | None = None,
    ) -> DecodeSession:
        return DecodeSession(
            self.pair,
            prompt_ids,
            policy,
            sampling or SamplingConfig(),
            seed,
            repeats,
            rng,
            self.limits,
        )

    def stream(
        self,
        prompt_ids: list[int],
        policy,
        max_new_tokens: int = 64,
        sampling: SamplingConfig | None = None,
        seed: int | None = None,
        stop: list[str] | None = None,
        stop_at_eos: bool = True,
    ) -> GenerationStream:
        """A generation to run step by step, handing out its text as it grows."""
        return GenerationStream(
            self, prompt_ids, policy, max_new_tokens, sampling, seed, stop, stop_at_eos
        )

    def generate(
        self,
        prompt_ids: list[int],
        policy,
        max_new_tokens: int = 64,
        sampling: SamplingConfig | None = None,
        seed: int | None = None,
        stop: list[str] | None = None,
        stop_at_eos: bool = True,
    ) -> Generation:
        """Decode until max_new_tokens, EOS or a stop string (the text ends before it)."""
        return self.stream(
            prompt_ids, policy, max_new_tokens, sampling, seed, stop, stop_at_eos
        ).run()
