"""What a continuing run is: its ``run.json``, fixed when the run starts.

A run is one cell of a profile (task, method, K, L, seed and the cell's training config,
taken from the profile's grid as the sweep takes it), its training set, its held-out set and
its cadences:

- ``train``: the cell's ``TrainConfig`` (``iterations`` is the profile's: where the run ends);
- ``seed``: the cell's seed, set before the networks are built;
- ``rows``: the training set, simulated from the profile's ``data.train`` (its seed and
  sizes), so no machine needs a data file to continue: a set small enough is simulated whole
  when the run is restored; Bouncing MNIST's videos (11 GB at the paper's scale) are made
  when read (:class:`apg.tasks.bmnist.simulator.VideoRows`);
- ``eval``: the profile's first held-out set (``T10_D3`` for Bouncing MNIST, ``test`` for
  the others), scored every ``every.eval`` steps;
- ``every``: the cadences, in steps, of a history row (``log``), a checkpoint and an
  evaluation.

The Bouncing MNIST runs started before this module (``recorded/bmnist-long*``, named before
:func:`run_name`) wrote their rows as ``num_videos``, ``num_frames`` ...; :func:`training_rows`
and :func:`held_out` read both forms.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from apg.data import atomic_write
from apg.tasks import get_task
from pipeline.config import checks
from pipeline.config.params import evaluation_sets, grid_cells

RUN, STATE, HISTORY, EVALS, SEGMENTS = "run.json", "state.pt", "history.csv", "evals.csv", "segments.csv"
FULL_STATE = "full-state.pt"  # the same state unquantized, for the machine that wrote it (not in git)
EVERY = {"log": 25, "checkpoint": 50, "eval": 250}
RUNS_DIR = Path("recorded")  # where runs live, relative to the project


def _video_rows(num_datasets: int, seed: int, **sizes: Any):
    from apg.tasks.bmnist.simulator import VideoRows

    return VideoRows(num_datasets, seed, **sizes)


# Tasks whose training sets are made a row at a time when read (too large to hold).
PER_ROW = {"bmnist": _video_rows}


def run_name(profile: str, task: str, method: str, sweeps: int, particles: int, seed: int) -> str:
    """A new run's folder name under ``recorded/``: ``paper-dgmm-apg-K10-L10-s0``."""
    return f"{profile}-{task}-{method}-K{sweeps}-L{particles}-s{seed}"


def parse_cell(text: str) -> tuple[str, str, int, int, int]:
    """``dgmm/apg/K10/L10/seed0`` (a sweep cell's name) as ``(task, method, K, L, seed)``."""
    parts = text.strip("/").split("/")
    try:
        task, method, k, l, seed = parts
        if not (k[0] == "K" and l[0] == "L" and seed.startswith("seed")):
            raise ValueError
        return task, method, int(k[1:]), int(l[1:]), int(seed[4:])
    except ValueError:
        raise ValueError(
            f"cell {text!r}: name it as TASK/METHOD/K<k>/L<l>/seed<s>, e.g. dgmm/apg/K10/L10/seed0"
        ) from None


def new_run(
    profile: str,
    task: str,
    method: str,
    sweeps: int,
    particles: int,
    seed: int = 0,
    eval_size: int | None = None,
    every: dict[str, int] | None = None,
) -> dict[str, Any]:
    """``run.json`` of a new run of ``profile``'s cell ``task/method/K/L/seed``; ``eval_size``:
    score the first n of the held-out set (default all of it)."""
    from pipeline.config import profiles

    params = profiles.resolve(profile)
    if task not in params:
        raise ValueError(f"profile {profile!r} has no task {task!r}")
    section = params[task]
    cells = [
        c
        for c in grid_cells(params, task)
        if (c.method, c.sweeps, c.particles, c.seed) == (method, sweeps, particles, seed) and not c.axes
    ]
    if not cells:
        raise ValueError(
            f"profile {profile!r} trains no {task} cell {method} at K={sweeps}, L={particles}, seed {seed}"
        )
    every = {**EVERY, **(every or {})}
    for name, value in every.items():
        if name not in EVERY or isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"every {name}={value!r}: give positive step counts for {sorted(EVERY)}")
    for name in ("checkpoint", "eval"):
        if every[name] % every["log"]:
            raise ValueError(f"{name} every {every[name]} steps: not a multiple of log every {every['log']}")
    held = evaluation_sets(section)[0]
    if eval_size is not None and eval_size < 1:
        raise ValueError(f"eval size must be at least 1, got {eval_size}")
    train = section["data"]["train"]
    x_dtype = section["data"].get("x_dtype", "float32")
    model = section.get("model", {})
    return {
        "profile": profile,
        "train": cells[0].train.to_dict(),
        "seed": seed,
        "rows": {
            "num_datasets": train["num_datasets"],
            "seed": train["seed"],
            "sizes": train.get("sizes", {}),
            "made": "per-row" if task in PER_ROW else "whole",
            "x_dtype": x_dtype,
            "model": model,
        },
        "eval": {
            "name": held["name"],
            "num_datasets": min(eval_size or held["num_datasets"], held["num_datasets"]),
            "seed": held["seed"],
            "sizes": held.get("sizes", {}),
            "x_dtype": x_dtype,
            "model": model,
        },
        "every": every,
    }


def read_run(run_dir: Path) -> dict[str, Any]:
    """The run in ``run_dir`` (``FileNotFoundError`` when there is none)."""
    path = run_dir / RUN
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no run there; start one with --start")
    run = checks.read_json(path)
    check_run(run, path)
    return run


def check_run(run: Any, path: Path) -> None:
    """A ``run.json`` that a sitting can train from, or one line naming the file and the key
    (``ValueError``): its sets, seed and cadences of the right kinds and a valid training
    config. Whether its networks build is checked where they are built (``execute.restore``)."""
    from apg.training import TrainConfig

    if not isinstance(run, dict):
        raise ValueError(f"{path}: not a run (a JSON object of train, seed, rows, eval, every)")
    for key, kind in (("train", dict), ("rows", dict), ("eval", dict), ("every", dict), ("seed", int)):
        if not isinstance(run.get(key), kind) or isinstance(run.get(key), bool):
            raise ValueError(
                f"{path}: {key} must be {'an object' if kind is dict else 'an integer'}, got {run.get(key)!r}"
            )
    checks.seed(run["seed"], f"{path}: seed")
    for key in ("log", "checkpoint", "eval"):
        checks.integer(run["every"].get(key), f"{path}: every.{key}", low=1)
    for key in ("rows", "eval"):
        try:
            count, sizes = count_and_sizes(run[key])
        except KeyError as err:
            raise ValueError(f"{path}: {key} has no {err.args[0]}") from None
        checks.integer(count, f"{path}: {key}'s count", low=1)
    try:
        TrainConfig.from_dict(run["train"]).validate()
    except (TypeError, ValueError, KeyError) as err:
        raise ValueError(f"{path}: train: {checks.first_line(err)}") from None


def write_run(run_dir: Path, run: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(run, indent=2) + "\n"
    atomic_write(run_dir / RUN, lambda tmp: tmp.write_text(text))


def count_and_sizes(rows: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """``(count, sizes)`` of a training or held-out set in either form of ``run.json``."""
    if "num_videos" in rows:  # the long Bouncing MNIST runs' first form
        sizes = {k: rows[k] for k in ("num_frames", "num_digits", "split") if k in rows}
        return rows["num_videos"], {**sizes, **rows.get("sizes", {})}
    return rows["num_datasets"], dict(rows.get("sizes", {}))


def training_rows(run: dict[str, Any]):
    """The run's training set as its trainer reads it: rows made when read (Bouncing MNIST),
    or the whole set simulated now, cast to the profile's ``x_dtype``."""
    task, rows = run["train"]["task"], run["rows"]
    count, sizes = count_and_sizes(rows)
    if "num_videos" in rows or rows.get("made") == "per-row":
        return PER_ROW[task](count, rows["seed"], **sizes)
    x, _ = simulate(task, rows, count, rows["seed"], sizes)
    return x


def held_out(run: dict[str, Any]) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """The held-out set ``x`` of the run's curve and the simulator's other arrays (its truth)."""
    ev = run["eval"]
    count, sizes = count_and_sizes(ev)
    return simulate(run["train"]["task"], ev, count, ev["seed"], sizes)


def simulate(
    task: str, spec: dict[str, Any], num: int, seed: int, sizes: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """``num`` datasets of ``task`` as the generate stage makes them (``spec``'s simulator
    ``model`` and ``x_dtype``), in the default dtype, and the simulator's other arrays."""
    from apg.tasks.simulation import simulate_set

    get_task(task)  # an unknown task is said before anything is simulated
    with torch.random.fork_rng(devices=[]):  # building the simulator's model draws its weights
        arrays = simulate_set(task, spec.get("model", {}), num, seed, sizes)
    x = torch.from_numpy(arrays.pop("x").astype(spec.get("x_dtype", "float32"))).to(torch.get_default_dtype())
    return x, arrays
