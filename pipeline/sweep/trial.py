"""What a sweep's Ray Tune trial runs for one cell (``pipeline.sweep.stage`` schedules them): the
cell's data (shipped through Ray's object store or read from shared storage), its resumed
state (Tune's checkpoint, else the cell's own ``resume.pt``), the training loop of
``pipeline.runs.loop`` with Tune reports, MLflow rows and checkpoints, then the cell's files
(``done.json`` last) and their upload to its MLflow run.

Fault injection, for tests only: ``APG_FAULT_INJECT="<cell name or id>:<iteration>"`` in the
sweep driver's environment makes that cell's trial raise once, right after that iteration.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from apg.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from apg.data import training_rows
from apg.training import TrainConfig, Trainer
from pipeline import tracking
from pipeline.diskfull import report_disk_full
from pipeline.errors import SweepError
from pipeline.runs.loop import DONE, HISTORY, Callback, Outcome, drive, mark_done, start, write_cell
from pipeline.sweep.ray_setup import quiet_trial_process

RESUME = "resume.pt"
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


def _record_attempt(cell_dir: Path, start_iteration: int) -> list[dict[str, Any]]:
    """Append where and from which iteration this attempt runs; return all attempts."""
    import ray

    entry = {
        "node_id": ray.get_runtime_context().get_node_id(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "start_iteration": start_iteration,
        "time": time.time(),
    }
    with open(cell_dir / ATTEMPTS, "a") as f:
        f.write(json.dumps(entry) + "\n")
    return read_attempts(cell_dir)


def read_attempts(cell_dir: Path) -> list[dict[str, Any]]:
    path = cell_dir / ATTEMPTS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_cell(config: dict[str, Any], data: dict[str, Any] | None = None) -> None:
    """Ray Tune trainable: train one cell, report metrics, checkpoint, record its outputs."""
    import numpy as np
    import ray
    from ray import tune

    quiet_trial_process()
    torch.set_num_threads(config["torch_threads"])
    cfg = TrainConfig.from_dict(config["train"])
    cell_dir = Path(config["cell_dir"])
    cell_dir.mkdir(parents=True, exist_ok=True)
    # Ray sets CUDA_VISIBLE_DEVICES to the GPUs it assigned, but no longer hides GPUs
    # from trials that asked for none: only use a GPU that Ray gave this trial.
    device = "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"
    if data is not None:
        x = torch.from_numpy(np.array(data["x"]))  # a writable copy of the shipped array
    elif Path(config["data"]).is_file():
        x = training_rows(config["data"])
    else:
        raise SweepError(
            f"training data {config['data']} is not on node {socket.gethostname()}; "
            "put the project on storage every node sees"
        )
    resumed = _resume_state(tune.get_checkpoint(), cell_dir / RESUME)
    trainer = start(cfg, x, device, config["seed"], resumed["trainer"] if resumed is not None else None)
    history: list[dict[str, float]] = list(resumed["history"]) if resumed is not None else []
    attempts = _record_attempt(cell_dir, trainer.iteration)

    client = tracking.client(config["tracking_uri"])
    logger = tracking.RunLogger(client, config["run_id"])
    logger.set_tag("apg.nodes", ",".join(a["node_id"][:12] for a in attempts))
    # Rows of the checkpoint's history the server may not have (it was down, then this
    # trial died): re-sent; the ones it has are dropped by the logger.
    for row in history:
        logger.log(row["iteration"], {k: v for k, v in row.items() if k != "iteration"})
    outcome = drive(
        trainer,
        log_every=config["log_every"],
        checkpoint_every=config["checkpoint_every"],
        history=history,
        callbacks=[_InjectFault(config), _TuneReports(cell_dir / RESUME, cfg, logger)],
    )
    _finish_cell(config, cfg, trainer, outcome, client, logger)


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


class _TuneReports(Callback):
    """Each row to MLflow and to Tune; a checkpoint row also to the cell's ``resume.pt`` and
    as Tune's checkpoint (what a restarted trial resumes from)."""

    def __init__(self, resume: Path, cfg: TrainConfig, logger: tracking.RunLogger):
        self.resume, self.cfg, self.logger = resume, cfg, logger

    def on_row(self, trainer: Trainer, row: dict[str, float], history: list[dict], checkpoint: bool) -> None:
        from ray import tune

        self.logger.log(trainer.iteration, {k: v for k, v in row.items() if k != "iteration"})
        if not checkpoint:
            tune.report(row)
            return
        state = {"trainer": trainer.state_dict(), "history": history}
        save_checkpoint(self.resume, self.cfg.to_dict(), state)
        with tempfile.TemporaryDirectory() as tmp:
            save_checkpoint(Path(tmp) / RESUME, self.cfg.to_dict(), state)
            tune.report(row, checkpoint=tune.Checkpoint.from_directory(tmp))


def _resume_state(checkpoint, fallback: Path) -> dict[str, Any] | None:
    """Where an unfinished cell resumes: Tune's checkpoint, else the cell's own ``resume.pt``;
    a damaged ``resume.pt`` is removed, said, and the cell starts over."""
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            return load_checkpoint(Path(d) / RESUME)[1]
    if fallback.is_file():
        try:
            return load_checkpoint(fallback)[1]
        except CheckpointError as err:
            print(f"{fallback} is damaged ({err}); the cell starts over", flush=True)
            fallback.unlink(missing_ok=True)
    return None


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
    client,
    logger: tracking.RunLogger,
) -> None:
    """Write the cell's outputs and send them to MLflow; ``done.json`` last, since it marks
    the cell finished (a cell whose records never reached the server is not finished)."""
    cell_dir = Path(config["cell_dir"])
    run_id = config["run_id"]
    identity = {
        "cell_id": config["cell_id"],
        "name": config["name"],
        "config_key": config.get("config_key"),
        "fingerprint": config.get("fingerprint"),  # what the code that trained it computes
    }
    model_path, record = write_cell(cell_dir, cfg, trainer, outcome, identity, read_attempts(cell_dir))
    logger.log(trainer.iteration, {f"final_{k}": v for k, v in record["final"].items()})
    logger.close()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / DONE).write_text(json.dumps(record, indent=2))
        for path in (model_path, cell_dir / HISTORY, Path(tmp) / DONE):
            tracking.retry(lambda path=path: client.log_artifact(run_id, str(path)), f"uploading {path.name}")
    _log_model(config, trainer, identity)
    tracking.finish(client, run_id)
    mark_done(cell_dir, record)
    (cell_dir / RESUME).unlink(missing_ok=True)
