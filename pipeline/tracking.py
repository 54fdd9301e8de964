"""The one MLflow helper every job uses.

Runs go to ``$MLFLOW_TRACKING_URI`` when set, else to ``sqlite:///<cwd>/mlflow.db``: MLflow 3
refuses a plain ``./mlruns`` file store unless explicitly opted in, and sqlite needs no server.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import mlflow
from mlflow.entities import RunStatus
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

try:
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH
except ImportError:  # moved in some MLflow release; 6000 has been the limit since 1.x
    MAX_PARAM_VAL_LENGTH = 6000

_TRUNCATION_MARK = "...[truncated]"

# Schema creation/migration on every fresh sqlite store logs several INFO lines per process.
for _name in ("alembic", "mlflow.store.db.utils", "mlflow.store.sql"):
    logging.getLogger(_name).setLevel(logging.WARNING)


def tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI`` if set and non-empty, else a sqlite file in the cwd."""
    env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if env:
        return env
    return f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"


def _sqlite_db_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI, or None for other stores / in-memory DBs."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    raw = unquote(uri[len(prefix) :].split("?", 1)[0])
    if not raw or raw == ":memory:":
        return None
    path = Path(raw)
    return path if path.is_absolute() else (Path.cwd() / path).resolve()


def _artifact_location(uri: str, experiment: str) -> str | None:
    """Keep artifacts next to the sqlite DB rather than under whatever cwd created the run.

    MLflow's default is ``<cwd>/mlruns/<id>``; with a shared ``MLFLOW_TRACKING_URI`` that would
    scatter artifacts into each Ray worker's scratch directory.
    """
    db = _sqlite_db_path(uri)
    if db is None:
        return None  # server / other stores choose their own artifact root
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", experiment).strip("_")[:80] or "experiment"
    # Different names can share a slug; a short hash keeps their directories apart.
    digest = hashlib.sha1(experiment.encode()).hexdigest()[:8]
    return (db.parent / "mlartifacts" / f"{slug}-{digest}").as_uri()


def _ensure_experiment(client: MlflowClient, uri: str, name: str) -> str:
    existing = client.get_experiment_by_name(name)
    if existing is not None:
        return existing.experiment_id
    try:
        return client.create_experiment(name, artifact_location=_artifact_location(uri, name))
    except MlflowException:
        # Another worker may have created it between our lookup and create.
        existing = client.get_experiment_by_name(name)
        if existing is None:
            raise
        return existing.experiment_id


def _flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in params.items():
        full = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{full}."))
        else:
            flat[full] = value
    return flat


def _param_value(value: Any) -> str:
    if value is None or isinstance(value, str | bool | int | float):
        text = str(value)
    else:
        # JSON keeps lists / tuples readable in the UI; default=str covers Paths, dtypes, etc.
        try:
            text = json.dumps(value, default=str, sort_keys=True)
        except (TypeError, ValueError):
            text = str(value)
    if len(text) > MAX_PARAM_VAL_LENGTH:
        text = text[: MAX_PARAM_VAL_LENGTH - len(_TRUNCATION_MARK)] + _TRUNCATION_MARK
    return text


def prepare_params(params: Mapping[str, Any]) -> dict[str, str]:
    """Nested dicts flattened to dotted keys, values stringified and cut to MLflow's limit."""
    return {key: _param_value(value) for key, value in _flatten(params).items()}


def _finite_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    clean: dict[str, float] = {}
    for key, value in metrics.items():
        number: float | None = None
        if not isinstance(value, str | bytes):
            try:
                number = float(value)  # accepts numpy scalars and 0-d tensors too
            except (TypeError, ValueError):
                number = None
        if number is None or not math.isfinite(number):
            # Some stores reject NaN/inf and a bad value would abort the whole batch.
            warnings.warn(
                f"skipping metric {key!r}: {value!r} is not a finite number",
                RuntimeWarning,
                stacklevel=3,
            )
            continue
        clean[key] = number
    return clean


class TrackedRun:
    """Thin handle on an active run; logs through the client with an explicit run id."""

    def __init__(self, client: MlflowClient, run_id: str, experiment_id: str) -> None:
        self._client = client
        self.run_id = run_id
        self.experiment_id = experiment_id

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        clean = _finite_metrics(metrics)
        if clean:
            mlflow.log_metrics(clean, step=step, run_id=self.run_id)

    def log_params(self, params: Mapping[str, Any]) -> None:
        prepared = prepare_params(params)
        if prepared:
            mlflow.log_params(prepared, run_id=self.run_id)

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        self._client.log_artifact(self.run_id, os.fspath(path), artifact_path)

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        self._client.log_dict(self.run_id, obj, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        self._client.log_text(self.run_id, text, artifact_file)


@contextmanager
def tracked_run(
    experiment: str,
    run_name: str | None = None,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, Any] | None = None,
) -> Iterator[TrackedRun]:
    """Start an MLflow run in ``experiment`` (created if missing) and yield a ``TrackedRun``.

    The run ends FINISHED on normal exit and FAILED when the block raises; the exception
    propagates.
    """
    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri)
    experiment_id = _ensure_experiment(client, uri, experiment)
    mlflow.set_experiment(experiment_id=experiment_id)

    str_tags = {key: str(value) for key, value in (tags or {}).items()}
    with mlflow.start_run(
        experiment_id=experiment_id, run_name=run_name, tags=str_tags or None
    ) as active:
        run_id = active.info.run_id
        try:
            handle = TrackedRun(client, run_id, experiment_id)
            if params:
                handle.log_params(params)
            yield handle
        except BaseException:
            # Explicit rather than relying on ActiveRun.__exit__, which only acts if the run
            # is still on the active stack (user code may have ended or swapped it).
            client.set_terminated(run_id, RunStatus.to_string(RunStatus.FAILED))
            raise
