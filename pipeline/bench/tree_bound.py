"""The tree-bound benchmark (jobs.bench_tree): on the same prompts, in one run, the
chain bound and each selection rule's tree bound per budget, and the fraction of its rule's
bound each tree policy captures.

At T = 0: `ar` and the policies decode every prompt interleaved (pipeline.bench.decoding), for
``repeats`` rounds; `ar`'s text is the reference the bounds are solved on (every lossless
policy produces the same text). Each tree policy is matched with the rule it follows (`tree`:
eagle2, `ecospec`: ecospec, with its branch and depth) and scored three ways:

* modelled: its own steps priced with the cost model (T_D of its draft forwards + T_T of the
  positions and experts it verified) against the AR price of the same text;
* offline: the rule at the policy's fixed gamma priced from the ``trees`` rows (what the
  extraction says the policy costs: it should equal the modelled figure);
* measured: decoding time of `ar` over its own, the prompts' prefill left out.

Fractions divide by the rule's bound with budgets up to the study's largest. Before decoding,
the cost model must price every step each policy may take (m up to its gamma); a policy whose
scoring fails is left out and listed in ``failures``, the others scored and recorded.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow.compute as pc

from pipeline.bench.decoding import bench_policies
from pipeline.bench.guard import PolicyFailure, failure_lines, require_priced
from pipeline.bench.online_bound import modelled_generation
from pipeline.bench.rows import BenchRow
from pipeline.cost.model import CostModel
from pipeline.data.references import ReferenceSequence
from pipeline.decode.policies.artifacts import PolicyArtifacts
from pipeline.decode.policies.registry import policy_class
from pipeline.extract.draft_trees import TreeRule
from pipeline.extract.rows import extract_sequence
from pipeline.extract.teacher_forced import teacher_forced
from pipeline.extract.tree_rows import tree_rows
from pipeline.models.loading import ModelPair
from pipeline.oracle.inputs import inputs_from_tables
from pipeline.oracle.tree_bound import fixed_budgets_ms, solve_tree, tree_input, tree_tables
from pipeline.oracle.tree_study import DEFAULT_BUDGETS, format_tree_study, pool, sequence_rows

SELECTION_OF = {"tree": "eagle2", "ecospec": "ecospec"}  # the policy -> the rule it follows
DEFAULT_TREE_POLICIES: list[tuple[str, dict]] = [
    ("tree", {"depth": 4, "branch": 2, "gamma": 9}),  # the registry's default
    ("tree", {"depth": 3, "branch": 2, "gamma": 4}),  # EcoSpec's operating point
    ("ecospec", {"depth": 3, "branch": 2, "gamma": 4}),
]
DEFAULT_RULES = ("eagle2", "ecospec")  # the per-budget study's rules (branch 2, no depth cap)


def with_defaults(name: str, knobs: dict) -> dict:
    """A tree policy's knobs, the unset ones at the policy's defaults."""
    if name not in SELECTION_OF:
        raise ValueError(f"{name} is not a tree policy ({', '.join(SELECTION_OF)})")
    return {k.name: k.default for k in policy_class(name).knobs} | knobs


def policy_rule(name: str, knobs: dict) -> TreeRule:
    """The selection rule a tree policy follows, with its branch and depth."""
    full = with_defaults(name, knobs)
    return TreeRule(SELECTION_OF[name], full["branch"], full["depth"])


@dataclass
class PolicyScore:
    label: str
    rule: str
    gamma: int
    measured: list[float] = field(default_factory=list)  # speedup over `ar`, per repeat
    modelled: float = 0.0
    offline_fixed: float = 0.0
    bound: float = 0.0  # the rule's bound, gamma <= the study's largest budget + 1
    bound_own: float = 0.0  # the rule's bound, gamma <= the policy's gamma

    @property
    def of_bound_modelled(self) -> float:
        return self.modelled / self.bound

    @property
    def of_bound_measured(self) -> float:
        return float(np.mean(self.measured)) / self.bound


@dataclass
class TreeBench:
    budgets: pd.DataFrame  # tree_study.pool's table
    policies: list[PolicyScore]
    reference_tokens: int
    tree_nodes: int
    tree_target_forwards: int  # off-path nodes routed, over every rule
    tree_draft_forwards: int
    tree_seconds: float
    off_path: dict[str, int] = field(default_factory=dict)  # per rule: its off-path nodes
    failures: list[PolicyFailure] = field(default_factory=list)  # policies left out: why

    @property
    def target_forwards_per_token(self) -> float:
        return self.tree_target_forwards / self.reference_tokens


def run_tree_bench(
    pair: ModelPair,
    artifacts: PolicyArtifacts,
    prompts: list[list[int]],
    max_new_tokens: int,
    policies: list[tuple[str, dict]] = DEFAULT_TREE_POLICIES,
    rules: tuple[str, ...] = DEFAULT_RULES,
    budgets: tuple[int, ...] = DEFAULT_BUDGETS,
    repeats: int = 3,
    progress: Callable[[str], None] = print,
    record: Callable[[dict], None] = lambda result: None,
) -> TreeBench:
    """``record`` gets each policy's score (or failure) the moment it is done."""
    k_max = max(budgets)
    cost = artifacts.cost.require_m(range(1, k_max + 2), f"the tree bench at budget {k_max}")
    require_priced("bench_tree", cost, [("ar", {}), *policies], artifacts)
    own = [policy_rule(n, k) for n, k in policies]
    study = [TreeRule.parse(r) for r in rules]
    all_rules = list({r.name: r for r in [*study, *own]}.values())
    specs = [("ar", {}, None), *[(n, k, None) for n, k in policies]]
    seconds = np.zeros((repeats, len(specs)))
    runs = []
    for rep in range(repeats):
        progress(f"[bench_tree] decoding, repeat {rep + 1}/{repeats}")
        rows = bench_policies(pair, prompts, specs, 0.0, max_new_tokens, artifacts)
        seconds[rep] = [r.seconds for r in rows]
        runs.append(rows)
    first = runs[0]
    progress("[bench_tree] extracting trees and greedy tails on ar's text")
    seq_rows, tins, refs = [], {}, []
    nodes = target_fw = draft_fw = 0
    off_path: dict[str, int] = {}
    tree_s = 0.0
    for j, (prompt, out) in enumerate(zip(prompts, first[0].outputs, strict=True)):
        ref = ReferenceSequence(f"gen-{j}", "generated", "generated", tuple(prompt), tuple(out))
        forced = teacher_forced(pair, ref)
        chain = extract_sequence(
            pair, ref, k_max, "shared", 0, acceptances=("greedy",), draws=1, forced=forced
        )
        started = time.perf_counter()
        table, stats = tree_rows(pair, ref, forced, all_rules, k_max, artifacts.predictor)
        tree_s += time.perf_counter() - started
        nodes += stats.nodes
        for rule, count in Counter(
            table.filter(pc.invert(table.column("on_path"))).column("rule").to_pylist()
        ).items():
            off_path[rule] = off_path.get(rule, 0) + count
        target_fw += stats.target_token_forwards
        draft_fw += stats.draft_token_forwards
        seq = inputs_from_tables(
            chain.sequences, chain.tokens, chain.tails, pair.spec, k_max, ["greedy"]
        )[0]
        for rule in all_rules:
            tins[(j, rule.name)] = tree_input(
                ref.seq_id, ref.prompt_len, seq.routing, table, rule, k_max, pair.spec
            )
        seq_rows += sequence_rows(
            seq, [tins[(j, r.name)] for r in study], cost, list(budgets), k_max
        )
        refs.append(seq)
    ar_ms = sum(r["ar_ms"] for r in seq_rows if r["budget"] == k_max and r["bound"] == "chain")
    scores, failures = [], []
    for p, ((name, knobs), rule) in enumerate(zip(policies, own, strict=True), start=1):
        gamma = with_defaults(name, knobs)["gamma"]
        try:
            score = _score(pair, prompts, cost, first[p], rule, gamma, k_max, tins, ar_ms)
        except Exception as exc:  # this policy's scoring only: the others are kept
            failure = PolicyFailure.of(first[p].label, "scoring", exc)
            failures.append(failure)
            progress(f"[bench_tree] {failure.line()}")
            record(failure.record())
            continue
        score.measured = [float(seconds[r, 0] / seconds[r, p]) for r in range(repeats)]
        scores.append(score)
        record(dataclasses.asdict(score))
    n_tokens = sum(len(s.token_ids) - 1 for s in refs)
    return TreeBench(
        pool(seq_rows), scores, n_tokens, nodes, target_fw, draft_fw, tree_s, off_path, failures
    )


def _score(
    pair: ModelPair,
    prompts: list[list[int]],
    cost: CostModel,
    row: BenchRow,
    rule: TreeRule,
    gamma: int,
    k_max: int,
    tins: dict,
    ar_ms: float,
) -> PolicyScore:
    """A tree policy's modelled speedup over `ar` on its own steps, and its rule priced on
    `ar`'s text (``tins``: the tree inputs per prompt and rule; ``ar_ms``: the AR cost of that
    text): at its fixed gamma, and the bound up to the largest budget and up to its gamma."""
    priced = [
        modelled_generation(pair, pr, o, st, cost)
        for pr, o, st in zip(prompts, row.outputs, row.steps, strict=True)
    ]
    own_k = min(gamma - 1, k_max)
    bound = bound_own = fixed = 0.0
    for j in range(len(prompts)):
        tin = tins[(j, rule.name)]
        tables = tree_tables(cost, tin)
        whole, at_own = solve_tree(cost, tin, [k_max, own_k], tables)
        bound, bound_own = bound + whole.dp[0], bound_own + at_own.dp[0]
        fixed += fixed_budgets_ms(*tables, [own_k])[0]
    return PolicyScore(
        label=row.label,
        rule=rule.name,
        gamma=gamma,
        modelled=sum(x.ar_ms for x in priced) / sum(x.policy_ms for x in priced),
        offline_fixed=ar_ms / fixed,
        bound=ar_ms / bound,
        bound_own=ar_ms / bound_own,
    )


def format_tree_bench(bench: TreeBench, header: str) -> str:
    """The per-budget bounds, then each tree policy against its rule's bound."""
    lines = [
        "",
        header,
        "",
        format_tree_study(bench.budgets),
        "",
        "tree policies against their rule's bound (S over `ar`; measured: mean of the "
        "repeats, range in brackets)",
        f"{'policy':<32}{'rule':<16}{'measured':>18}{'modelled':>10}{'offline':>9}"
        f"{'bound':>8}{'bound@own':>10}{'of bound (mod.)':>16}{'(meas.)':>9}",
    ]
    for s in bench.policies:
        meas = f"{np.mean(s.measured):.3f} [{min(s.measured):.2f}-{max(s.measured):.2f}]"
        lines.append(
            f"{s.label:<32}{s.rule:<16}{meas:>18}{s.modelled:>10.3f}"
            f"{s.offline_fixed:>9.3f}{s.bound:>8.3f}{s.bound_own:>10.3f}"
            f"{s.of_bound_modelled:>16.1%}{s.of_bound_measured:>9.1%}"
        )
    lines += [
        "",
        "offline: the rule at the policy's gamma priced from the trees rows (equals "
        "modelled when the extraction prices what decoding does); bound@own: budgets up "
        "to the policy's gamma only",
        f"tree extraction: {bench.tree_nodes:,} node rows over {bench.reference_tokens:,} "
        f"reference tokens; {bench.target_forwards_per_token:.2f} target token-forwards "
        f"and {bench.tree_draft_forwards / bench.reference_tokens:.2f} draft "
        f"token-forwards per reference token; {bench.tree_seconds:.1f}s "
        f"({bench.reference_tokens / max(bench.tree_seconds, 1e-9):.0f} reference "
        "tokens/s)",
        "  off-path nodes per reference token, each rule alone (what its own extraction "
        "routes): "
        + ", ".join(f"{r} {c / bench.reference_tokens:.2f}" for r, c in bench.off_path.items()),
        *failure_lines(bench.failures),
    ]
    return "\n".join(lines)
