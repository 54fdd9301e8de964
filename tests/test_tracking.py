"""The MLflow helper against real sqlite stores in temporary directories."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline.tracking import MAX_PARAM_VAL_LENGTH, tracked_run, tracking_uri


def _download_text(client: MlflowClient, run_id: str, artifact: str, dst: Path) -> str:
    local = client.download_artifacts(run_id, artifact, str(dst))
    return Path(local).read_text(encoding="utf-8")


def test_default_sqlite_in_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    expected_uri = f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    assert tracking_uri() == expected_uri

    src = tmp_path / "notes.txt"
    src.write_text("artifact body", encoding="utf-8")
    params = {
        "model": {"target": "olmoe", "draft": {"name": "tiny", "layers": 2}},
        "ks": [1, 2, 4],
        "long": "x" * (MAX_PARAM_VAL_LENGTH + 50),
        "seed": 0,
    }
    with tracked_run("specbound-test", run_name="r1", params=params, tags={"k": 3}) as run:
        run.log_metrics({"acceptance": 0.5, "tokens": 10}, step=0)
        run.log_metrics({"acceptance": 0.75}, step=1)
        with pytest.warns(RuntimeWarning, match="nan_metric"):
            run.log_metrics({"nan_metric": math.nan, "ok": 1.0})
        run.log_params({"extra": {"flag": True}})
        run.log_artifact(src)
        run.log_dict({"a": [1, 2]}, "summary/result.json")
        run.log_text("hello", "logs/hello.txt")
        run_id, experiment_id = run.run_id, run.experiment_id

    assert (tmp_path / "mlflow.db").is_file()
    client = MlflowClient(tracking_uri=expected_uri)
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED"
    assert got.info.experiment_id == experiment_id
    assert got.info.run_name == "r1"
    assert client.get_experiment(experiment_id).name == "specbound-test"

    p = got.data.params
    assert p["model.target"] == "olmoe"
    assert p["model.draft.name"] == "tiny"
    assert p["model.draft.layers"] == "2"
    assert json.loads(p["ks"]) == [1, 2, 4]
    assert len(p["long"]) == MAX_PARAM_VAL_LENGTH
    assert p["seed"] == "0"
    assert p["extra.flag"] == "True"
    assert got.data.tags["k"] == "3"

    assert got.data.metrics["acceptance"] == 0.75
    assert got.data.metrics["ok"] == 1.0
    assert "nan_metric" not in got.data.metrics
    history = client.get_metric_history(run_id, "acceptance")
    assert [(m.step, m.value) for m in history] == [(0, 0.5), (1, 0.75)]

    names = {a.path for a in client.list_artifacts(run_id)}
    assert {"notes.txt", "summary", "logs"} <= names
    dst = tmp_path / "download"
    dst.mkdir()
    assert _download_text(client, run_id, "notes.txt", dst) == "artifact body"
    assert json.loads(_download_text(client, run_id, "summary/result.json", dst)) == {"a": [1, 2]}
    assert _download_text(client, run_id, "logs/hello.txt", dst) == "hello"
    # Artifacts live next to the database, not in some other directory.
    assert Path(tmp_path / "mlartifacts").is_dir()


def test_env_uri_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    store = tmp_path / "store"
    work.mkdir()
    store.mkdir()
    uri = f"sqlite:///{store / 'other.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(work)
    assert tracking_uri() == uri

    with tracked_run("env-exp", params={"a": 1}) as run:
        run.log_metrics({"m": 2.0})
        run.log_text("x", "x.txt")
        run_id = run.run_id

    assert (store / "other.db").is_file()
    assert not (work / "mlflow.db").exists()
    got = MlflowClient(tracking_uri=uri).get_run(run_id)
    assert got.data.params == {"a": "1"}
    assert got.data.metrics == {"m": 2.0}
    # The experiment's artifacts follow the database, not the cwd.
    assert not (work / "mlruns").exists()
    assert any((store / "mlartifacts").rglob("x.txt"))

    # A second run in the same experiment reuses it.
    with tracked_run("env-exp") as second:
        assert second.experiment_id == got.info.experiment_id


def test_failing_block_marks_run_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="boom"), tracked_run("fail-exp", run_name="bad") as run:
        run.log_metrics({"before": 1.0})
        run_id = run.run_id
        raise RuntimeError("boom")

    got = MlflowClient(tracking_uri=tracking_uri()).get_run(run_id)
    assert got.info.status == "FAILED"
    assert got.data.metrics == {"before": 1.0}

    # No run is left active: the next block starts cleanly.
    with tracked_run("fail-exp") as ok:
        pass
    assert MlflowClient(tracking_uri=tracking_uri()).get_run(ok.run_id).info.status == "FINISHED"
