"""The benches (jobs.bench_online, bench_tree, bench_batch) refuse, before decoding anything,
a policy whose steps the cost model cannot price, naming the policy, its largest m and the
model's; and a policy that fails later loses no other policy's results: each is written as
it is done, the failed one is named at the end and the job exits non-zero. Embedded models,
one prompt, a few tokens."""

from __future__ import annotations

import json

import pytest

import jobs.bench_online
import jobs.bench_tree
import pipeline.bench.batch as batch_bench
import pipeline.bench.online as online
import pipeline.bench.tree_bound as tree_bound
from jobs.cli import run
from pipeline.bench.guard import ResultLog, require_priced
from pipeline.bench.tree_bound import run_tree_bench
from pipeline.decode.policies.artifacts import load_artifacts
from pipeline.decode.policies.registry import make_policy
from pipeline.models.loading import load_pair

pytestmark = pytest.mark.usefixtures("one_torch_thread")
COST_MAX_M = 13  # the committed cost model's largest m


@pytest.fixture(scope="module")
def embedded():
    pair = load_pair("models/target", "models/draft", "cpu", "float32", "eager")
    artifacts = load_artifacts()
    assert artifacts.cost.max_m == COST_MAX_M
    return pair, artifacts, [pair.tokenizer.encode("def add(a, b):\n")]


def _no_decoding(*args, **kwargs):
    raise AssertionError("decoded before every policy was checked")


def _exit(main, argv, capsys) -> tuple[int, str, str]:
    """A job run as from the command line: its exit code, stdout and stderr."""
    with pytest.raises(SystemExit) as done:
        run(lambda: main(argv))
    printed = capsys.readouterr()
    return done.value.code, printed.out, printed.err


def test_the_check_names_the_policy_its_m_and_the_models(embedded):
    _, artifacts, _ = embedded
    cost = artifacts.cost
    require_priced("bench", cost, [("ar", {}), ("fixed", {"k": 12}), ("tree", {})], artifacts)
    with pytest.raises(ValueError) as err:
        require_priced("bench", cost, [("fixed", {"k": 2}), ("heuristic", {})], artifacts)
    text = str(err.value)
    assert "heuristic may verify m = 21 positions in a step (start_k 5, max_k 20)" in text
    assert f"prices m up to {COST_MAX_M}" in text and "fixed" not in text
    assert "--ks 0-20" in text
    # A tree verifies at most its nodes + 1: depth 4 x branch 2 has 14, whatever gamma says.
    with pytest.raises(ValueError, match=r"tree\(gamma=20\) may verify m = 15 .*\(depth 4, bra"):
        require_priced("bench", cost, [("tree", {"gamma": 20})], artifacts)


def test_bench_online_refuses_an_unpriced_policy_before_decoding(
    embedded, monkeypatch, tmp_path, capsys
):
    """The issue's run: `heuristic` at its defaults (a chain of 20, m = 21) beside others
    decoded for minutes, then died pricing it. Now it exits at once, naming it."""
    monkeypatch.setattr(online, "bench_policy", _no_decoding)
    monkeypatch.setattr(online, "bench_policies", _no_decoding)
    argv = ["--policies", "ar,fixed:k=2,heuristic", "--limit", "1", "--out", str(tmp_path)]
    code, out, err = _exit(jobs.bench_online.main, argv, capsys)
    assert code == 2 and "bench_online" in err and "T=0" not in out, err
    assert "heuristic may verify m = 21" in err and f"prices m up to {COST_MAX_M}" in err


def test_bench_online_keeps_every_other_policy_when_one_fails_scoring(
    embedded, monkeypatch, tmp_path, capsys
):
    """fixed(k=3)'s pricing fails (injected): ar and fixed(k=2) are in rows.jsonl before it
    is even scored, in the printed table and the MLflow run; it is named at the end and the
    job exits non-zero."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    real = online.modelled_generation
    on_disk_at_failure: list[str] = []

    def pricing(pair, prompt, tokens, steps, cost):
        if any(s.verified == 4 for s in steps):  # fixed(k=3) verifies 4 positions a step
            on_disk_at_failure.extend((tmp_path / "out" / "rows.jsonl").read_text().splitlines())
            raise RuntimeError("pricing broke")
        return real(pair, prompt, tokens, steps, cost)

    monkeypatch.setattr(online, "modelled_generation", pricing)
    argv = "--policies ar,fixed:k=2,fixed:k=3 --limit 1 --max-new-tokens 4 --temperatures 0"
    argv = [*argv.split(), "--no-assisted", "--no-bound", "--out", str(tmp_path / "out")]
    code, out, err = _exit(jobs.bench_online.main, argv, capsys)
    assert code != 0
    table = out[out.index("policy  ") :]  # the printed table: the others, then the failure
    assert "\nar " in table and "\nfixed(k=2) " in table and "\nfixed(k=3) (T=0) FAILED" in table
    assert (
        "1 policy failed" in err and "fixed(k=3) (T=0) FAILED: RuntimeError: pricing broke" in err
    )
    assert [json.loads(line)["policy"] for line in on_disk_at_failure] == ["ar", "fixed(k=2)"]
    records = [json.loads(x) for x in (tmp_path / "out" / "rows.jsonl").read_text().splitlines()]
    assert [r["policy"] for r in records] == ["ar", "fixed(k=2)", "fixed(k=3)"]
    assert records[1]["tok_s"] > 0 and records[1]["modelled_speedup"] > 0
    assert records[2]["failed"] == "RuntimeError: pricing broke"


def test_bench_tree_refuses_an_unpriced_tree_before_decoding(embedded, monkeypatch, capsys):
    pair, artifacts, prompts = embedded
    monkeypatch.setattr(tree_bound, "bench_policies", _no_decoding)
    too_big = [("tree", {"depth": 4, "branch": 4, "gamma": 20})]
    with pytest.raises(ValueError, match=r"tree\(depth=4,branch=4,gamma=20\) may verify m = 20"):
        run_tree_bench(pair, artifacts, prompts, 4, too_big, budgets=(1, 2), repeats=1)
    argv = ["--policies", "tree:depth=4:branch=4:gamma=20", "--limit", "1", "--budgets", "1,2"]
    code, _, err = _exit(jobs.bench_tree.main, argv, capsys)
    assert code == 2 and "may verify m = 20 positions" in err and "up to 13" in err, err


def test_bench_tree_keeps_every_other_policy_when_one_fails_scoring(
    embedded, monkeypatch, tmp_path
):
    pair, artifacts, prompts = embedded
    real = tree_bound._score

    def scoring(pair, prompts, cost, row, *args):
        if row.label.startswith("ecospec"):
            raise RuntimeError("scoring broke")
        return real(pair, prompts, cost, row, *args)

    monkeypatch.setattr(tree_bound, "_score", scoring)
    log = ResultLog(tmp_path / "policies.jsonl")
    policies = [("tree", {"depth": 2, "branch": 2, "gamma": 3}), ("ecospec", {"gamma": 3})]
    bench = run_tree_bench(
        pair, artifacts, prompts, 6, policies, budgets=(1, 2), repeats=1, record=log.write
    )
    assert [s.label for s in bench.policies] == ["tree(depth=2,branch=2,gamma=3)"]
    assert bench.policies[0].modelled > 0 and bench.policies[0].bound > 0
    assert [f.policy for f in bench.failures] == ["ecospec(gamma=3)"]
    records = [json.loads(x) for x in log.path.read_text().splitlines()]
    assert records[0]["label"] == "tree(depth=2,branch=2,gamma=3)"
    assert records[1] == {
        "policy": "ecospec(gamma=3)",
        "where": "scoring",
        "failed": "RuntimeError: scoring broke",
    }
    assert "ecospec(gamma=3) (scoring) FAILED" in tree_bound.format_tree_bench(bench, "")


def test_bench_batch_builds_every_policy_before_decoding(embedded, monkeypatch):
    pair, artifacts, prompts = embedded
    monkeypatch.setattr(batch_bench, "BatchedEngine", _no_decoding)
    specs = [("fixed", {"k": 2}), ("throughput", {"max_k": 20})]
    with pytest.raises(ValueError, match="before decoding: throughput max_k=20: .*max_k"):
        batch_bench.bench_batch(pair, prompts, specs, [2], 4, 0.0, 1, artifacts)


def test_bench_batch_keeps_every_other_cell_when_one_fails(embedded, monkeypatch):
    """fixed k=3's policy raises while decoding (injected): its cell is marked failed after
    its first repeat and skipped after; every other cell's repeats are recorded."""
    pair, artifacts, prompts = embedded

    def policy(name, arts=None, /, **knobs):
        made = make_policy(name, arts, **knobs)
        if knobs == {"k": 3}:

            def broken(drafter, committed):
                raise RuntimeError("decoding broke")

            made.propose = broken
        return made

    monkeypatch.setattr(batch_bench, "make_policy", policy)
    written: list[dict] = []
    specs = [("ar", {}), ("fixed", {"k": 3}), ("fixed", {"k": 2})]
    cells = batch_bench.bench_batch(
        pair, prompts * 2, specs, [2], 4, 0.0, 2, artifacts, lambda line: None, written.append
    )
    failed = [c for c in cells if c.failed is not None]
    assert [c.label for c in failed] == ["fixed k=3"]
    assert "RuntimeError: decoding broke" in failed[0].failed.error
    assert all(len(c.tok_s) == 2 for c in cells if c.failed is None)
    assert sorted((r["policy"], r.get("repeat")) for r in written) == [
        ("ar", 1),
        ("ar", 2),
        ("fixed k=2", 1),
        ("fixed k=2", 2),
        ("fixed k=3", None),
    ]
    table = batch_bench.format_batch_bench(cells, "")
    assert "fixed k=3 (batch 2, repeat 1) FAILED" in table and "best fixed K at batch 2" in table
