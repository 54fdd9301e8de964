"""Online benchmark: every policy and transformers' assisted generation on the same prompts and
models, in one run; speedups are against our own `ar` policy at the same temperature."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.engine import SamplingConfig, SpeculativeEngine
from pipeline.models import ModelPair
from pipeline.policies import make_policy

DEFAULT_POLICIES: list[tuple[str, dict]] = [
    ("ar", {}),
    ("fixed", {"k": 1}),
    ("fixed", {"k": 2}),
    ("fixed", {"k": 4}),
    ("heuristic", {}),
    ("confidence", {"threshold": 0.5, "max_k": 8}),
    ("tree", {"depth": 3, "branch": 2, "gamma": 6}),
]
# EcoSpec's operating point (3 draft steps, top-2, gamma 4) next to `tree` at the same gamma,
# and our marginal rule (lambda from the oracle's policy.json).
COST_AWARE_POLICIES: list[tuple[str, dict]] = [
    ("tree", {"depth": 3, "branch": 2, "gamma": 4}),
    ("ecospec", {"depth": 3, "branch": 2, "gamma": 4}),
    ("ecospec-global", {"depth": 3, "branch": 2, "gamma": 4}),
    ("marginal", {}),
    ("marginal", {"calibrate": True}),
]


@dataclass(frozen=True)
class BenchRow:
    label: str
    temperature: float
    tokens: int
    seconds: float
    mean_accepted: float
    mean_unique_experts: float
    verify_share: float
    outputs: list[list[int]] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _label(name: str, knobs: dict) -> str:
    return name + ("(" + ",".join(f"{k}={v}" for k, v in knobs.items()) + ")" if knobs else "")


def bench_policy(pair: ModelPair, prompts: list[list[int]], name: str, knobs: dict,
                 temperature: float, max_new_tokens: int, artifacts=None,
                 label: str | None = None) -> BenchRow:  # fmt: skip
    """``name`` is a policy name, or a callable giving the policy for prompt j."""
    engine = SpeculativeEngine(pair)
    sampling = SamplingConfig(temperature=temperature)
    tokens = 0
    steps = []
    outputs = []
    started = time.perf_counter()
    for seed, ids in enumerate(prompts):
        policy = name(seed) if callable(name) else make_policy(name, artifacts, **knobs)
        gen = engine.generate(ids, policy, max_new_tokens, sampling, seed=seed,
                              stop_at_eos=False)  # fmt: skip
        tokens += len(gen.tokens)
        steps.extend(gen.steps)
        outputs.append(gen.tokens)
    seconds = time.perf_counter() - started
    return BenchRow(
        label=label or _label(name, knobs),
        temperature=temperature,
        tokens=tokens,
        seconds=seconds,
        mean_accepted=float(np.mean([s.accepted for s in steps])),
        mean_unique_experts=float(np.mean([s.u_bar for s in steps])),
        verify_share=sum(s.t_verify_ms for s in steps) / 1e3 / seconds,
        outputs=outputs,
    )


@torch.no_grad()
def bench_assisted(pair: ModelPair, prompts: list[list[int]], temperature: float,
                   max_new_tokens: int) -> BenchRow:  # fmt: skip
    """transformers' generate(assistant_model=draft), same prompts and token budget."""
    tokens = 0
    started = time.perf_counter()
    for seed, ids in enumerate(prompts):
        torch.manual_seed(seed)
        kwargs = {"do_sample": temperature > 0}
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        out = pair.target.generate(
            torch.tensor([ids], device=pair.device), assistant_model=pair.draft,
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            pad_token_id=pair.tokenizer.eos_token_id, **kwargs,
        )  # fmt: skip
        tokens += out.shape[1] - len(ids)
    seconds = time.perf_counter() - started
    return BenchRow("transformers assisted", temperature, tokens, seconds, float("nan"),
                    float("nan"), float("nan"))  # fmt: skip
