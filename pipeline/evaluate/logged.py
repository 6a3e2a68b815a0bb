"""The evaluation as MLflow shows it: each cell's run and its held-out numbers there.

Best effort: the files of ``results/eval/<task>/`` are the record, and an unreadable
tracking store only leaves a note (``pipeline.evaluate.stage`` calls ``mlflow_run_ids`` then
``log_evaluation`` once per task).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pandas as pd

from pipeline.common import project_root
from pipeline.config.checks import first_line


def _sweep_client(summary: dict[str, Any]):
    """The sweep's MLflow client, or None when the sweep logged nothing; the store is looked
    up in this project when the sweep ran in a copy of it since moved or deleted."""
    info = summary.get("mlflow") or {}
    if not info.get("parent_run_id"):
        return None
    from pipeline import tracking

    uri = info["tracking_uri"]
    store = uri.removeprefix("sqlite:///") if urlparse(uri).scheme == "sqlite" else None
    if store is not None and not Path(store).is_file():
        # Opening the gone store would create an empty one there.
        uri = tracking.tracking_uri(project_root())
        print(
            f"note: the sweep's MLflow store {store} is gone; looking its runs up in {tracking.redact(uri)}"
        )
    return tracking.client(uri)


def _note(what: str, err: Exception) -> None:
    print(f"note: {what} ({type(err).__name__}: {first_line(err)})")


def mlflow_run_ids(summary: dict[str, Any]) -> dict[str, str]:
    """``{cell_id: MLflow child run id}`` for the sweep's cells, so that every reported
    number can be traced to its run; empty when the tracking store cannot be read (the
    cell id is also a tag, ``apg.cell_id``, on the child run)."""
    try:
        from pipeline import tracking

        client = _sweep_client(summary)
        if client is None:
            return {}
        info = summary["mlflow"]
        out = {}
        for cell in summary["cells"]:
            run = tracking.find_run(
                client,
                info["experiment_id"],
                {tracking.TAG_PARENT: info["parent_run_id"], tracking.TAG_CELL: cell["cell_id"]},
            )
            if run is None:
                # A cell this sweep reused (trained by an earlier sweep, same cell id: the
                # same training config) keeps the run that trained it.
                run = tracking.find_run(client, info["experiment_id"], {tracking.TAG_CELL: cell["cell_id"]})
            if run is not None:
                out[cell["cell_id"]] = run.info.run_id
        return out
    except Exception as err:  # noqa: BLE001 - traceability is best effort; evaluation must not fail on it
        _note("MLflow run ids not recorded", err)
        return {}


def evaluation_metrics(frame: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Per cell id, its held-out numbers as MLflow metrics: the mean over the datasets of
    each final metric, named ``eval.<test set>.K<K>L<L>.<metric>`` (one name per number of
    Table 1 and the method tables, so the runs table can show and sort them)."""
    last = frame.groupby(["cell_id", "test_set", "K", "L", "metric"])["sweep"].transform("max")
    fin = frame[frame["sweep"] == last]
    means = fin.groupby(["cell_id", "test_set", "K", "L", "metric"])["value"].mean().dropna()
    out: dict[str, dict[str, float]] = {}
    for (cell_id, test_set, k, l, metric), value in means.items():
        out.setdefault(cell_id, {})[f"eval.{test_set}.K{k}L{l}.{metric}"] = float(value)
    return out


def log_evaluation(summary: dict[str, Any], run_ids: dict[str, str], frame: pd.DataFrame) -> int:
    """Log every cell's held-out numbers (``evaluation_metrics``) to its MLflow run, beside
    its training curves; the number of runs logged (best effort, like ``mlflow_run_ids``)."""
    if not run_ids:
        return 0
    try:
        from pipeline import tracking

        client = _sweep_client(summary)
        if client is None:
            return 0
        logged = 0
        for cell_id, values in evaluation_metrics(frame).items():
            if cell_id in run_ids:
                tracking.log_metrics(client, run_ids[cell_id], [(0, values)])
                logged += 1
        return logged
    except Exception as err:  # noqa: BLE001 - the evaluation's files are the record; MLflow is a view of them
        _note("held-out numbers not logged to MLflow", err)
        return 0
