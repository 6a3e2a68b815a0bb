"""A training run as a Ray Tune trial, the same for both planners that run trials (the
sweep's cells, ``pipeline.sweep.trial``; the search's settings, ``pipeline.search.stage``).

:func:`begin` is a trial's setup: its process quieted, its torch threads, the GPU Ray gave it
(if any), its trainer built by :func:`pipeline.runs.loop.start` (seeded, and resumed from
Tune's checkpoint, else from a file of the caller's), and a line in its attempts file. The
training data comes through Ray's object store when small enough (:func:`shipped_data` in the
driver, :func:`trial_rows` in the trial), else from a path every node sees.

Two callbacks of the loop: :class:`MlflowRows` sends each row to the trial's MLflow run from
the trial (``tracking.RunLogger``: buffered while the server is away, no step sent twice),
:class:`TuneReports` reports each row to Tune, a checkpoint row with a checkpoint. A
checkpoint holds the trainer's state and the history rows so far.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from apg.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from apg.data import IN_MEMORY_MAX_BYTES, load_dataset, training_rows
from apg.training import TrainConfig, Trainer
from pipeline import tracking
from pipeline.errors import SweepError
from pipeline.runs.loop import Callback, start

RESUME = "resume.pt"  # a checkpoint's file, in Tune's checkpoint and where a caller keeps its own


def quiet_trial_process() -> None:
    """In a trial's process: no line per checkpoint, and no traceback when the trial is stopped.

    Ray Train logs "Checkpoint successfully created at ..." at INFO for every report with a
    checkpoint (dozens per cell); the sweep's progress line and each cell's ``attempts.jsonl``
    already say where it is. A trial that Tune stops (ASHA, the end of a search) gets SIGTERM,
    and Ray's handler raises ``SystemExit`` in whatever runs then; inside a garbage-collector
    callback Python cannot raise it and prints "Exception ignored in: ... SystemExit: 1" with
    a traceback, though nothing went wrong. That one case is dropped; any other unraisable
    exception is printed as before."""
    import logging
    import sys

    for name in ("ray.train._internal.storage", "ray.train.v2._internal.execution.storage"):
        logging.getLogger(name).setLevel(logging.WARNING)
    sys.unraisablehook = _unraisable_unless_stopped


def _unraisable_unless_stopped(unraisable: Any) -> None:
    import sys

    if isinstance(unraisable.exc_value, SystemExit):
        return
    sys.__unraisablehook__(unraisable)


def shipped_data(path: Path) -> dict[str, Any] | None:
    """In the driver: the training arrays, when small enough to travel with the trials (and
    so nodes need no copy of the project)."""
    if path.stat().st_size > IN_MEMORY_MAX_BYTES:
        return None
    return {"x": load_dataset(path)["x"]}


def trial_rows(path: str, shipped: dict[str, Any] | None = None):
    """In the trial: the training set, from what the driver shipped or else from ``path``."""
    if shipped is not None:
        return torch.from_numpy(np.array(shipped["x"]))  # a writable copy of the shipped array
    if Path(path).is_file():
        return training_rows(path)
    raise SweepError(
        f"training data {path} is not on node {socket.gethostname()}; put the project on storage every node sees"
    )


def begin(
    cfg: TrainConfig, x: Any, seed: int, threads: int, attempts: Path, fallback: Path | None = None
) -> tuple[Trainer, list[dict[str, float]], list[dict[str, Any]]]:
    """A trial's trainer, on the GPU Ray gave the trial (if any) and resumed from Tune's
    checkpoint, else from ``fallback`` (the caller's own copy of it); the history rows it
    resumes with; and every attempt so far, this one appended to ``attempts``."""
    import ray
    from ray import tune

    quiet_trial_process()
    torch.set_num_threads(threads)
    # Ray sets CUDA_VISIBLE_DEVICES to the GPUs it assigned, but no longer hides GPUs
    # from trials that asked for none: only use a GPU that Ray gave this trial.
    device = "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"
    resumed = resume_state(tune.get_checkpoint(), fallback)
    trainer = start(cfg, x, device, seed, resumed["trainer"] if resumed is not None else None)
    history = list(resumed["history"]) if resumed is not None else []
    return trainer, history, record_attempt(attempts, trainer.iteration)


def resume_state(checkpoint, fallback: Path | None = None) -> dict[str, Any] | None:
    """Where a trial resumes: Tune's checkpoint, else ``fallback``; a damaged ``fallback`` is
    removed, said, and the trial starts over."""
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            return load_checkpoint(Path(d) / RESUME)[1]
    if fallback is not None and fallback.is_file():
        try:
            return load_checkpoint(fallback)[1]
        except CheckpointError as err:
            print(f"{fallback} is damaged ({err}); the cell starts over", flush=True)
            fallback.unlink(missing_ok=True)
    return None


def record_attempt(path: Path, start_iteration: int) -> list[dict[str, Any]]:
    """Append where and from which iteration this attempt runs to ``path``; return all attempts."""
    import ray

    entry = {
        "node_id": ray.get_runtime_context().get_node_id(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "start_iteration": start_iteration,
        "time": time.time(),
    }
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")
    return read_attempts(path)


def read_attempts(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MlflowRows(Callback):
    """Each row to the trial's MLflow run. Made, it tags the run with the nodes its attempts
    ran on and re-sends the rows of the history it resumes with: the server may lack some
    (it was down, then the trial died); those it has, the logger drops."""

    def __init__(self, client, run_id: str, history: list[dict[str, float]], attempts: list[dict[str, Any]]):
        self.client = client
        self.logger = tracking.RunLogger(self.client, run_id)
        self.logger.set_tag("apg.nodes", ",".join(a["node_id"][:12] for a in attempts))
        for row in history:
            self.log(row["iteration"], row)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.logger.log(step, {k: v for k, v in metrics.items() if k != "iteration"})

    def on_row(self, trainer: Trainer, row: dict[str, float], history: list[dict], checkpoint: bool) -> None:
        self.log(trainer.iteration, row)


class TuneReports(Callback):
    """Each row to Tune; a checkpoint row with Tune's checkpoint (what a restarted trial
    resumes from), also written to ``keep`` when given (a copy that outlives Tune's state)."""

    def __init__(self, keep: Path | None = None):
        self.keep = keep

    def on_row(self, trainer: Trainer, row: dict[str, float], history: list[dict], checkpoint: bool) -> None:
        from ray import tune

        if not checkpoint:
            tune.report(row)
            return
        state = {"trainer": trainer.state_dict(), "history": history}
        if self.keep is not None:
            save_checkpoint(self.keep, trainer.cfg.to_dict(), state)
        with tempfile.TemporaryDirectory() as tmp:
            save_checkpoint(Path(tmp) / RESUME, trainer.cfg.to_dict(), state)
            tune.report(row, checkpoint=tune.Checkpoint.from_directory(tmp))
