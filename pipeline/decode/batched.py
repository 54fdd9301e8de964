"""Continuous batching: the decode session and drafter of pipeline.decode.engine, with every
model call a part of a packed forward (pipeline.decode.batching) instead of a forward of its
own. Only the cache and the model calls differ; drafting, verification, acceptance and the
policies are the batch-1 code, so a generation in a batch decodes exactly as it would alone
(up to float rounding of the packed kernels).

``BatchedEngine.generate_many`` runs a list of prompts this way in-process (tests,
benchmarks); the Serve replica (serving.batched_worker) drives the same engine with requests
joining and leaving.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from pipeline.decode.batching import ForwardBatcher, ForwardRequest
from pipeline.decode.drafter import Drafter
from pipeline.decode.engine import DecodeSession, SpeculativeEngine
from pipeline.decode.step_limits import StepLimits
from pipeline.decode.types import Generation, SamplingConfig
from pipeline.models.loading import ModelPair


def _visibility(kw: dict) -> tuple[torch.Tensor | None, list[int] | None]:
    """The bool visibility and positions a 4D additive mask and position_ids describe."""
    mask = kw.get("attention_mask")
    if mask is None:
        return None, None
    return (mask[0, 0] == 0).cpu(), kw["position_ids"][0].tolist()


def sliding_window(config) -> str | None:
    """What makes ``config``'s attention slide, or None. With ``layer_types`` (GPT-OSS, Qwen2)
    a layer marked sliding does; without them (Mixtral-style) a ``sliding_window`` that is set
    does: transformers then masks every layer to it. The packed mask shows a sequence all of
    its cached positions, so either would decode differently from the model alone."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return "sliding_attention layers" if "sliding_attention" in layer_types else None
    window = getattr(config, "sliding_window", None)
    return None if window is None else f"sliding_window {window}"


class BatchedDrafter(Drafter):
    def __init__(self, batcher: ForwardBatcher, *args, **kwargs) -> None:
        self.batcher = batcher
        super().__init__(*args, **kwargs)

    def _new_cache(self):
        self.row = self.batcher.acquire("draft")
        return None

    def _model(self, ids: list[int], **kw) -> tuple[torch.Tensor, torch.Tensor]:
        visible, positions = _visibility(kw)
        req = ForwardRequest(
            "draft", self.row, ids, visible, positions, prefill=self.in_prefill, begin=self.in_begin
        )
        self.batcher.forward(req)
        return req.logits, req.hidden

    def cached(self) -> int:
        return self.batcher.length("draft", self.row)

    def _crop(self, length: int) -> None:
        self.batcher.crop("draft", self.row, length)


class BatchedSession(DecodeSession):
    def __init__(self, batcher: ForwardBatcher, *args, **kwargs) -> None:
        self.batcher = batcher
        self.target_row: int | None = None
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            self.close()
            raise
        if self.repeats > 1:
            self.close()
            raise ValueError("timing repeats need a session of its own (SpeculativeEngine)")

    def _new_drafter(self) -> Drafter:
        return BatchedDrafter(self.batcher, self.pair, self.sampling, self.rng, self.limits)

    def _prefill_target(self, ids: list[int]) -> None:
        self.target_row = self.batcher.acquire("target")
        if ids:
            self.batcher.forward(
                ForwardRequest("target", self.target_row, ids, None, None, prefill=True)
            )

    def _verify_forward(self, ids: list[int], **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        visible, positions = _visibility(kwargs)
        req = ForwardRequest("target", self.target_row, ids, visible, positions, routing=True)
        self.batcher.forward(req)
        return req.logits, req.experts

    def _keep_target(self, base: int, extra: list[int]) -> None:
        self.batcher.keep("target", self.target_row, base, extra)

    def close(self) -> None:
        if self.target_row is not None:
            self.batcher.release("target", self.target_row)
            self.target_row = None
        drafter = getattr(self, "drafter", None)
        if drafter is not None and drafter.row is not None:
            self.batcher.release("draft", drafter.row)
            drafter.row = None


class BatchedEngine(SpeculativeEngine):
    """A SpeculativeEngine whose sessions share packed forwards through ``batcher``; every
    session must run on its own thread inside ``batcher.participant()``."""

    def __init__(
        self,
        pair: ModelPair,
        limits: StepLimits | None = None,
        batcher: ForwardBatcher | None = None,
    ) -> None:
        # The packed forwards run causal LMs; a head's steps read the target's features.
        pair.require_draft_model("continuous batching (the endpoint's max_batch > 1)")
        for model in (pair.target, pair.draft):
            window = sliding_window(model.config)
            if window is not None:
                raise ValueError(
                    f"continuous batching packs sequences under one 4D mask, which a "
                    f"sliding-window layer ({model.config.model_type}, {window}) cannot "
                    "honour; decode these models one generation at a time (max_batch=1)"
                )
        super().__init__(pair, limits)
        self.batcher = batcher or ForwardBatcher(pair)

    def start(self, prompt_ids, policy, sampling=None, seed=None, repeats: int = 1, rng=None):
        return BatchedSession(
            self.batcher,
            self.pair,
            prompt_ids,
            policy,
            sampling or SamplingConfig(),
            seed,
            repeats,
            rng,
            self.limits,
        )

    def generate_many(
        self,
        prompts: list[list[int]],
        make_policy: Callable[[], object] | None,
        max_new_tokens: int = 64,
        sampling: SamplingConfig | None = None,
        seeds: list[int] | None = None,
        max_batch: int = 16,
        stop_at_eos: bool = True,
        policies: Sequence[object] | None = None,
    ) -> list[Generation]:
        """Decode every prompt, ``max_batch`` at a time (a new one joins as one ends): the
        generations in prompt order. An exception in any generation is raised here. Each
        generation's policy is a new ``make_policy()``, or ``policies[i]`` for prompt i
        (one policy object per prompt: a batch mixing policies or knobs)."""
        if policies is not None:
            # A policy keeps per-generation state (reset, update): never one for two prompts.
            if len(policies) != len(prompts) or len({id(p) for p in policies}) < len(policies):
                raise ValueError("policies: one policy object of its own per prompt")
            policy_for = policies.__getitem__
        elif make_policy is not None:
            policy_for = lambda i: make_policy()  # noqa: E731
        else:
            raise ValueError("give make_policy or policies")
        seeds = seeds if seeds is not None else list(range(len(prompts)))
        results: list[Generation | BaseException | None] = [None] * len(prompts)
        slots = threading.Semaphore(max_batch)
        done = threading.Event()
        remaining = [len(prompts)]
        lock = threading.Lock()

        def one(i: int) -> None:
            try:
                with self.batcher.participant():
                    stream = self.stream(
                        prompts[i],
                        policy_for(i),
                        max_new_tokens,
                        sampling,
                        seeds[i],
                        None,
                        stop_at_eos,
                    )
                    results[i] = stream.run()
            except BaseException as exc:
                results[i] = exc
            finally:
                slots.release()
                with lock:
                    remaining[0] -= 1
                    if not remaining[0]:
                        done.set()

        def admit() -> None:
            for i in range(len(prompts)):
                slots.acquire()
                threading.Thread(target=one, args=(i,), daemon=True).start()

        if not prompts:
            return []
        threading.Thread(target=admit, daemon=True).start()
        while not done.is_set():
            self.batcher.run_once()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results  # type: ignore[return-value]
