"""MLflow tracking: a parent run per sweep, a child run per trial.

The driver does everything that touches the store's schema (creating the SQLite file,
the experiment, the parent and all child runs) before any trial starts: several trials
creating a fresh SQLite store at once fail. Trials then only append to their own run
through ``MlflowClient`` (``log_batch``), with the run id they were given.

Tracking URI: ``MLFLOW_TRACKING_URI`` if set (a tracking server on a cluster), else a
SQLite file ``mlflow.db`` in the project with artifacts under ``mlartifacts/``.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

# Tags that identify our runs, so a resumed sweep finds its runs instead of duplicating them.
TAG_SWEEP = "apg.sweep_key"
TAG_CELL = "apg.cell_id"
TAG_PARENT = "mlflow.parentRunId"


class TrackingError(ValueError):
    """The tracking store cannot be reached or used."""


def tracking_uri(root: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(root / 'mlflow.db').resolve()}"


def artifact_location(root: Path) -> str | None:
    """Local store: artifacts inside the project; a server decides its own."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return None
    return (root / "mlartifacts").resolve().as_uri()


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """Fail within seconds, naming the server, instead of hanging on retries."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        return
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname, port), timeout=timeout).close()
    except OSError as err:
        raise TrackingError(f"MLflow tracking server {uri} is unreachable ({err})") from None


def client(uri: str):
    # Fail fast on HTTP errors instead of MLflow's default minutes of retries.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def experiment_id(mlflow_client, name: str, artifacts: str | None) -> str:
    found = mlflow_client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    return mlflow_client.create_experiment(name, artifact_location=artifacts)


def find_run(mlflow_client, exp_id: str, tags: Mapping[str, str]) -> Any | None:
    """The most recent run carrying all ``tags`` (None if there is none)."""
    query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
    runs = mlflow_client.search_runs([exp_id], filter_string=query, max_results=1, order_by=["attributes.start_time DESC"])
    return runs[0] if runs else None


def open_parent(mlflow_client, exp_id: str, sweep_key: str, name: str, params: Mapping[str, Any]) -> str:
    """The sweep's parent run: reused when the same grid is resumed, else created."""
    run = find_run(mlflow_client, exp_id, {TAG_SWEEP: sweep_key})
    if run is not None:
        if run.info.status != "RUNNING":
            mlflow_client.update_run(run.info.run_id, status="RUNNING")
        return run.info.run_id
    run = mlflow_client.create_run(exp_id, run_name=name, tags={TAG_SWEEP: sweep_key})
    log_params(mlflow_client, run.info.run_id, params)
    return run.info.run_id


def open_child(mlflow_client, exp_id: str, parent_id: str, cell_id: str, name: str, params: Mapping[str, Any]) -> str:
    """One child run per cell under ``parent_id``; a restarted cell keeps its run."""
    run = find_run(mlflow_client, exp_id, {TAG_PARENT: parent_id, TAG_CELL: cell_id})
    if run is not None:
        return run.info.run_id
    run = mlflow_client.create_run(exp_id, run_name=name, tags={TAG_PARENT: parent_id, TAG_CELL: cell_id})
    log_params(mlflow_client, run.info.run_id, params)
    return run.info.run_id


def log_params(mlflow_client, run_id: str, params: Mapping[str, Any]) -> None:
    from mlflow.entities import Param

    flat = [Param(k, str(v)[:500]) for k, v in flatten(params).items()]
    for start in range(0, len(flat), 100):  # log_batch takes at most 100 params
        mlflow_client.log_batch(run_id, params=flat[start : start + 100])


def log_metrics(mlflow_client, run_id: str, rows: Iterable[tuple[int, Mapping[str, float]]]) -> None:
    """``rows``: ``(step, {metric: value})``; sent in batches (one request per batch)."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(k, float(v), now, int(step)) for step, values in rows for k, v in values.items()]
    for start in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics
        mlflow_client.log_batch(run_id, metrics=metrics[start : start + 1000])


def finish(mlflow_client, run_id: str, status: str = "FINISHED") -> None:
    mlflow_client.set_terminated(run_id, status=status)


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = v
    return out
