"""The serving sweep (jobs.bench_serve_sweep) end to end on real local Ray clusters and Serve:
both endpoint modes and the vLLM app (real vLLM, its own environment) in one run, two sources,
two client counts, every cell present (interleaved) with no errors, TTFT within each request's
latency, the ratio and comparison tables, the CSV/JSON files and the MLflow run. Also, without
Ray: its command line refuses bad input. No assertion depends on speed."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from jobs import bench_serve_sweep
from pipeline.bench.serve_sweep import SweepSettings, metric_key, policy_label
from pipeline.vllm_spec.env import vllm_python

POLICY = {"policy": "fixed", "k": 2}


@pytest.mark.slow
def test_sweep_measures_every_cell_of_every_system(tmp_path: Path, monkeypatch, capsys) -> None:
    """Both endpoint modes and the vLLM app (ours and a fixed K), two sources, two client
    counts: one start-up of everything."""
    try:
        vllm_python()
    except FileNotFoundError as exc:
        pytest.skip(f"{exc} (make test builds it)")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # its own local cluster
    results = []
    real = bench_serve_sweep.run_sweep
    monkeypatch.setattr(
        bench_serve_sweep, "run_sweep", lambda *a, **k: results.append(real(*a, **k)) or results[-1]
    )
    out = tmp_path / "out"
    argv = ["--source", "sharegpt,humaneval", "--limit", "2", "--max-tokens", "4"]
    argv += ["--concurrency", "1,2", "--policies", json.dumps([POLICY])]
    argv += ["--modes", "single,batched", "--vllm", "ours:k=2,draft_model:k=1"]
    metrics = bench_serve_sweep.main(
        [*argv, "--num-cpus", "2", "--device", "cpu", "--out", str(out)]
    )
    (result,) = results
    label = policy_label(POLICY)
    systems = [("single", label), ("batched", label), ("vllm", "ours-k2")]
    systems.append(("vllm", "draft_model-k1"))
    # Interleaved: every system's cell at one concurrency before the next concurrency.
    assert [(c.source, c.concurrency, c.mode, c.policy) for c in result.cells] == [
        (src, c, mode, policy)
        for src in ("sharegpt", "humaneval")
        for c in (1, 2)
        for mode, policy in systems
    ]
    for cell in result.cells:
        assert len(cell.outcomes) == 2
        for o in cell.outcomes:
            assert o.error is None
            assert o.ttft is not None and 0 < o.ttft <= o.latency
            assert 1 <= o.tokens <= 4
        row = cell.row()
        assert row["errors"] == 0 and row["req_s"] > 0 and row["out_tok_s"] > 0
        assert row["ttft_p50_ms"] <= row["p50_ms"] and row["ttft_p99_ms"] <= row["p99_ms"]
    assert [(r["source"], r["concurrency"]) for r in result.ratios()] == [
        ("sharegpt", 1),
        ("sharegpt", 2),
        ("humaneval", 1),
        ("humaneval", 2),
    ]
    compared = result.to_json()["comparisons"]
    assert [(r["source"], r["concurrency"]) for r in compared] == [
        ("humaneval", 1),
        ("humaneval", 2),
        ("sharegpt", 1),
        ("sharegpt", 2),
    ]
    for r in compared:
        assert r["best_k"] == "draft_model-k1" and r["errors"] == 0
        assert r["ours_vs_endpoint_x"] > 0 and r["ours_vs_best_k_x"] > 0

    table = capsys.readouterr().out
    assert "batched / single" in table and "vLLM app with ours (the cost-aware scheduler)" in table
    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 16 and all(r["errors"] == "0" for r in rows)
    assert (out / "comparisons.csv").exists()
    assert len(json.loads((out / "sweep.json").read_text())["ratios"]) == 4
    key = f"sharegpt.batched.c2.{metric_key(label)}"
    assert metrics[f"{key}.errors"] == 0 and metrics[f"{key}.req_s"] > 0
    assert metrics["humaneval.vllm_vs.c2.ours_vs_best_k_x"] > 0
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
        (["--vllm", "ours"], "the others k=K"),
        (["--vllm", "draft_model:k=2:schedule=1/4"], "none takes no knobs"),
        (["--vllm", "suffix:k=2"], "the vLLM app serves"),
        (["--vllm", "none:k=2"], "none takes no knobs"),
        (["--vllm", "ours:k=2,ours:k=2"], "given twice"),
        (["--no-vllm", "--modes", ""], "nothing to measure"),
        (["--source", "sharegpt,sharegpt"], "distinct sources"),
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
    assert args.concurrency == [1, 2, 4, 8, 16] and args.modes == ["batched"]
    assert [policy_label(s) for s in args.policies] == ["throughput"]
    assert metric_key("fixed k=4") == "fixed_k_4" and args.source == ["sharegpt", "humaneval"]
    assert [m["name"] for m in args.vllm] == [
        "ours-k4",
        "draft_model-k1",
        "draft_model-k2",
        "draft_model-k3",
        "none",
    ]
    assert args.vllm[1] == {"name": "draft_model-k1", "speculation": "draft_model", "k": 1}
    ours = bench_serve_sweep.parse_args(["--vllm", "ours:k=4:design=fixed"]).vllm
    assert ours == [
        {
            "name": "ours-k4-designfixed",
            "speculation": "ours",
            "k": 4,
            "policy": {"design": "fixed"},
        }
    ]


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
