"""jobs.bench_vllm end to end at tiny size (vLLM's CPU engine in its own environment, then our
engine), and its argument checks, which must fail before any engine starts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline.bench.vllm_tables import summarize
from pipeline.models.loading import REPO_ROOT
from pipeline.vllm_spec.env import engine_env, vllm_python


def _run(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    # vLLM's engine core in the harness's process: the same engine code, a start about 15 s
    # shorter (no spawned core and worker importing vLLM again). The spawned path is what the
    # app's tests run (test_vllm_app.py, test_serve_sweep.py).
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return subprocess.run(
        [sys.executable, "-m", "jobs.bench_vllm", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--methods", "none,eagle:k=2"], "--methods: unknown method 'eagle'"),
        (["--methods", "draft_model"], "needs k="),
        (["--methods", "draft_model:k=2:depth=3"], "unknown knobs ['depth']"),
        (["--methods", "ours:k=2:decay=3"], "forget and decay: between 0.5 and 1"),
        (["--methods", "ours:k=2:depth=3"], "unexpected keyword argument 'depth'"),
        (["--methods", "draft_model:k=2:draft_sample_method=top"], "greedy or probabilistic"),
        (["--domains", "code,poetry"], "--domains: unknown domains ['poetry']"),
        (["--concurrency", "0"], "--concurrency must be >= 1"),
        (["--floor-from", "nowhere.json"], "--floor-from nowhere.json: not a bench_vllm summary"),
    ],
)
def test_bad_arguments_exit_2_before_any_engine(args, message, tmp_path, monkeypatch, capsys):
    # In this process (the job's main, as `python -m jobs.bench_vllm` calls it): a subprocess
    # per case spent 8 s importing; the smoke test below runs the command itself.
    from jobs import bench_vllm

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:
        bench_vllm.main([*args, "--out", str(out)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err[-2000:]
    assert not out.exists()  # nothing ran: no prompts, no spec, no engine
    assert not list(tmp_path.iterdir())  # no tracking store either


def test_tables_of_an_earlier_run_with_a_floor_another_run_chose(tmp_path, capsys):
    """--tables-from re-summarizes a raw.json (nothing runs); with --floor-from, ours' floor
    takes the K another run found best."""
    from jobs import bench_vllm

    def run(method: str, repeat: int, tok_s: float) -> dict:
        cell = {"domain": "code", "temperature": 0.0, "concurrency": 1, "tok_s": tok_s}
        cell |= {"tokens": tok_s, "wall_s": 1.0, "outputs": [[1]]}
        return {"method": method, "repeat": repeat, "cells": [cell]}

    rates = {"none": 100, "draft_model:k=2": 110, "draft_model:k=3": 125, "ours:k=4": 120}
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"runs": [run(m, 0, v) for m, v in rates.items()]}))
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps(summarize([run("draft_model:k=2", 0, 130)])))
    out = tmp_path / "tables"
    result = bench_vllm.main(["--tables-from", str(raw), "--out", str(out)])
    assert result["summary"]["cells"][0]["methods"]["ours:k=4"]["vs_floor"] == 0.96
    args = ["--tables-from", str(raw), "--floor-from", str(earlier), "--out", str(out)]
    result = bench_vllm.main(args)
    assert result["summary"]["cells"][0]["methods"]["ours:k=4"]["vs_floor"] == 120 / 110
    assert "floor from another run: draft_model:k=2" in (out / "tables.txt").read_text()
    assert "floor from another run" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_vllm.main(["--tables-from", str(earlier), "--out", str(out)])
    assert "not a bench_vllm raw.json" in capsys.readouterr().err


def test_engines_leave_a_core_to_their_front_end(monkeypatch):
    """OpenMP threads of a vLLM engine the project starts: every core but one (at least one);
    a user's OMP_NUM_THREADS wins."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    env = engine_env()
    assert (env["OMP_NUM_THREADS"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("1", "nobind")
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert engine_env()["OMP_NUM_THREADS"] == "1"
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert engine_env()["OMP_NUM_THREADS"] == "15"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert engine_env()["OMP_NUM_THREADS"] == "2"


def test_bench_vllm_smoke(tmp_path):
    try:
        vllm_python()
    except FileNotFoundError as exc:
        pytest.skip(f"no vLLM environment: {exc}")
    out = tmp_path / "out"
    proc = _run(
        [
            "--domains",
            "code",
            "--limit",
            "2",
            "--max-tokens",
            "8",
            "--concurrency",
            "1,2",
            "--temperatures",
            "0",
            "--repeats",
            "1",
            "--methods",
            "none,draft_model:k=2,ours:k=2",
            "--out",
            str(out),
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "repeat 1/1  draft_model:k=2: starting vLLM" in proc.stdout  # progress passed on
    tables = (out / "tables.txt").read_text()
    for text in (
        "code  T=0  c=1",
        "code  T=0  c=2",
        "best fixed K of vLLM: draft_model:k=2",
        "engine throughput",
        "pooled over domains at c=1, T=0",
        "T=0 texts",
    ):
        assert text in tables, text

    summary = json.loads((out / "summary.json").read_text())
    assert [(c["domain"], c["temperature"], c["concurrency"]) for c in summary["cells"]] == [
        ("code", 0.0, 1),
        ("code", 0.0, 2),
    ]
    for cell in summary["cells"]:
        methods = cell["methods"]
        expected = {"none", "draft_model:k=2", "ours:k=2", "engine ar", "engine throughput"}
        assert expected | {f"engine fixed:k={k}" for k in range(1, 7)} <= methods.keys()
        assert all(row["tok_s"] > 0 for row in methods.values())
        assert methods["none"]["vs_none"] == pytest.approx(1.0)
        assert methods["draft_model:k=2"]["accepted_len"] >= 1.0
        assert methods["none"]["accepted_len"] is None  # no speculation, no drafts
        assert cell["best_engine_fixed"].startswith("engine fixed:k=")
        # ours against its floor, max(none, the best fixed K of its drafter); the plugin's
        # drafter counts the steps it skipped
        ours = methods["ours:k=2"]
        floor = max(methods["none"]["tok_s"], methods["draft_model:k=2"]["tok_s"])
        assert ours["vs_floor"] == pytest.approx(ours["tok_s"] / floor)
        assert 0.0 <= ours["skipped"] <= 1.0 and methods["none"]["skipped"] is None
    assert summary["errors"] == {}
    # Greedy speculative decoding is lossless: vLLM's draft model repeats vLLM's own text.
    same = summary["texts"]["draft_model:k=2"]["none"]
    assert same["total"] == 2 * 2 * 8 and same["equal"] == same["total"]
    assert summary["texts"]["none"]["engine ar"]["total"] == 2 * 2 * 8

    raw = json.loads((out / "raw.json").read_text())
    vllm_runs = [r for r in raw["runs"] if not r["method"].startswith("engine")]
    assert [r["method"] for r in vllm_runs] == ["none", "draft_model:k=2", "ours:k=2"]
    # The scheduler's state at shutdown, from its engine process, is kept with its run.
    (ours_run,) = [r for r in vllm_runs if r["method"] == "ours:k=2"]
    assert ours_run["planner"][0].startswith("cost-aware scheduler at shutdown: steps ")
    assert "k chosen" in ours_run["planner"][0] and "planner" not in vllm_runs[0]
    # Steps that prefill (or catch the draft up, or in which a request ends) are left out of
    # the step-cost fit: at least one per request at c = 1 (2), one for the two requests of
    # c = 2; most of the rest decode.
    unfitted = r"steps (\d+) \((\d+) not fitted\)"
    steps = re.search(unfitted, ours_run["planner"][0])
    assert steps and 3 <= int(steps[2]) < int(steps[1]) / 2
    for run in raw["runs"]:
        assert all(len(o) == 8 for c in run["cells"] for o in c["outputs"])  # ignore_eos
        assert [len(c["outputs"]) for c in run["cells"]] == [2, 2]  # max(limit, c) prompts

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("bench_vllm")
    metrics = client.search_runs([exp.experiment_id])[0].data.metrics
    assert metrics["code.T0.c1.none.vs_none"] == pytest.approx(1.0)
    assert "pooled.T0.c1.draft_model_k_2.tok_s" in metrics
