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

from collections.abc import Callable
from functools import partial

from pipeline.bench.decoding import bench_assisted, bench_policies, bench_policy
from pipeline.bench.guard import PolicyFailure, require_priced
from pipeline.bench.online_bound import (
    BoundResult,
    SequenceBound,
    modelled_generation,
    replay,
    sequence_bounds,
)
from pipeline.bench.rows import BenchRow
from pipeline.bench.scoring import REPLAY_LABEL, OnlineBenchResult
from pipeline.cost.model import CostModel
from pipeline.decode.policies.artifacts import PolicyArtifacts
from pipeline.decode.policies.registry import POLICIES
from pipeline.decode.policies.replay import ReplayPolicy
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
    row.side_ms = side_times(row, prompts, artifacts.cost)


def side_times(
    row: BenchRow, prompts: list[list[int]], cost: CostModel
) -> tuple[float, float, float, float]:
    """The row's steps per side, measured and priced in its decoding mode (what the policies
    decided with): draft measured, draft priced, target measured, target priced. The target
    side holds the acceptance walk where the cost model prices it (a calibrated mode)."""
    mode = cost.for_sampling(row.temperature)
    walk = "priced_mode" in mode.meta
    sums = [0.0, 0.0, 0.0, 0.0]
    for prompt, steps in zip(prompts, row.steps, strict=True):
        done = 0
        for rec in steps:
            sums[0] += rec.t_draft_ms
            sums[1] += mode.t_draft(rec.draft_forwards)
            sums[2] += rec.t_verify_ms + (rec.t_accept_ms if walk else 0.0)
            sums[3] += mode.t_target(rec.verified, rec.u_bar, len(prompt) + done)
            done += rec.new_tokens
    return sums[0], sums[1], sums[2], sums[3]


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
    record: Callable[[dict], None] = lambda result: None,
    first_seed: int = 0,
    bounds: dict[tuple, BoundResult] | None = None,
) -> OnlineBenchResult:
    """Every policy (QUICK_POLICIES with ``quick``, or ``policies``: (name, knobs) pairs, `ar`
    put first) at every temperature, assisted generation unless ``quick`` (or as ``assisted``
    says); each chain policy's text bounded by the oracle (matched acceptance, the same cost
    model; texts shared between policies are solved once) and, at T = 0, the oracle's k*
    decoded online (``bound=False`` leaves the oracle out: measured figures only; a list of
    temperatures solves it only at those).
    ``progress`` gets a line before each policy runs; ``record`` each row's figures (or its
    failure) the moment it is scored; prompt j decodes with seed ``first_seed + j``. ``bounds``:
    solved bounds by temperature, prompts and text, shared by the calls given the same dict
    (with the same cost model and Lmax: a repeated run's T = 0 texts are the same, and each is
    solved once). Before
    anything decodes, every policy must build and the cost model must price every step it may
    take (pipeline.bench.guard). A row whose scoring fails is left out and listed in the
    result's failures; `ar`'s fails the bench."""
    if policies is None:
        policies = QUICK_POLICIES if quick else DEFAULT_POLICIES + COST_AWARE_POLICIES
    if assisted is None:
        assisted = not quick and not pair.draft_is_head  # transformers knows no EAGLE head
    unknown = {name for name, _ in policies} - POLICIES.keys()
    if unknown:
        raise ValueError(f"unknown policies {sorted(unknown)}; choose among {sorted(POLICIES)}")
    if policies[0][0] != "ar":
        policies = [("ar", {}), *[p for p in policies if p[0] != "ar"]]  # the baseline first
    # Every policy builds (its artifacts exist) and is priced at its largest step, before any
    # decodes: the chain bound and the replay need m up to lmax + 1.
    require_priced("bench_online", artifacts.cost, policies, artifacts)
    if bound is True or (bound and set(bound) & set(temperatures)):
        artifacts.cost.require_m(range(1, lmax + 2), f"the bound at Lmax {lmax}")
    rows: list[BenchRow] = []
    lines: list[str] = []
    failures: list[PolicyFailure] = []
    bounds = {} if bounds is None else bounds
    prompts_key = tuple(map(tuple, prompts))

    def bound_of(row: BenchRow, temp: float) -> BoundResult:
        key = (temp, prompts_key, tuple(map(tuple, row.outputs)))
        if key not in bounds:
            progress(f"T={temp:g} {row.label}: the oracle on its text")
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

    def keep(row_label: str, temp: float, work: Callable[[], BenchRow]) -> None:
        """The row ``work`` scores (or runs and scores), kept and recorded at once; if it
        fails, the failure instead, and the bench goes on (not for `ar`: every other row is
        scored against it)."""
        try:
            row = work()
        except Exception as exc:
            if row_label == "ar":
                raise
            failure = PolicyFailure.of(row_label, f"T={temp:g}", exc)
            failures.append(failure)
            progress(failure.line())
            record(failure.record())
            return
        rows.append(row)
        record(row.record())

    def scored(row: BenchRow, temp: float, bounded: bool) -> BenchRow:
        _price(row, pair, prompts, artifacts)
        if bounded and not row.tree:
            row.bound = bound_of(row, temp)
        return row

    for temp in temperatures:
        bounded = bound if isinstance(bound, bool) else temp in bound
        bench_policy(pair, prompts[:1], "fixed", {"k": 2}, temp, 8)  # warm-up
        progress(f"T={temp:g}: {len(policies)} policies, interleaved prompt by prompt")
        specs = [(name, knobs, None) for name, knobs in policies]
        decoded = bench_policies(
            pair, prompts, specs, temp, max_new_tokens, artifacts, progress, first_seed
        )
        for row in decoded:
            keep(row.label, temp, partial(scored, row, temp, bounded))
        if assisted:
            keep(
                "transformers assisted",
                temp,
                partial(bench_assisted, pair, prompts, temp, max_new_tokens, first_seed),
            )
        if temp == 0 and bounded:
            progress("T=0 oracle-replay (k*)")
            keep(
                REPLAY_LABEL,
                temp,
                partial(_replay_row, pair, prompts, max_new_tokens, artifacts, rows, lines),
            )
    return OnlineBenchResult(
        rows,
        lines,
        len(prompts),
        max_new_tokens,
        str(pair.device),
        artifacts.lam,
        lmax,
        artifacts.cost,
        failures,
    )


def _replay_row(
    pair: ModelPair,
    prompts: list[list[int]],
    max_new_tokens: int,
    artifacts: PolicyArtifacts,
    rows: list[BenchRow],
    lines: list[str],
) -> BenchRow:
    """The oracle's own decisions on `ar`'s greedy text (its bound, solved already), decoded
    online and priced; its agreement with the oracle goes to ``lines``."""
    ar_row = next(r for r in rows if r.label == "ar" and r.temperature == 0)
    greedy = ar_row.bound
    assert greedy is not None, "the replay follows the bound on `ar`'s greedy text"
    by_prompt = {int(b.seq.seq_id.split("-")[1]): b for b in greedy.sequences}

    def replay_policy(j: int) -> ReplayPolicy:
        return ReplayPolicy(by_prompt[j].solution.k_star, len(prompts[j]))

    row = bench_policy(pair, prompts, replay_policy, {}, 0.0, max_new_tokens, label=REPLAY_LABEL)
    _price(row, pair, prompts, artifacts)
    row.bound = greedy
    lines += replay_lines(pair, prompts, artifacts.cost, by_prompt)
    return row
