"""The tree bound: selection rules, the solver against brute force, the exact
reduction to the chain bound when the rule builds a chain, and the extracted trees pricing
exactly what the online tree policies verify, step by step."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pipeline.cost.model import CostModel
from pipeline.data.domains import load_prompts
from pipeline.data.prompts import encode
from pipeline.data.references import ReferenceSequence, greedy_continuation
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policies.artifacts import load_artifacts
from pipeline.decode.policies.registry import make_policy
from pipeline.extract.draft_trees import TreeRule
from pipeline.extract.rows import extract_sequence
from pipeline.extract.teacher_forced import teacher_forced
from pipeline.extract.tree_rows import tree_rows
from pipeline.models.loading import load_pair
from pipeline.oracle.bellman import solve
from pipeline.oracle.inputs import inputs_from_tables
from pipeline.oracle.tree_bound import (
    TreeInput,
    fixed_budget_ms,
    solve_either,
    solve_tree,
    tree_input,
    tree_tables,
)
from pipeline.oracle.tree_study import chain_tables

K = 3


def test_rules_parse_name_and_refuse_bad_specs():
    assert TreeRule.parse("eagle2") == TreeRule("eagle2", 2, None)
    assert TreeRule.parse("ecospec:b=3,d=4").name == "ecospec-b3-d4"
    assert TreeRule.parse("ecospec-b3-d4") == TreeRule("ecospec", 3, 4)
    assert [TreeRule("eagle2").levels(k) for k in (0, 2, 5)] == [0, 2, 5]
    assert [TreeRule("eagle2", 2, 3).levels(k) for k in (0, 2, 5)] == [0, 2, 3]
    for bad, why in [
        ("beam", "selection must be one of"),
        ("eagle2:x=3", "unknown knob"),
        ("eagle2:b=0", "must be >= 1"),
        ("", "write SELECTION"),
    ]:
        with pytest.raises(ValueError, match=why):
            TreeRule.parse(bad)


def _model(k_max: int) -> CostModel:
    ms = range(1, k_max + 2)
    return CostModel(
        {m: 3.0 + 0.2 * m for m in ms}, {m: 0.3 + 0.01 * m for m in ms}, 0.01, 0.9, 0.5
    )


def _random_input(rng: np.random.Generator, n: int, rule: TreeRule) -> TreeInput:
    accepted = np.zeros((n, K + 1), dtype=np.int64)
    for i, k in itertools.product(range(n), range(1, K + 1)):
        accepted[i, k] = rng.integers(0, min(k, n - i) + 1) if k <= n - i else 0
    union = rng.uniform(2.0, 6.0, (n, K + 1))
    verified = 1 + np.minimum(np.arange(K + 1), rng.integers(1, K + 1, (n, 1)))
    forwards = np.minimum(np.arange(K + 1)[None, :], rng.integers(1, K + 1, (n, K + 1)))
    return TreeInput("s", rule, 7, accepted, union, verified, forwards)


def _brute(tables: list[tuple[np.ndarray, np.ndarray]], n: int, cap: int) -> float:
    """Every budget schedule (and table) at every state, walked from state 0."""
    actions = [(t, k) for t in range(len(tables)) for k in range(cap + 1)]
    best = np.inf
    for schedule in itertools.product(actions, repeat=n):
        i, total = 0, 0.0
        while i < n:
            t, k = schedule[i]
            probs, cost = tables[t]
            if probs[i, k].sum() == 0:  # unavailable here
                total = np.inf
                break
            a = int(np.argmax(probs[i, k]))
            total += cost[i, k, a]
            i += a + 1
        best = min(best, total)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_the_solver_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n, model = 5, _model(K)
    tin = _random_input(rng, n, TreeRule("eagle2"))
    tables = tree_tables(model, tin)
    for cap, sol in zip((1, 2, 3), solve_tree(model, tin, [1, 2, 3]), strict=True):
        assert sol.dp[0] == pytest.approx(_brute([tables], n, cap), rel=1e-12)
        assert solve_either([tables], cap)[0] == pytest.approx(sol.dp[0], rel=1e-12)
    # A fixed budget walks its own deterministic path.
    for k in range(1, K + 1):
        i, total = 0, 0.0
        while i < n:
            kk = min(k, n - i)
            total += tables[1][i, kk, tin.accepted[i, kk]]
            i += tin.accepted[i, kk] + 1
        assert fixed_budget_ms(model, tin, k) == pytest.approx(total, rel=1e-12)
    # Either of two rules' trees at every state: the brute force over both action sets.
    other = tree_tables(model, _random_input(rng, n, TreeRule("ecospec")))
    dp0, path = solve_either([tables, other], K)
    assert dp0 == pytest.approx(_brute([tables, other], n, K), rel=1e-12)
    assert dp0 <= solve_tree(model, tin, [K])[0].dp[0] + 1e-9
    assert sum(a + 1 for _, a in path) >= n


@pytest.fixture(scope="module")
def embedded():
    """The embedded pair, its artifacts and two greedy references of 40 tokens."""
    pair = load_pair()
    artifacts = load_artifacts()
    refs = []
    for j, prompt in enumerate(load_prompts("humaneval", 2)):
        ids = encode(pair.tokenizer, prompt.text)
        out = greedy_continuation(pair.target, ids, 40, None)
        refs.append(ReferenceSequence(f"seq-{j}", "test", "greedy", tuple(ids), tuple(out)))
    return pair, artifacts, refs


@pytest.mark.slow
def test_a_rule_that_builds_a_chain_gives_exactly_the_chain_bound(embedded):
    pair, _, refs = embedded
    model, lmax = CostModel.load("models/costmodel.json"), 6
    rule = TreeRule("eagle2", branch=1)
    for ref in refs:
        forced = teacher_forced(pair, ref)
        chain = extract_sequence(
            pair, ref, lmax, "shared", 0, acceptances=("greedy",), draws=1, forced=forced
        )
        seq = inputs_from_tables(
            chain.sequences, chain.tokens, chain.tails, pair.spec, lmax, ["greedy"]
        )[0]
        table, _ = tree_rows(pair, ref, forced, [rule], lmax)
        assert table.column("on_path").to_pylist().count(True) > 20  # the draft does match
        tin = tree_input(ref.seq_id, ref.prompt_len, seq.routing, table, rule, lmax, pair.spec)
        probs, cost, union = chain_tables(seq, model, lmax)
        t_probs, t_cost = tree_tables(model, tin)
        assert np.array_equal(probs, t_probs)
        ok = probs.sum(axis=2) > 0
        a = probs.argmax(axis=2)
        assert np.array_equal(
            np.take_along_axis(union, a[:, :, None], 2)[:, :, 0][ok], tin.union[ok]
        )
        assert np.allclose(np.where(probs > 0, cost, 0), np.where(t_probs > 0, t_cost, 0))
        assert solve_tree(model, tin, [lmax])[0].dp[0] == pytest.approx(
            solve(probs, cost, union).dp[0], rel=1e-12
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "knobs", "rule"),
    [
        ("tree", {"depth": 3, "branch": 2, "gamma": 6}, TreeRule("eagle2", 2, 3)),
        ("ecospec", {"depth": 3, "branch": 2, "gamma": 4}, TreeRule("ecospec", 2, 3)),
    ],
)
def test_extracted_trees_price_exactly_what_the_tree_policy_verifies(embedded, name, knobs, rule):
    """Step by step along the greedy text, the online policy's accepted length, verified
    positions, experts per layer and draft forwards equal the trees rows' at its gamma."""
    pair, artifacts, refs = embedded
    k = knobs["gamma"] - 1
    torch.manual_seed(0)
    for ref in refs:
        forced = teacher_forced(pair, ref)
        table, stats = tree_rows(pair, ref, forced, [rule], 5, artifacts.predictor)
        assert stats.target_token_forwards > 0 and stats.nodes == table.num_rows
        tin = tree_input(ref.seq_id, ref.prompt_len, forced.routing, table, rule, 5, pair.spec)
        session = SpeculativeEngine(pair).start(
            list(ref.prompt_ids), make_policy(name, artifacts, **knobs)
        )
        steps = 0
        while len(session.generated) + k <= ref.n_tokens:
            i = len(session.generated)
            session.step()
            st = session.steps[-1]
            assert (st.accepted, st.verified, st.draft_forwards) == (
                tin.accepted[i, k],
                tin.verified[i, k],
                tin.forwards[i, k],
            ), (ref.seq_id, i)
            assert st.u_bar == pytest.approx(tin.union[i, k], abs=1e-9), (ref.seq_id, i)
            steps += 1
        assert steps >= 5
        assert session.generated == list(ref.response_ids[: len(session.generated)])


def test_missing_trees_and_predictor_are_named(embedded):
    pair, _, refs = embedded
    forced = teacher_forced(pair, refs[0])
    with pytest.raises(ValueError, match="needs the expert predictor"):
        tree_rows(pair, refs[0], forced, [TreeRule("ecospec")], 3)
    table, _ = tree_rows(pair, refs[0], forced, [TreeRule("eagle2")], 3)
    with pytest.raises(ValueError, match="extract with --trees"):
        tree_input(
            "seq-0", refs[0].prompt_len, forced.routing, table, TreeRule("ecospec"), 3, pair.spec
        )
    with pytest.raises(ValueError, match="calibrate K up to"):
        tin = tree_input(
            "seq-0", refs[0].prompt_len, forced.routing, table, TreeRule("eagle2"), 3, pair.spec
        )
        tree_tables(_model(2), tin)


def test_packing_does_not_change_the_rows(embedded):
    """States expanded and routed a few at a time give the rows of all at once."""
    pair, artifacts, refs = embedded
    forced = teacher_forced(pair, refs[0])
    rules = [TreeRule("eagle2"), TreeRule("ecospec", 2, 3)]
    whole, _ = tree_rows(pair, refs[0], forced, rules, 4, artifacts.predictor)
    pieces, _ = tree_rows(pair, refs[0], forced, rules, 4, artifacts.predictor, chunk_tokens=9)
    assert whole.num_rows == pieces.num_rows > 0
    for name in ("rule", "i", "j", "parent", "depth", "token_id", "on_path", "experts"):
        assert whole.column(name).equals(pieces.column(name)), name
    assert np.allclose(whole.column("path_prob").to_numpy(), pieces.column("path_prob").to_numpy())
