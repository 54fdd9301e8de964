"""Online benchmark (jobs.bench_online): every policy and transformers' assisted generation on
the same prompts and models in one run, set against our own `ar` at the same temperature and
against the oracle's bound on the text `ar` generated; the printed table and the metric names."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.bench.online_bound import SequenceBound, replay, sequence_bounds
from pipeline.cost.model import CostModel
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.artifacts import PolicyArtifacts
from pipeline.decode.policies.registry import make_policy
from pipeline.decode.policies.replay import ReplayPolicy
from pipeline.decode.types import SamplingConfig
from pipeline.models.loading import ModelPair

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
# --quick: the baseline, the best fixed chain and our rule; no assisted generation.
QUICK_POLICIES: list[tuple[str, dict]] = [("ar", {}), ("fixed", {"k": 2}), ("marginal", {})]


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


def bench_policy(pair: ModelPair, prompts: list[list[int]], name: str | Callable, knobs: dict,
                 temperature: float, max_new_tokens: int,
                 artifacts: PolicyArtifacts | None = None,
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


@dataclass(frozen=True)
class OnlineBenchResult:
    rows: list[BenchRow]
    bounds: dict[float, float]  # the oracle's S per temperature
    replay_lines: list[str]  # per replayed prompt at T=0: states, agreement, measured vs model
    n_prompts: int
    max_new_tokens: int
    device: str
    lam: float  # ms/token, from the oracle's policy.json
    lmax: int
    cost_mape_pct: float | None  # the cost model's out-of-sample MAPE, if its fit recorded it

    def speedup(self, row: BenchRow) -> float:
        ar = next(r for r in self.rows if r.label == "ar" and r.temperature == row.temperature)
        return row.tokens_per_s / ar.tokens_per_s

    def metrics(self) -> dict[str, float]:
        """tok/s, speedup and fraction of the bound per row, and the bound per temperature."""
        out: dict[str, float] = {}
        for r in self.rows:
            speedup = self.speedup(r)
            key = _metric_key(r.label, r.temperature)
            out.update({f"{key}_tok_s": r.tokens_per_s, f"{key}_speedup": speedup,
                        f"{key}_of_bound": speedup / self.bounds[r.temperature]})  # fmt: skip
        out.update({f"bound_T{t:g}": s for t, s in self.bounds.items()})
        return out


def _metric_key(label: str, temperature: float) -> str:
    """An MLflow metric name (alphanumerics, _ - . only) for a row label."""
    key = re.sub(r"[^0-9A-Za-z.\-]+", "_", f"{label}_T{temperature:g}")
    return key.strip("_")


def _cost_mape_pct(cost: CostModel) -> float | None:
    """The calibration's out-of-sample MAPE pooled over draft lengths, weighted by rounds."""
    per_m = cost.meta.get("fit", {}).get("per_m", {})
    if not per_m:
        return None
    n = sum(f["n"] for f in per_m.values())
    return sum(f["n"] * f["oos_mape_pct"] for f in per_m.values()) / n


def _replay_lines(pair: ModelPair, prompts: list[list[int]], cost: CostModel,
                  by_prompt: dict[int, SequenceBound]) -> list[str]:  # fmt: skip
    """The first two prompts decoded with the oracle's k*, against its accepted a and cost."""
    lines = []
    for j, b in sorted(by_prompt.items())[:2]:
        rep = replay(pair, b, prompts[j], cost)
        same = sum(x == y for x, y in zip(rep.accepted, rep.oracle_accepted, strict=True))
        lines.append(
            f"prompt {j}: {len(rep.states)} steps, accepted = oracle's a in {same}; "
            f"measured {sum(rep.measured_ms):.1f} ms vs modelled "
            f"{sum(rep.modelled_ms):.1f} ms ({rep.relative_error:+.1%}; "
            f"{rep.relative_error_online_u:+.1%} against the same model priced with the "
            "experts the passes really used)"
        )
    return lines


def run_online_bench(
    pair: ModelPair,
    artifacts: PolicyArtifacts,
    prompts: list[list[int]],
    temperatures: list[float],
    max_new_tokens: int,
    lmax: int,
    quick: bool = False,
    progress: Callable[[str], None] = lambda line: None,
) -> OnlineBenchResult:
    """Every policy (QUICK_POLICIES with ``quick``) at every temperature, assisted generation
    unless ``quick``, the oracle's bound on `ar`'s text (exact-greedy acceptance at T=0, the
    surrogate otherwise) and, at T=0, the oracle's k* decoded online. ``progress`` gets a line
    before each policy runs."""
    policies = QUICK_POLICIES if quick else DEFAULT_POLICIES + COST_AWARE_POLICIES
    rows: list[BenchRow] = []
    bounds: dict[float, float] = {}
    replay_lines: list[str] = []
    for temp in temperatures:
        bench_policy(pair, prompts[:1], "fixed", {"k": 2}, temp, 8)  # warm-up
        for name, knobs in policies:
            progress(f"T={temp:g} {name} {knobs or ''}")
            rows.append(bench_policy(pair, prompts, name, knobs, temp, max_new_tokens,
                                     artifacts))  # fmt: skip
        if not quick:
            rows.append(bench_assisted(pair, prompts, temp, max_new_tokens))
        ar_row = next(r for r in rows if r.label == "ar" and r.temperature == temp)
        acceptance = "greedy" if temp == 0 else "surrogate"
        bound = sequence_bounds(pair, prompts, ar_row.outputs, artifacts.cost, lmax, acceptance)
        bounds[temp] = bound.speedup
        if temp == 0:
            # The oracle's own decisions, decoded online: S realised, and the cost model's error.
            by_prompt = {int(b.seq.seq_id.split("-")[1]): b for b in bound.sequences}

            def replay_policy(j: int, by_prompt=by_prompt) -> ReplayPolicy:
                return ReplayPolicy(by_prompt[j].solution.k_star, len(prompts[j]))

            rows.append(bench_policy(pair, prompts, replay_policy, {}, temp, max_new_tokens,
                                     label="oracle-replay (k*)"))  # fmt: skip
            replay_lines += _replay_lines(pair, prompts, artifacts.cost, by_prompt)
    return OnlineBenchResult(rows, bounds, replay_lines, len(prompts), max_new_tokens,
                             str(pair.device), artifacts.lam, lmax,
                             _cost_mape_pct(artifacts.cost))  # fmt: skip


def format_online_bench(result: OnlineBenchResult) -> str:
    """The table: one row per policy and temperature, then the bounds, replay and model error."""
    lines = ["", f"{result.n_prompts} prompts x {result.max_new_tokens} tokens on {result.device}; "
             f"lambda {result.lam:.3f} ms/token", ""]  # fmt: skip
    lines.append(f"{'policy':<42}{'T':>4}{'tok/s':>9}{'speedup':>9}{'of bound':>10}"
                 f"{'accepted':>10}{'U/verify':>10}{'T_verify':>10}")  # fmt: skip
    for r in result.rows:
        speedup = result.speedup(r)
        lines.append(f"{r.label:<42}{r.temperature:>4g}{r.tokens_per_s:>9.1f}{speedup:>8.2f}x"
                     f"{speedup / result.bounds[r.temperature]:>10.0%}{r.mean_accepted:>10.2f}"
                     f"{r.mean_unique_experts:>10.2f}{r.verify_share:>9.0%}")  # fmt: skip
    for temp, s in result.bounds.items():
        kind = "exact-greedy" if temp == 0 else "surrogate"
        lines.append(f"oracle bound S at T={temp:g} ({kind} acceptance, Lmax {result.lmax}, the "
                     f"cost model's prices): {s:.3f}x")  # fmt: skip
    lines += [f"oracle replay, {line}" for line in result.replay_lines]
    if result.cost_mape_pct is not None:
        lines.append(f"cost model error: out-of-sample MAPE {result.cost_mape_pct:.1f}% over the "
                     "calibration's rounds")  # fmt: skip
    return "\n".join(lines)
