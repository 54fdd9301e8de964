"""The per-domain summary of the online bench: each domain's own best fixed K in the same run,
a policy's ratio over it, pooled figures over the domains from total tokens and time, the
modelled share of the bound, and the greedy-text check that tolerates a last step's overshoot.
Synthetic rows (no models): what the arithmetic must give is known exactly."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from pipeline.bench.domains import ALL, domain_metrics, domain_table, format_domain_summary
from pipeline.bench.rows import BenchRow
from pipeline.bench.runs import format_runs_summary, runs_table
from pipeline.bench.scoring import OnlineBenchResult
from pipeline.models.loading import REPO_ROOT


def _row(label, seconds, outputs, policy_ms=None, bound=None, temperature=0.0):
    return BenchRow(
        label=label,
        temperature=temperature,
        tokens=sum(len(o) for o in outputs),
        seconds=seconds,
        mean_accepted=1.0,
        mean_unique_experts=4.0,
        verify_share=0.5,
        outputs=outputs,
        policy_ms=policy_ms,
        ar_ms=None if policy_ms is None else 100.0,
        bound=None if bound is None else SimpleNamespace(speedup=bound),
    )


def _result(rows):
    return OnlineBenchResult(rows, [], 1, 4, "cpu", 7.0, 12, None)


TEXT = [[1, 2, 3, 4]]


def test_ratios_over_each_domains_best_fixed_k_and_pooled():
    code = _result(
        [
            _row("ar", 4.0, TEXT, 100.0, 2.0),
            _row("fixed(k=1)", 2.0, TEXT, 80.0, 2.0),
            _row("fixed(k=4)", 1.0, [[1, 2, 3, 4, 5]], 50.0, 2.0),  # overshoot: still greedy
            _row("ours", 0.8, [[1, 2, 9, 4]], 60.0, 2.0),  # a different greedy text
        ]
    )
    prose = _result(
        [
            _row("ar", 4.0, TEXT, 100.0, 1.25),
            _row("fixed(k=1)", 3.2, TEXT, 90.0, 1.25),
            _row("fixed(k=4)", 8.0, TEXT, 150.0, 1.25),
            _row("ours", 3.2, TEXT, 85.0, 1.25),
        ]
    )
    df = domain_table({"code": code, "prose": prose}).set_index(["domain", "policy"])
    assert df.loc[("code", "fixed(k=1)"), "best_fixed"] == "fixed(k=4)"
    assert df.loc[("prose", "ours"), "best_fixed"] == "fixed(k=1)"
    assert df.loc[("code", "fixed(k=4)"), "speedup"] == pytest.approx(5.0)  # 5 tok/s vs 1
    assert df.loc[("code", "ours"), "over_best_fixed"] == pytest.approx(1.0)  # 5 vs 5 tok/s
    assert df.loc[("prose", "ours"), "over_best_fixed"] == pytest.approx(1.0)
    assert df.loc[("prose", "fixed(k=4)"), "over_best_fixed"] == pytest.approx(0.4)
    # Modelled over the bound on the same text: (100 / 60) / 2.0.
    assert df.loc[("code", "ours"), "of_bound"] == pytest.approx(100 / 60 / 2.0)
    assert bool(df.loc[("code", "fixed(k=4)"), "greedy_equal"])
    assert not df.loc[("code", "ours"), "greedy_equal"]
    # Pooled: total tokens over total time (ours: 8 tokens in 4.0 s, ar: 8 in 8.0 s).
    assert df.loc[(ALL, "ours"), "speedup"] == pytest.approx(2.0)
    assert df.loc[(ALL, "fixed(k=1)"), "speedup"] == pytest.approx(8 / 5.2 / 1.0)
    assert not df.loc[(ALL, "ours"), "greedy_equal"]  # one domain's text differs
    assert bool(df.loc[(ALL, "fixed(k=4)"), "greedy_equal"])
    text = format_domain_summary(df.reset_index())
    assert "code, T=0 (best fixed: fixed(k=4))" in text and "NO" in text
    assert domain_metrics(df.reset_index())["all_T0_ours_over_best_fixed"] > 1


def test_a_run_without_fixed_k_has_no_ratio_and_says_so():
    rows = [_row("ar", 4.0, TEXT, 100.0), _row("ours", 2.0, TEXT, 60.0)]
    df = domain_table({"code": _result(rows)})
    text = format_domain_summary(df)
    assert "code, T=0 (best fixed: no fixed K in this run)" in text and "nanx" not in text
    metrics = domain_metrics(df)
    assert metrics["code_T0_ours_speedup"] == pytest.approx(2.0)
    assert not any(key.endswith("_over_best_fixed") for key in metrics)


def test_pooled_over_runs_the_best_fixed_k_is_picked_on_the_sums():
    """One run's best fixed K is its luckiest row: fixed(k=4) takes 1.0 s in run 1 and 4.0 s in
    run 2. Pooled, each policy's tokens and seconds are summed and the best fixed K is picked
    on the sums (fixed(k=1): 8 tokens in 4 s against `ar`'s 8 in 8 s); each run's own ratio
    is kept as the spread."""
    run1 = _result(
        [
            _row("ar", 4.0, TEXT, 100.0),
            _row("fixed(k=1)", 2.0, TEXT, 80.0),
            _row("fixed(k=4)", 1.0, TEXT, 50.0),
            _row("ours", 1.25, TEXT, 40.0),
            _row("once", 2.0, TEXT, 60.0),  # failed in run 2
        ]
    )
    run2 = _result(
        [
            _row("ar", 4.0, TEXT, 100.0),
            _row("fixed(k=1)", 2.0, TEXT, 80.0),
            _row("fixed(k=4)", 4.0, TEXT, 50.0),
            _row("ours", 1.25, TEXT, 40.0),
        ]
    )
    df = runs_table([domain_table({"code": run1}), domain_table({"code": run2})])
    df = df.set_index("policy")
    assert (df["best_fixed"] == "fixed(k=1)").all()
    assert df.loc["fixed(k=4)", "speedup"] == pytest.approx(8 / 5 / 1.0)
    assert df.loc["ours", "speedup"] == pytest.approx(3.2)
    assert df.loc["ours", "over_best_fixed"] == pytest.approx(1.6)
    assert (df.loc["ours", "run_min"], df.loc["ours", "run_max"]) == pytest.approx((0.8, 1.6))
    assert df.loc["ours", "modelled_speedup"] == pytest.approx(100 / 40)
    assert df.loc["ours", "runs"] == 2 and df.loc["once", "runs"] == 1
    assert df.loc["once", "speedup"] == pytest.approx(2.0)  # against run 1's `ar` only
    text = format_runs_summary(df.reset_index())
    assert text.startswith("over 2 runs")
    assert "code, T=0 (best fixed over the runs: fixed(k=1))" in text
    assert "0.80-1.60" in text and "(1 runs)" in text


@pytest.mark.slow
def test_bench_online_per_domain(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    args = "--domains prose,math --limit 1 --max-new-tokens 3 --temperatures 0 --quick --runs 2"
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.bench_online", *args.split()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for text in (
        "=== domain prose ===",
        "=== domain math ===",
        "prose, T=0 (best fixed:",
        "all, T=0 (best fixed: fixed(k=",
        "x best fixed",
        "throughput",
        "##### run 2/2 #####",
        "over 2 runs",
        "all, T=0 (best fixed over the runs: fixed(k=",
        "prices against this run's steps: draft forwards at",
    ):
        assert text in proc.stdout, text
    assert " NO" not in proc.stdout  # greedy texts equal `ar`'s
    # Run 2's T = 0 texts are run 1's: the oracle solved them once.
    assert "run 1/2, prose: T=0 ar: the oracle on its text" in proc.stdout
    assert "run 2/2, prose: T=0 ar: the oracle" not in proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "jobs.bench_online", "--domains", "poetry"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "code, prose, math" in bad.stderr
