"""The paper's Bouncing MNIST training as one long run that any machine continues.

The paper trains APG on 60,000 three-digit videos (T=10, K=5, L=10, batch 10) for 200,000
steps: days on two CPU cores, hours on a GPU, and neither is had in one sitting. ``apg-pipeline
long-run`` continues the run from where it stopped, for as long as it is given, and keeps its
whole state in ``recorded/bmnist-long/``, for git:

- ``run.json``: what the run is, fixed at its start: the training config (the ``paper``
  profile's Bouncing MNIST APG cell), the training videos (``VideoRows``: the 60,000 made
  when read, so no machine writes an 11 GB file first), the held-out set and the cadences;
- ``state.pt``: all a continuation needs (model and proposal weights, Adam's moments, the data
  order and its cursor, the random state, the step count), rewritten at every checkpoint,
  in ``pipeline.compact``'s 20 MB form; beside it, ``full-state.pt`` (not in git) is the same
  state unquantized, which a continuation on the machine that wrote it starts from;
- ``history.csv``: a row per logged step (the step's metrics, its rate and the device);
- ``evals.csv``: every ``eval_every`` steps, the position error on the held-out T10_D3 videos
  (the ``paper`` profile's set, first ``eval_videos`` of it), with the training seconds so far;
- ``segments.csv``: one row per sitting: its first and last step, seconds, device (a CPU's
  with its torch threads), machine and commit.

At a checkpoint the tables are written before the state, and a continuation drops rows past
the state's step, so a sitting killed anywhere leaves a consistent run. Held-out scoring
draws from a random stream of its own, so it never moves the training's: continuing from the
full state on the same kind of device is exact (the steps of an unbroken run); from the
committed one, the run continues with its weights and moments perturbed once (by the
rounding ``pipeline.compact`` documents); on another device, that device's arithmetic and
random streams take over.
"""

from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from apg.checkpoint import load_checkpoint, save_checkpoint
from apg.data import atomic_write
from apg.tasks.bmnist.simulator import VideoRows
from apg.training import TrainConfig, Trainer
from pipeline.common import seed_everything
from pipeline.compact import compact, expand
from pipeline.config import grid_cells
from pipeline.driver import Callback, drive, write_history
from pipeline.evaluate_particles import tracking_errors
from pipeline.generate import simulate_set
from pipeline.provenance import device_line, git_commit, utc_now

RUN_DIR = Path("recorded") / "bmnist-long"  # APG's run; a baseline's: ``run_dir_of(method)``
RUN, STATE, HISTORY, EVALS, SEGMENTS = "run.json", "state.pt", "history.csv", "evals.csv", "segments.csv"
FULL_STATE = "full-state.pt"  # the same state unquantized, for this machine only (not in git)
PROFILE, TEST_SET, METHOD, PAIR, SEED = "paper", "T10_D3", "apg", (5, 10), 0
EVAL_SEED = 12345  # held-out scoring's own random stream (the same particles for the same weights)


def run_dir_of(method: str = METHOD) -> Path:
    """A method's long run, relative to the project: APG's ``recorded/bmnist-long``, a
    baseline's (trained the same way, for the comparison) ``recorded/bmnist-long-<method>``."""
    return RUN_DIR if method == METHOD else RUN_DIR.with_name(f"{RUN_DIR.name}-{method}")


def new_run(
    profile: str = PROFILE,
    eval_videos: int = 100,
    every: dict[str, int] | None = None,
    method: str = METHOD,
) -> dict[str, Any]:
    """``run.json`` of a new run: ``profile``'s Bouncing MNIST cell of ``method`` (K=5, L=10,
    seed 0) and its training and ``T10_D3`` sets; ``every``: the cadences (log, checkpoint,
    eval). A baseline's run shares APG's videos, data order, seed and cadences, so their
    curves compare step for step."""
    from pipeline import profiles

    params = profiles.resolve(profile)
    section = params["bmnist"]
    cells = [
        c
        for c in grid_cells(params, "bmnist")
        if (c.method, c.sweeps, c.particles, c.seed) == (method, *PAIR, SEED)
    ]
    if not cells:
        raise ValueError(
            f"profile {profile!r} trains no Bouncing MNIST {method} cell at K, L = {PAIR}, seed {SEED}"
        )
    tests = [t for t in section["data"].get("tests", []) if t.get("name") == TEST_SET]
    if not tests:
        raise ValueError(f"profile {profile!r} has no Bouncing MNIST held-out set {TEST_SET}")
    every = {"log": 25, "checkpoint": 50, "eval": 250, **(every or {})}
    for name in ("checkpoint", "eval"):
        if every[name] % every["log"]:
            raise ValueError(f"{name} every {every[name]} steps: not a multiple of log every {every['log']}")
    train = section["data"]["train"]
    return {
        "profile": profile,
        "train": cells[0].train.to_dict(),
        "seed": SEED,
        "rows": {"num_videos": train["num_datasets"], "seed": train["seed"], **train.get("sizes", {})},
        "eval": {
            "name": TEST_SET,
            "num_videos": min(eval_videos, tests[0]["num_datasets"]),
            "seed": tests[0]["seed"],
            "sizes": tests[0].get("sizes", {}),
            "x_dtype": section["data"].get("x_dtype", "float32"),
            "model": section.get("model", {}),
        },
        "every": every,
        "started": utc_now(),
    }


def run_method(run_dir: Path) -> str | None:
    """The method the run in ``run_dir`` trains (``None``: no run there)."""
    path = run_dir / RUN
    return json.loads(path.read_text())["train"]["method"] if path.is_file() else None


def training_rows(run: dict[str, Any]) -> VideoRows:
    rows = run["rows"]
    return VideoRows(
        rows["num_videos"],
        rows["seed"],
        num_frames=rows.get("num_frames", 10),
        num_digits=rows.get("num_digits", 3),
        split=rows.get("split", "train"),
    )


def held_out(run: dict[str, Any]) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """The held-out videos ``x`` of the run's curve and their true positions."""
    ev = run["eval"]
    return simulate_videos(run, ev["num_videos"], ev["seed"], ev["sizes"])


def simulate_videos(
    run: dict[str, Any], num_videos: int, seed: int, sizes: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """Held-out videos ``x`` (as the profile's files store them: cast to its ``x_dtype``) and
    their true positions, from the run's simulator model."""
    ev = run["eval"]
    with torch.random.fork_rng(devices=[]):  # building the simulator's model draws its weights
        arrays = simulate_set("bmnist", ev["model"], num_videos, seed, sizes)
    x = torch.from_numpy(arrays["x"].astype(ev["x_dtype"])).to(torch.get_default_dtype())
    return x, {"z_where": arrays["z_where"], "centres": arrays["centres"]}


def restore(
    run: dict[str, Any],
    run_dir: Path,
    device: str = "cpu",
    compile: bool = False,
    state_file: Path | None = None,
) -> Trainer:
    """The run's trainer at its latest state (at step 0 before the first checkpoint), or at
    the checkpoint ``state_file`` (a committed state of an earlier step, say)."""
    seed_everything(run["seed"])
    cfg = TrainConfig.from_dict({**run["train"], "compile": compile}).validate()
    trainer = Trainer(cfg, training_rows(run), device)
    state = latest_state(run_dir) if state_file is None else expand(load_checkpoint(state_file)[1])
    if state is not None:
        trainer.load_state_dict(state)
    return trainer


def sem(values: np.ndarray) -> float:
    """Standard error of the mean over videos (NaN for one video)."""
    return float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else float("nan")


def score(
    trainer: Trainer, x: torch.Tensor, truth: dict[str, np.ndarray], batch_size: int = 10
) -> dict[str, float]:
    """Mean position error (px) of the highest-weight particle after the last sweep, with its
    standard error over videos, and the tracked-frame fraction; from a random stream of its own."""
    cfg = trainer.cfg
    cuda = trainer.device.type == "cuda"
    devices = (
        [trainer.device.index if trainer.device.index is not None else torch.cuda.current_device()]
        if cuda
        else []
    )
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(EVAL_SEED)
        curves = tracking_errors(
            cfg,
            trainer.model,
            trainer.proposals,
            x,
            truth,
            cfg.sweeps,
            cfg.particles,
            batch_size,
            cfg.resample_mode,
        )
    err = curves["pos_err"][-1]
    return {
        "pos_err": float(err.mean()),
        "pos_err_sem": sem(err),
        "tracked": float(curves["tracked"][-1].mean()),
    }


def read_rows(path: Path, upto: int, key: str = "iteration") -> list[dict[str, Any]]:
    """A table's rows whose ``key`` is at most ``upto`` (numbers read as numbers, text kept)."""
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        rows = [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]
    return [r for r in rows if r[key] <= upto]


def _number(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


class _Sitting(Callback):
    """Scores, logs and checkpoints the run as it goes."""

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
        found = score(trainer, self.x, self.truth)
        seconds = self.seconds_before + time.perf_counter() - self.started
        self.evals.append(
            {
                "iteration": trainer.iteration,
                **found,
                "seconds": round(seconds, 1),
                "device": self.segment["device"],
            }
        )
        print(
            f"  step {trainer.iteration}: {self.run['eval']['name']} position error {found['pos_err']:.2f} px "
            f"(± {found['pos_err_sem']:.2f}), tracked {found['tracked']:.2f}",
            flush=True,
        )

    def on_row(self, trainer: Trainer, row: dict[str, float], history: list[dict], checkpoint: bool) -> None:
        row["device"] = self.segment["device"]  # type: ignore[assignment]
        total = self.run["train"]["iterations"]
        print(
            f"step {trainer.iteration}/{total}: loss {row.get('loss', float('nan')):.4g}, "
            f"{1.0 / row['it_per_s']:.2f} s/step",
            flush=True,
        )
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


def sitting_device(device: str | torch.device) -> str:
    """The device a sitting names in the run's tables; on a CPU with the torch threads it ran
    on, since a CPU's seconds per step depend on them (the report's rates are per device)."""
    line = device_line(device)
    return line if torch.device(device).type == "cuda" else f"{line}; {torch.get_num_threads()} torch threads"


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


def long_run(
    root: Path,
    minutes: float | None = None,
    steps: int | None = None,
    device: str = "cpu",
    compile: bool = False,
    run_dir: Path | None = None,
    new: dict[str, Any] | None = None,
    full_state: bool = True,
) -> dict[str, Any]:
    """Continue (or start, with ``new``'s ``run.json``) the long run for ``minutes`` of wall
    time or ``steps`` steps, whichever ends first; return its last segment's row.

    ``full_state=False`` writes only the compact state at each checkpoint (a machine whose
    copy is thrown away after the sitting has no use for the 60 MB unquantized one)."""
    run_dir = run_dir or root / RUN_DIR
    if (run_dir / RUN).is_file():
        if new is not None:
            raise ValueError(f"{run_dir / RUN}: a long run is there already; continue it without --start")
        run = json.loads((run_dir / RUN).read_text())
    elif new is None:
        raise FileNotFoundError(f"{run_dir / RUN}: no long run there; start one with --start")
    else:
        run = new
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(run_dir / RUN, lambda tmp: tmp.write_text(json.dumps(run, indent=2) + "\n"))
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
    segment = {
        "from_iteration": done,
        "to_iteration": done,
        "seconds": 0.0,
        "device": sitting_device(trainer.device),
        "compiled": compile,
        # a copy of the tree without its git history (a GPU machine's) names it in APG_COMMIT
        "commit": os.environ.get("APG_COMMIT") or git_commit(root),
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
        callbacks=[sitting],
    )
    if trainer.iteration == done:  # nothing trained: still record the sitting's first evaluation
        sitting.save(trainer, history)
    return segment
