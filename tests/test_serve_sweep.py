"""The serving sweep (jobs.bench_serve_sweep) end to end on a real local Ray cluster and Serve:
both replica modes, two client counts, ShareGPT prompts, every cell present with no errors,
TTFT within each request's latency, the ratio table, the CSV/JSON files and the MLflow run.
Also, without Ray: its command line refuses bad input. No assertion depends on speed."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from jobs import bench_serve_sweep
from serving.sweep import SweepSettings, metric_key, policy_label

POLICY = {"policy": "fixed", "k": 2}


@pytest.mark.slow
def test_sweep_measures_every_cell_of_both_modes(tmp_path: Path, monkeypatch, capsys) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # its own local cluster
    results = []
    real = bench_serve_sweep.run_sweep
    monkeypatch.setattr(
        bench_serve_sweep, "run_sweep", lambda *a, **k: results.append(real(*a, **k)) or results[-1]
    )
    out = tmp_path / "out"
    metrics = bench_serve_sweep.main(
        [
            "--source",
            "sharegpt",
            "--limit",
            "4",
            "--max-tokens",
            "4",
            "--concurrency",
            "1,2",
            "--policies",
            json.dumps([POLICY]),
            "--modes",
            "single,batched",
            "--num-cpus",
            "2",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    (result,) = results
    label = policy_label(POLICY)
    assert [(c.mode, c.concurrency, c.policy) for c in result.cells] == [
        ("single", 1, label),
        ("single", 2, label),
        ("batched", 1, label),
        ("batched", 2, label),
    ]
    for cell in result.cells:
        assert len(cell.outcomes) == 4
        for o in cell.outcomes:
            assert o.error is None
            assert o.ttft is not None and 0 < o.ttft <= o.latency
            assert 1 <= o.tokens <= 4
        row = cell.row()
        assert row["errors"] == 0 and row["req_s"] > 0 and row["out_tok_s"] > 0
        assert row["ttft_p50_ms"] <= row["p50_ms"] and row["ttft_p99_ms"] <= row["p99_ms"]
    assert [(r["concurrency"], r["policy"]) for r in result.ratios()] == [(1, label), (2, label)]

    table = capsys.readouterr().out
    assert "batched / single" in table and table.count(label) >= 2 * 4 + 2
    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and all(r["errors"] == "0" for r in rows)
    assert len(json.loads((out / "sweep.json").read_text())["ratios"]) == 2
    key = f"batched.c2.{metric_key(label)}"
    assert metrics[f"{key}.errors"] == 0 and metrics[f"{key}.req_s"] > 0
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("bench_serve_sweep").experiment_id])
    assert run.data.metrics[f"{key}.out_tok_s"] == pytest.approx(metrics[f"{key}.out_tok_s"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policies", '[{"policy": "fixed", "k": 0}]'], "k must be >= 1"),
        (["--policies", '{"policy": "ar"}'], "non-empty JSON list"),
        (["--policies", '[{"policy": "nope"}]'], "unknown policy"),
        (["--modes", "single,fast"], "distinct modes"),
        (["--concurrency", "1,0"], "integers >= 1"),
        (["--limit", "4", "--concurrency", "1,8"], "leaves clients idle"),
    ],
)
def test_sweep_command_line_refuses_bad_input(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        bench_serve_sweep.parse_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_sweep_defaults_and_labels() -> None:
    args = bench_serve_sweep.parse_args([])
    assert args.concurrency == [1, 2, 4, 8, 16] and args.modes == ["single", "batched"]
    assert [policy_label(s) for s in args.policies] == ["ar", "fixed k=4", "throughput"]
    assert metric_key("fixed k=4") == "fixed_k_4" and args.source == "sharegpt"


def test_modes_differ_only_in_max_batch() -> None:
    settings = SweepSettings(
        "t",
        "d",
        "cpu",
        "auto",
        "eager",
        ({"policy": "ar"},),
        (1, 32),
        ("single", "batched"),
        8,
        0.0,
        1.0,
        max_batch=16,
    )
    single, batched = settings.replica_args("single"), settings.replica_args("batched")
    assert (single.pop("max_batch"), batched.pop("max_batch")) == (1, 16)
    assert single == batched and single["max_ongoing_requests"] == 32
