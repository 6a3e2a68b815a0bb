"""The executor: advance a run from its latest state for some minutes or steps.

A run's folder holds, beside ``run.json`` (:mod:`pipeline.runs.spec`):

- ``state.pt``: all a continuation needs (weights, Adam's moments, the data order and its
  cursor, the random state, the step count), rewritten at every checkpoint in
  :mod:`pipeline.runs.compact`'s form (a third of the bytes, for git); beside it,
  ``full-state.pt`` (not in git) is the same state unquantized, which a continuation on the
  machine that wrote it starts from;
- ``history.csv``: a row per logged step (the step's metrics, its rate and the device);
- ``evals.csv``: every ``every.eval`` steps, the held-out score with the training seconds so
  far: the position error of the highest-weight particle for a task that tracks objects
  (Bouncing MNIST), else the final sweep's log joint and ESS;
- ``segments.csv``: one row per sitting: its first and last step, seconds, device (a CPU's
  with its torch threads), whether compiled, the commit and the times it started and ended.

At a checkpoint the tables are written before the state, and a continuation drops rows past
the state's step, so a sitting killed anywhere leaves a consistent run. Held-out scoring
draws from a random stream of its own, so it never moves the training's: continuing from the
full state on the same kind of device is exact (the steps of an unbroken run); from the
committed one, the run continues with its weights and moments perturbed once (by the
rounding :mod:`pipeline.runs.compact` documents); on another device, that device's arithmetic
and random streams take over.
"""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from apg.checkpoint import load_checkpoint, save_checkpoint
from apg.particles import final_particle, particle_scores, tracking_errors
from apg.tasks import get_task
from apg.training import TrainConfig, Trainer, evaluate
from pipeline.config import checks
from pipeline.provenance.record import device_line, utc_now
from pipeline.provenance.stages import source_commit
from pipeline.runs.compact import compact, expand
from pipeline.runs.loop import Callback, PrintProgress, drive, start, write_history
from pipeline.runs.spec import (
    EVALS,
    FULL_STATE,
    HISTORY,
    RUN,
    SEGMENTS,
    STATE,
    count_and_sizes,
    held_out,
    read_run,
    training_rows,
    write_run,
)

EVAL_SEED = 12345  # held-out scoring's own random stream (the same particles for the same weights)


def restore(
    run: dict[str, Any],
    run_dir: Path,
    device: str = "cpu",
    compile: bool = False,
    state_file: Path | None = None,
) -> Trainer:
    """The run's trainer at its latest state (at step 0 before the first checkpoint), or at
    the checkpoint ``state_file`` (a committed state of an earlier step, say)."""
    cfg = TrainConfig.from_dict({**run["train"], "compile": compile}).validate()
    # model keys the task knows, network sizes in range: one line, not torch's traceback
    checks.networks(cfg, f"{run_dir / RUN}: train.model", f"{run_dir / RUN}: train.network")
    state = latest_state(run_dir) if state_file is None else expand(load_checkpoint(state_file)[1])
    return start(cfg, training_rows(run), device, run["seed"], state)


def latest_state(run_dir: Path) -> dict[str, Any] | None:
    """The run's state (``None`` before its first checkpoint): the full one this machine wrote
    when it is of the committed state's step, else the committed (compact) one, expanded."""
    if not (run_dir / STATE).is_file():
        return None
    committed = load_checkpoint(run_dir / STATE)[1]
    if (run_dir / FULL_STATE).is_file():
        full = load_checkpoint(run_dir / FULL_STATE)[1]
        if full["iteration"] == committed["iteration"]:
            return full
    return expand(committed)


def sem(values: np.ndarray) -> float:
    """Standard error of the mean over datasets (NaN for one dataset)."""
    return float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else float("nan")


def score(
    trainer: Trainer,
    x: torch.Tensor,
    arrays: dict[str, np.ndarray],
    run: dict[str, Any],
    batch_size: int = 10,
) -> dict[str, float]:
    """The held-out score after the last sweep, from a random stream of its own.

    For a task that tracks objects (Bouncing MNIST): the mean position error (px) of the
    highest-weight particle with its standard error over datasets, and the tracked-frame
    fraction. Else the final sweep's mean log joint (the cell's own model) with its standard
    error and mean ESS/L; and where the simulator's truth has assignments (the GMM, the rings),
    the highest-weight particle's ARI and, for a task scored under one common model (the
    rings: ``TaskSpec.common_log_joint``), its log joint under the simulator's model
    (``log_joint_true``: what the report's rings claims compare)."""
    cfg = trainer.cfg
    cuda = trainer.device.type == "cuda"
    devices = (
        [trainer.device.index if trainer.device.index is not None else torch.cuda.current_device()]
        if cuda
        else []
    )
    tracking = get_task(cfg.task).tracking
    args = (trainer.model, trainer.proposals, x)
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(EVAL_SEED)
        if tracking is not None:
            budget = (cfg.sweeps, cfg.particles, batch_size, cfg.resample_mode)
            curves = tracking_errors(cfg, *args, tracking.truth(arrays), *budget)
            err = curves["pos_err"][-1]
            return {
                "pos_err": float(err.mean()),
                "pos_err_sem": sem(err),
                "tracked": float(curves["tracked"][-1].mean()),
            }
        curves = evaluate(cfg, *args, cfg.sweeps, cfg.particles, batch_size, cfg.resample_mode)
        joint = curves["log_joint"][-1]
        found = {
            "log_joint": float(joint.mean()),
            "log_joint_sem": sem(joint),
            "ess": float(curves["ess"][-1].mean()),
        }
        if "c" in arrays:
            particle = final_particle(cfg, *args, cfg.sweeps, cfg.particles, batch_size, cfg.resample_mode)
            truth = {
                "arrays": {**arrays, "x": x.numpy()},
                "c": arrays["c"].astype(np.int64),
                "ari_ceiling": None,
            }
            sizes = count_and_sizes(run["eval"])[1]
            scores = particle_scores(cfg.task, truth, particle, run["eval"].get("model", {}), sizes)
            for name in ("log_joint_true", "ari"):
                if name in scores:
                    found[name] = float(np.mean(scores[name]))
                    found[f"{name}_sem"] = sem(scores[name])
    return found


def read_rows(path: Path, upto: float = float("inf"), key: str = "iteration") -> list[dict[str, Any]]:
    """A table's rows whose ``key`` is at most ``upto`` (numbers read as numbers, text kept;
    none when there is no file)."""
    if not path.is_file():
        return []
    try:
        with open(path, newline="") as f:
            raw = list(csv.DictReader(f, strict=True))
        # a row cut short (fields missing: None) or run on (a None key) is not one the run wrote
        if any(None in row or None in row.values() for row in raw):
            raise csv.Error("a row whose fields do not match the header")
        rows = [{k: _number(v) for k, v in row.items()} for row in raw]
        return [r for r in rows if r[key] <= upto]
    except (UnicodeDecodeError, KeyError, TypeError, csv.Error) as err:
        raise ValueError(f"{path}: not a run's table ({type(err).__name__}: {err})") from None


def _number(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def sitting_device(device: str | torch.device) -> str:
    """The device a sitting names in the run's tables; on a CPU with the torch threads it ran
    on, since a CPU's seconds per step depend on them (the report's rates are per device)."""
    line = device_line(device)
    return line if torch.device(device).type == "cuda" else f"{line}; {torch.get_num_threads()} torch threads"


class _Sitting(Callback):
    """Scores and checkpoints the run as it goes."""

    def __init__(
        self,
        run_dir: Path,
        run: dict[str, Any],
        segment: dict[str, Any],
        past: dict[str, list],
        full_state: bool = True,
    ):
        self.dir, self.run, self.segment, self.full_state = run_dir, run, segment, full_state
        self.evals, self.segments = past["evals"], past["segments"]
        self.x, self.truth = held_out(run)
        self.started = time.perf_counter()
        self.seconds_before = sum(float(s["seconds"]) for s in self.segments)

    def evaluate(self, trainer: Trainer) -> None:
        found = score(trainer, self.x, self.truth, self.run)
        seconds = self.seconds_before + time.perf_counter() - self.started
        self.evals.append(
            {
                "iteration": trainer.iteration,
                **found,
                "seconds": round(seconds, 1),
                "device": self.segment["device"],
            }
        )
        shown = ", ".join(f"{k} {v:.4g}" for k, v in found.items())
        print(f"  step {trainer.iteration}: {self.run['eval']['name']} {shown}", flush=True)

    def on_row(self, trainer: Trainer, row: dict[str, float], history: list[dict], checkpoint: bool) -> None:
        row["device"] = self.segment["device"]  # type: ignore[assignment]
        if trainer.iteration % self.run["every"]["eval"] == 0:
            self.evaluate(trainer)
        if checkpoint or trainer.iteration % self.run["every"]["checkpoint"] == 0:
            self.save(trainer, history)

    def save(self, trainer: Trainer, history: list[dict]) -> None:
        self.segment.update(
            to_iteration=trainer.iteration,
            seconds=round(time.perf_counter() - self.started, 1),
            ended=utc_now(),
        )
        write_history(self.dir / HISTORY, history)
        write_history(self.dir / EVALS, self.evals)
        write_history(self.dir / SEGMENTS, [*self.segments, self.segment])
        state = trainer.state_dict()
        if self.full_state:
            save_checkpoint(self.dir / FULL_STATE, trainer.cfg.to_dict(), state)
        else:  # a stale full state must not outlive the compact one it no longer matches
            (self.dir / FULL_STATE).unlink(missing_ok=True)
        save_checkpoint(self.dir / STATE, trainer.cfg.to_dict(), compact(state))  # last: see the module


def check_sitting(minutes: float | None, steps: int | None, device: str) -> None:
    """A sitting's length and device, checked before any run's folder is read."""
    checks.minutes(minutes, "--minutes")
    if steps is not None:
        checks.integer(steps, "--steps", low=1)
    checks.device(device)


def advance(
    root: Path,
    run_dir: Path,
    minutes: float | None = None,
    steps: int | None = None,
    device: str = "cpu",
    compile: bool = False,
    new: dict[str, Any] | None = None,
    full_state: bool = True,
) -> dict[str, Any]:
    """Continue the run in ``run_dir`` (or start it, with ``new``'s ``run.json``) for
    ``minutes`` of wall time or ``steps`` steps, whichever ends first (at the run's last
    step at the latest); return its sitting's segment row.

    ``full_state=False`` writes only the compact state at each checkpoint (a machine whose
    copy is thrown away after the sitting has no use for the unquantized one)."""
    check_sitting(minutes, steps, device)
    if (run_dir / RUN).is_file():
        if new is not None:
            raise ValueError(f"{run_dir / RUN}: a run is there already; continue it without --start")
        run = read_run(run_dir)
    elif new is None:
        raise FileNotFoundError(f"{run_dir / RUN}: no run there; start one with --start")
    else:
        run = {**new, "started": utc_now()}
        write_run(run_dir, run)
    trainer = restore(run, run_dir, device, compile)
    done = trainer.iteration
    segments = [
        s
        for s in read_rows(run_dir / SEGMENTS, done, "from_iteration")
        if s["to_iteration"] > s["from_iteration"]
    ]
    for s in segments:  # a sitting killed between its tables and its state ends at the state
        s["to_iteration"] = min(s["to_iteration"], done)
    past = {"evals": read_rows(run_dir / EVALS, done), "segments": segments}
    history = read_rows(run_dir / HISTORY, done)
    if done and not history:  # the state is past its first logged step: its rows are gone
        raise ValueError(f"{run_dir / HISTORY}: no rows up to step {done}, where the run's state is")
    segment = {
        "from_iteration": done,
        "to_iteration": done,
        "seconds": 0.0,
        "device": sitting_device(trainer.device),
        "compiled": compile,
        "commit": source_commit(root),
        "started": utc_now(),
        "ended": "",
    }
    sitting = _Sitting(run_dir, run, segment, past, full_state)
    if done == 0 and not past["evals"]:
        sitting.evaluate(trainer)  # the curve's first point: the untrained networks
    deadline = None if minutes is None else time.time() + 60.0 * minutes
    until = None if steps is None else done + steps
    drive(
        trainer,
        log_every=run["every"]["log"],
        history=history,
        deadline=deadline,
        until=until,
        callbacks=[PrintProgress(run_dir.name), sitting],
    )
    if trainer.iteration == done:  # nothing trained: still record the sitting's first evaluation
        sitting.save(trainer, history)
    return segment
