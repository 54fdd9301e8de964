"""Online benchmark (jobs.bench_online): every policy and transformers' assisted generation on
the same prompts and models in one run, each scored like for like (pipeline.bench.scoring):

* measured / measured: decoding time with the prompt's prefill left out, against our own `ar`
  at the same temperature and, at T = 0, against the oracle's k* decoded online (the replay);
* modelled / modelled: every step priced with the cost model (T_D of the draft forwards it ran
  + T_T(m, U, L) with the experts it verified), against the AR price of the same text and the
  oracle's bound on that same text (matched acceptance: greedy at T = 0, speculative sampling
  otherwise; k = 0 allowed). Tree policies are not scored against the chain bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.bench.online_bound import (
    BoundResult,
    SequenceBound,
    modelled_generation,
    replay,
    sequence_bounds,
)
from pipeline.bench.scoring import OnlineBenchResult
from pipeline.cost.model import CostModel
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.artifacts import PolicyArtifacts
from pipeline.decode.policies.registry import POLICIES, make_policy
from pipeline.decode.policies.replay import ReplayPolicy
from pipeline.decode.types import SamplingConfig, StepRecord
from pipeline.models.loading import ModelPair

FIXED_KS = (1, 2, 3, 4, 5, 6, 8)  # every K that can be best here: the best fixed K is picked
DEFAULT_POLICIES: list[tuple[str, dict]] = [
    ("ar", {}),
    *[("fixed", {"k": k}) for k in FIXED_KS],
    ("heuristic", {"max_k": 12}),  # m <= 13: what the committed cost model covers
    ("confidence", {"threshold": 0.5, "max_k": 8}),
    ("tree", {"depth": 3, "branch": 2, "gamma": 7}),
]
# EcoSpec's operating point (3 draft steps, top-2, gamma 4 verified positions) next to `tree`
# at the same gamma, our marginal rule (lambda from the oracle's policy.json) and Cascade.
COST_AWARE_POLICIES: list[tuple[str, dict]] = [
    ("tree", {"depth": 3, "branch": 2, "gamma": 4}),
    ("ecospec", {"depth": 3, "branch": 2, "gamma": 4}),
    ("ecospec-global", {"depth": 3, "branch": 2, "gamma": 4}),
    ("marginal", {}),
    ("marginal", {"calibrate": True}),
    ("cascade", {}),
    ("adaedl", {}),
    ("specdec", {}),
    ("throughput", {}),
]
# --quick: the baseline, the fixed chains and our policy; no assisted generation.
QUICK_POLICIES: list[tuple[str, dict]] = [
    ("ar", {}),
    *[("fixed", {"k": k}) for k in (1, 2, 3, 4)],
    ("throughput", {}),
]
TREE_POLICIES = frozenset({"tree", "ecospec", "ecospec-global"})


@dataclass
class BenchRow:
    label: str
    temperature: float
    tokens: int
    seconds: float  # decoding steps only: the prompt's prefill is left out
    mean_accepted: float
    mean_unique_experts: float
    verify_share: float
    tree: bool = False
    outputs: list[list[int]] = field(default_factory=list)
    steps: list[list[StepRecord]] = field(default_factory=list)
    policy_ms: float | None = None  # the cost model's price of every step
    ar_ms: float | None = None  # the AR price of the same text
    bound: BoundResult | None = None  # the oracle on the same text (chain policies)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def modelled_speedup(self) -> float | None:
        return None if self.policy_ms is None else self.ar_ms / self.policy_ms


def _label(name: str, knobs: dict) -> str:
    return name + ("(" + ",".join(f"{k}={v}" for k, v in knobs.items()) + ")" if knobs else "")


def bench_policy(
    pair: ModelPair,
    prompts: list[list[int]],
    name: str | Callable,
    knobs: dict,
    temperature: float,
    max_new_tokens: int,
    artifacts: PolicyArtifacts | None = None,
    label: str | None = None,
) -> BenchRow:
    """``name`` is a policy name, or a callable giving the policy for prompt j. Timed: the
    decoding steps (a session's start, the prompt's prefill, is not)."""
    return bench_policies(
        pair, prompts, [(name, knobs, label)], temperature, max_new_tokens, artifacts
    )[0]


def bench_policies(
    pair: ModelPair,
    prompts: list[list[int]],
    specs: list[tuple[str | Callable, dict, str | None]],
    temperature: float,
    max_new_tokens: int,
    artifacts: PolicyArtifacts | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> list[BenchRow]:
    """bench_policy for each (name, knobs, label) in ``specs``, interleaved: every policy
    decodes prompt j before any decodes prompt j + 1, in an order that rotates with j. A
    machine whose speed drifts during the run (a shared CPU drifts by tens of percent within
    minutes) then slows every policy alike, instead of whichever ran in the slow minutes."""
    engine = SpeculativeEngine(pair)
    sampling = SamplingConfig(temperature=temperature)
    seconds = [0.0] * len(specs)
    outputs: list[list[list[int]]] = [[] for _ in specs]
    steps: list[list[list[StepRecord]]] = [[] for _ in specs]
    for seed, ids in enumerate(prompts):
        progress(f"T={temperature:g} prompt {seed + 1}/{len(prompts)}")
        for turn in range(len(specs)):
            i = (turn + seed) % len(specs)
            name, knobs, _ = specs[i]
            policy = name(seed) if callable(name) else make_policy(name, artifacts, **knobs)
            session = engine.start(ids, policy, sampling, seed=seed)
            started = time.perf_counter()
            while len(session.generated) < max_new_tokens:
                session.step()
            seconds[i] += time.perf_counter() - started
            outputs[i].append(list(session.generated))  # a last step may overshoot: paid for
            steps[i].append(list(session.steps))
    return [
        _row(name, knobs, label, temperature, seconds[i], outputs[i], steps[i])
        for i, (name, knobs, label) in enumerate(specs)
    ]


def _row(
    name: str | Callable,
    knobs: dict,
    label: str | None,
    temperature: float,
    seconds: float,
    outputs: list[list[int]],
    steps: list[list[StepRecord]],
) -> BenchRow:
    flat = [s for run in steps for s in run]
    return BenchRow(
        label=label or _label(name, knobs),
        temperature=temperature,
        tokens=sum(len(o) for o in outputs),
        seconds=seconds,
        mean_accepted=float(np.mean([s.accepted for s in flat])),
        mean_unique_experts=float(np.mean([s.u_bar for s in flat])),
        verify_share=sum(s.t_verify_ms for s in flat) / 1e3 / seconds,
        tree=not callable(name) and name in TREE_POLICIES,
        outputs=outputs,
        steps=steps,
    )


@torch.no_grad()
def bench_assisted(
    pair: ModelPair, prompts: list[list[int]], temperature: float, max_new_tokens: int
) -> BenchRow:
    """transformers' generate(assistant_model=draft), same prompts and token budget. Its time
    includes both prefills, measured apart (a target and a draft forward over the prompt) and
    subtracted, so it is comparable with the engine's step times."""
    tokens, seconds, outputs = 0, 0.0, []
    for seed, ids in enumerate(prompts):
        torch.manual_seed(seed)
        kwargs = {"do_sample": temperature > 0}
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        x = torch.tensor([ids], device=pair.device)
        started = time.perf_counter()
        pair.target(x)
        pair.draft(x)
        prefill = time.perf_counter() - started
        started = time.perf_counter()
        out = pair.target.generate(
            x,
            assistant_model=pair.draft,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=pair.tokenizer.eos_token_id,
            **kwargs,
        )
        seconds += max(1e-9, time.perf_counter() - started - prefill)
        tokens += out.shape[1] - len(ids)
        outputs.append(out[0, len(ids) :].tolist())
    return BenchRow(
        "transformers assisted",
        temperature,
        tokens,
        seconds,
        float("nan"),
        float("nan"),
        float("nan"),
        outputs=outputs,
    )


def replay_lines(
    pair: ModelPair, prompts: list[list[int]], cost: CostModel, by_prompt: dict[int, SequenceBound]
) -> list[str]:
    """The first two prompts decoded with the oracle's k*, against its accepted a, its U and
    its modelled cost."""
    lines = []
    for j, b in sorted(by_prompt.items())[:2]:
        rep = replay(pair, b, prompts[j], cost)
        same_a = sum(x == y for x, y in zip(rep.accepted, rep.oracle_accepted, strict=True))
        same_u = sum(abs(x - y) < 1e-9 for x, y in zip(rep.online_u, rep.oracle_u, strict=True))
        lines.append(
            f"prompt {j}: {len(rep.states)} steps, accepted = oracle's a in {same_a}, verified "
            f"experts = oracle's U in {same_u}; measured {sum(rep.measured_ms):.1f} ms vs "
            f"modelled {sum(rep.modelled_ms):.1f} ms ({rep.relative_error:+.1%})"
        )
    return lines


def _price(
    row: BenchRow, pair: ModelPair, prompts: list[list[int]], artifacts: PolicyArtifacts
) -> None:
    """The row's own steps and text priced with the cost model."""
    try:
        runs = [
            modelled_generation(pair, p, out, st, artifacts.cost)
            for p, out, st in zip(prompts, row.outputs, row.steps, strict=True)
        ]
    except KeyError as exc:  # a step verified more positions than the model was calibrated for
        raise ValueError(
            f"{row.label}: {exc.args[0]}; bound the policy's knobs to the cost "
            "model's m or calibrate larger K"
        ) from None
    row.policy_ms = sum(r.policy_ms for r in runs)
    row.ar_ms = sum(r.ar_ms for r in runs)


def run_online_bench(
    pair: ModelPair,
    artifacts: PolicyArtifacts,
    prompts: list[list[int]],
    temperatures: list[float],
    max_new_tokens: int,
    lmax: int,
    quick: bool = False,
    progress: Callable[[str], None] = lambda line: None,
    policies: list[tuple[str, dict]] | None = None,
    assisted: bool | None = None,
    bound: bool | list[float] = True,
) -> OnlineBenchResult:
    """Every policy (QUICK_POLICIES with ``quick``, or ``policies``: (name, knobs) pairs, `ar`
    put first) at every temperature, assisted generation unless ``quick`` (or as ``assisted``
    says); each chain policy's text bounded by the oracle (matched acceptance, the same cost
    model; texts shared between policies are solved once) and, at T = 0, the oracle's k*
    decoded online (``bound=False`` leaves the oracle out: measured figures only; a list of
    temperatures solves it only at those).
    ``progress`` gets a line before each policy runs."""
    if policies is None:
        policies = QUICK_POLICIES if quick else DEFAULT_POLICIES + COST_AWARE_POLICIES
    if assisted is None:
        assisted = not quick
    unknown = {name for name, _ in policies} - POLICIES.keys()
    if unknown:
        raise ValueError(f"unknown policies {sorted(unknown)}; choose among {sorted(POLICIES)}")
    for name, knobs in policies:  # every policy builds (its artifacts exist) before any runs
        make_policy(name, artifacts, **knobs)
    if policies[0][0] != "ar":
        policies = [("ar", {}), *[p for p in policies if p[0] != "ar"]]  # the baseline first
    rows: list[BenchRow] = []
    lines: list[str] = []
    bounds: dict[tuple, BoundResult] = {}

    def bound_of(row: BenchRow, temp: float) -> BoundResult:
        key = (temp, tuple(map(tuple, row.outputs)))
        if key not in bounds:
            acceptance = "greedy" if temp == 0 else "sampling"
            bounds[key] = sequence_bounds(
                pair,
                prompts,
                row.outputs,
                artifacts.cost,
                lmax,
                acceptance,
                temperature=temp or 1.0,
            )
        return bounds[key]

    for temp in temperatures:
        bounded = bound if isinstance(bound, bool) else temp in bound
        bench_policy(pair, prompts[:1], "fixed", {"k": 2}, temp, 8)  # warm-up
        progress(f"T={temp:g}: {len(policies)} policies, interleaved prompt by prompt")
        specs = [(name, knobs, None) for name, knobs in policies]
        for row in bench_policies(pair, prompts, specs, temp, max_new_tokens, artifacts, progress):
            _price(row, pair, prompts, artifacts)
            if bounded and not row.tree:
                progress(f"T={temp:g} {row.label}: the oracle on its text")
                row.bound = bound_of(row, temp)
            rows.append(row)
        if assisted:
            rows.append(bench_assisted(pair, prompts, temp, max_new_tokens))
        if temp == 0 and bounded:
            # The oracle's own decisions on the greedy text, decoded online.
            ar_row = next(r for r in rows if r.label == "ar" and r.temperature == 0)
            greedy = bound_of(ar_row, 0.0)
            by_prompt = {int(b.seq.seq_id.split("-")[1]): b for b in greedy.sequences}

            def replay_policy(j: int, by_prompt=by_prompt) -> ReplayPolicy:
                return ReplayPolicy(by_prompt[j].solution.k_star, len(prompts[j]))

            progress("T=0 oracle-replay (k*)")
            row = bench_policy(
                pair, prompts, replay_policy, {}, temp, max_new_tokens, label="oracle-replay (k*)"
            )
            _price(row, pair, prompts, artifacts)
            row.bound = greedy
            rows.append(row)
            lines += replay_lines(pair, prompts, artifacts.cost, by_prompt)
    return OnlineBenchResult(
        rows,
        lines,
        len(prompts),
        max_new_tokens,
        str(pair.device),
        artifacts.lam,
        lmax,
        artifacts.cost,
    )
