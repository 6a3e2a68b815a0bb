"""The training loop, written once: a sweep's trials (``pipeline.sweep.trial``), a search's
trials (``pipeline.search.stage``), cells trained in-process (``pipeline.recorded.direct``),
continuing runs (``pipeline.runs.execute``) and the CLI's ``train`` all build their trainer
with :func:`start` and train it with :func:`drive`, and differ only in the callbacks they pass.

The loop owns what every caller needs the same way: which steps read their metrics back
(every ``log_every``-th and the last, so that on a GPU the others only queue work), the
history rows (the step's metrics and the iterations per second since the last row), which
rows come with a checkpoint, the deadline, and the time taken. A cell's files, finished,
are written by :func:`write_cell` and marked done by :func:`mark_done`.

Callbacks see the trainer after each step (:meth:`Callback.after_step`: fault injection,
progress bars) and each history row (:meth:`Callback.on_row`: Tune reports, MLflow,
validation scores, printed progress), told whether the row is a checkpoint. Those that more
than one caller needs are the run layer's: :class:`PrintProgress` here, MLflow rows and Tune
reports for trials in :mod:`pipeline.runs.trial`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from apg.checkpoint import save_checkpoint
from apg.data import atomic_write
from apg.training import TrainConfig, Trainer
from pipeline.common import file_digest, seed_everything

DONE = "done.json"
MODEL = "model.pt"
HISTORY = "history.csv"


def start(
    cfg: TrainConfig, x: Any, device: Any = "cpu", seed: int = 0, state: dict[str, Any] | None = None
) -> Trainer:
    """The one place a cell's trainer is built, for every caller: seeded as every entry
    point seeds (``seed_everything``: the initial weights and the first batches are the
    seed's), then, for a run that resumes, its saved state loaded over it."""
    seed_everything(seed)
    trainer = Trainer(cfg, x, device)
    if state is not None:
        trainer.load_state_dict(state)
    return trainer


class Callback:
    """What a caller of :func:`drive` hooks into the loop; every hook does nothing here."""

    def after_step(self, trainer: Trainer) -> None:
        """After every step, before its row (if it has one) is made."""

    def on_row(self, trainer: Trainer, row: dict[str, float], history: list[dict], checkpoint: bool) -> None:
        """After a logged step's row is appended to ``history``; ``checkpoint``: this row is
        one the caller should save a checkpoint with (every ``checkpoint_every`` iterations and
        the last)."""


class PrintProgress(Callback):
    """Each row as one line: ``<label> step <i>/<iterations>: loss <loss>, <seconds> s/step``."""

    def __init__(self, label: str):
        self.label = label

    def on_row(self, trainer: Trainer, row: dict[str, float], history: list[dict], checkpoint: bool) -> None:
        print(
            f"{self.label} step {trainer.iteration}/{trainer.cfg.iterations}: "
            f"loss {row.get('loss', float('nan')):.4g}, {1.0 / row['it_per_s']:.3g} s/step",
            flush=True,
        )


@dataclasses.dataclass
class Outcome:
    """What :func:`drive` ran: the history rows (those it was given first), the seconds the
    loop took, and whether it stopped at the deadline before the last iteration."""

    history: list[dict[str, float]]
    seconds: float
    stopped_at_deadline: bool


def drive(
    trainer: Trainer,
    *,
    log_every: int,
    checkpoint_every: int | None = None,
    history: Sequence[dict[str, float]] = (),
    deadline: float | None = None,
    until: int | None = None,
    callbacks: Sequence[Callback] = (),
) -> Outcome:
    """Train ``trainer`` from its current iteration to ``trainer.cfg.iterations``.

    ``history``: rows of an earlier, resumed part of the run, continued here.
    ``checkpoint_every``: which rows are checkpoints (the last one always is); ``None``:
    only the last. ``deadline``: a ``time.time()`` after which the loop stops, after a
    step that then gets a row of its own (read back late if it was not a logged one).
    ``until``: stop at this iteration instead (a part of the run; its last step is a
    checkpoint row like the run's last).
    """
    total = trainer.cfg.iterations if until is None else min(until, trainer.cfg.iterations)
    rows = list(history)
    start = window = time.perf_counter()
    window_iters = 0
    stopped = False
    while trainer.iteration < total:
        done = trainer.iteration + 1
        metrics = trainer.step(log=done % log_every == 0 or done == total)
        window_iters += 1
        for callback in callbacks:
            callback.after_step(trainer)
        stopped = deadline is not None and time.time() > deadline and trainer.iteration < total
        if metrics is None and not stopped:
            continue
        if metrics is None:  # the step it stops after is logged too
            metrics = trainer.last_metrics()
        now = time.perf_counter()
        row = {"iteration": trainer.iteration, **metrics, "it_per_s": window_iters / (now - window)}
        window, window_iters = now, 0
        rows.append(row)
        last = trainer.iteration == total or stopped
        checkpoint = last or (checkpoint_every is not None and trainer.iteration % checkpoint_every == 0)
        for callback in callbacks:
            callback.on_row(trainer, row, rows, checkpoint)
        if stopped:
            break
    return Outcome(rows, time.perf_counter() - start, stopped)


def cell_identity(job: dict[str, Any]) -> dict[str, Any]:
    """A cell's identity in its ``done.json`` and MLflow model: its cell id, name, config key
    and fingerprint (what the code that trained it computes)."""
    return {key: job[key] for key in ("cell_id", "name", "config_key", "fingerprint")}


def write_cell(
    cell_dir: Path,
    cfg: TrainConfig,
    trainer: Trainer,
    outcome: Outcome,
    identity: dict[str, Any],
    attempts: list[dict[str, Any]],
) -> tuple[Path, dict[str, Any]]:
    """Write a trained cell's ``model.pt`` (weights only) and ``history.csv``; return the
    model's path and the cell's ``done.json`` record (``identity``: :func:`cell_identity`),
    for the caller to add to and to mark with :func:`mark_done` once everything else it owes
    (uploads) is done."""
    model_path = save_checkpoint(cell_dir / MODEL, cfg.to_dict(), trainer.weights())
    write_history(cell_dir / HISTORY, outcome.history)
    rates = [row["it_per_s"] for row in outcome.history]
    record = {
        **identity,
        "iterations": trainer.iteration,
        "seconds_this_run": outcome.seconds,
        "mean_it_per_s": sum(rates) / len(rates) if rates else None,
        "final": final_metrics(outcome.history),
        "checkpoint_sha256": file_digest(model_path),
        "attempts": attempts,
    }
    return model_path, record


def final_metrics(history: Sequence[dict[str, float]]) -> dict[str, float]:
    """The last row's metrics, without its iteration; ``{}`` for an empty history."""
    return {k: v for k, v in (history[-1] if history else {}).items() if k != "iteration"}


def write_history(path: Path, rows: Sequence[dict[str, float]]) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "w", newline="") as f:
            if rows:
                writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)

    atomic_write(path, write)


def mark_done(cell_dir: Path, record: dict[str, Any]) -> None:
    """Write ``done.json``, atomically and last: its presence is what makes a cell finished."""
    text = json.dumps(record, indent=2)
    atomic_write(cell_dir / DONE, lambda tmp: tmp.write_text(text))
