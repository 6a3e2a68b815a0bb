"""What a sweep's Ray Tune trial runs for one cell (``pipeline.sweep.stage`` schedules them): the
run layer's trial (:mod:`pipeline.runs.trial`: data, resume from Tune's checkpoint else the
cell's own ``resume.pt``, MLflow rows, Tune reports and checkpoints) and the training loop,
then the cell's files (``done.json`` last) and their upload to its MLflow run.

Fault injection, for tests only: ``APG_FAULT_INJECT="<cell name or id>:<iteration>"`` in the
sweep driver's environment makes that cell's trial raise once, right after that iteration.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from apg.training import TrainConfig, Trainer
from pipeline import tracking
from pipeline.diskfull import report_disk_full
from pipeline.runs.loop import DONE, HISTORY, Callback, Outcome, cell_identity, drive, mark_done, write_cell
from pipeline.runs.trial import RESUME, MlflowRows, TuneReports, begin, trial_rows

ATTEMPTS = "attempts.jsonl"
FAULT_ENV = "APG_FAULT_INJECT"
DISK_FULL_FAULT = ":disk-full"


class InjectedFault(RuntimeError):
    """Raised by a trial on purpose (``APG_FAULT_INJECT``), to test recovery."""


def tune_trainable(
    config: dict[str, Any], cells: dict[str, dict[str, Any]], data: dict[str, Any] | None = None
) -> None:
    """What Tune runs: the grid searches over cell ids (short, readable in Tune's table);
    the cells' full configs (and the shipped data) come through ``tune.with_parameters``."""
    cell = cells[config["cell_id"]]
    try:
        train_cell(cell, data)
    except Exception as err:
        report_disk_full(err, cell["cell_dir"])  # a full disk stops the sweep, not a retry
        raise


def _fault_iteration(config: dict[str, Any]) -> int | None:
    spec = (config.get("fault") or "").removesuffix(DISK_FULL_FAULT)
    target, _, iteration = spec.rpartition(":")
    if target in (config["cell_id"], config["name"]) and iteration.isdigit():
        return int(iteration)
    return None


def train_cell(config: dict[str, Any], data: dict[str, Any] | None = None) -> None:
    """Ray Tune trainable: train one cell, report metrics, checkpoint, record its outputs."""
    cfg = TrainConfig.from_dict(config["train"])
    cell_dir = Path(config["cell_dir"])
    cell_dir.mkdir(parents=True, exist_ok=True)
    x = trial_rows(config["data"], data)
    trainer, history, attempts = begin(
        cfg, x, config["seed"], config["torch_threads"], cell_dir / ATTEMPTS, cell_dir / RESUME
    )
    mlflow = MlflowRows(tracking.client(config["tracking_uri"]), config["run_id"], history, attempts)
    outcome = drive(
        trainer,
        log_every=config["log_every"],
        checkpoint_every=config["checkpoint_every"],
        history=history,
        callbacks=[_InjectFault(config), mlflow, TuneReports(keep=cell_dir / RESUME)],
    )
    _finish_cell(config, cfg, trainer, outcome, mlflow, attempts)


class _InjectFault(Callback):
    """Right after the iteration ``APG_FAULT_INJECT`` names for this cell: raise once, or
    (``:disk-full``) fail with ``ENOSPC`` on every attempt, as a full disk would."""

    def __init__(self, config: dict[str, Any]):
        self.at, self.name = _fault_iteration(config), config["name"]
        self.disk_full = (config.get("fault") or "").endswith(DISK_FULL_FAULT)
        self.cell_dir = Path(config["cell_dir"])

    def after_step(self, trainer: Trainer) -> None:
        if trainer.iteration != self.at:
            return
        if self.disk_full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.cell_dir / RESUME))
        marker = self.cell_dir / f"fault-{self.at}"
        if not marker.exists():
            marker.touch()
            raise InjectedFault(f"injected fault after iteration {self.at} of {self.name}")


def _log_model(config: dict[str, Any], trainer: Trainer, identity: dict[str, Any]) -> None:
    """The trained model in MLflow's PyTorch format, in the cell's run. A model that will not
    pickle (a compiled graph) is a warning, not a failed cell: its weights are the run's
    ``model.pt`` artifact either way."""
    try:
        tracking.retry(
            lambda: tracking.log_model(
                config["tracking_uri"], config["run_id"], trainer.model, trainer.proposals, identity
            ),
            "logging the model",
        )
    except Exception as err:  # noqa: BLE001 -- see the docstring: nothing is lost
        tracking.warn(f"{config['name']}: model not logged in MLflow's format ({type(err).__name__}: {err})")


def _finish_cell(
    config: dict[str, Any],
    cfg: TrainConfig,
    trainer: Trainer,
    outcome: Outcome,
    mlflow: MlflowRows,
    attempts: list[dict[str, Any]],
) -> None:
    """Write the cell's outputs and send them to MLflow; ``done.json`` last, since it marks
    the cell finished (a cell whose records never reached the server is not finished)."""
    cell_dir = Path(config["cell_dir"])
    run_id = config["run_id"]
    identity = cell_identity(config)
    model_path, record = write_cell(cell_dir, cfg, trainer, outcome, identity, attempts)
    mlflow.log(trainer.iteration, {f"final_{k}": v for k, v in record["final"].items()})
    mlflow.logger.close()
    client = mlflow.client
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / DONE).write_text(json.dumps(record, indent=2))
        for path in (model_path, cell_dir / HISTORY, Path(tmp) / DONE):
            tracking.retry(lambda path=path: client.log_artifact(run_id, str(path)), f"uploading {path.name}")
    _log_model(config, trainer, identity)
    tracking.finish(client, run_id)
    mark_done(cell_dir, record)
    (cell_dir / RESUME).unlink(missing_ok=True)
