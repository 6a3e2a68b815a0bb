"""A run's evaluation on its profile's held-out grid (the paper's Figures 3 and 4), for any
run whose task tracks objects (``TaskSpec.tracking``: Bouncing MNIST).

``apg-pipeline grid RUN`` scores the run's state (or, with ``--state FILE``, an earlier
checkpoint of the run, from git history) on the run's profile's held-out sets (the ``paper``
profile: T in {10, 20, 100} x D in {3, 4, 5}, 100 test-split videos each; ``videos`` draws n
of each instead: a set's seed and n fix its videos, so scores on different n are of different
videos) at the run's K and L, and writes its rows into ``grid.csv``: per step, set, video and
sweep, the reconstruction MSE (weighted over particles) and the position error (px) and
tracked-frame fraction of the highest-weight particle, all from one run of the method per
batch of videos. Rows of other steps stay, so that runs of two methods can be compared at a
step both have scored. The proposals track each set's D digits (the trained weights do not
depend on D). Each set is scored on a random stream of its own (``EVAL_SEED``), so the same
state gives the same rows; ``trail.npz`` keeps, for the first video of the last set (T=100,
D=5 in the paper's grid) and the run's latest state, the inferred and true positions of every
digit in every frame and its frames (8 bits), which the report draws as Figure 3.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from apg.data import atomic_write
from apg.loading import with_network
from apg.metrics import highest_weight_particle
from apg.particles import tracking_errors
from apg.tasks import get_task
from apg.training import make_method
from pipeline.runs import spec
from pipeline.runs.execute import EVAL_SEED, read_rows, restore
from pipeline.runs.loop import write_history
from pipeline.runs.spec import STATE

GRID, TRAIL = "grid.csv", "trail.npz"


def grid_sets(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The held-out sets of the run's profile (name, size, seed, sizes, network overrides)."""
    from pipeline.config import profiles

    return list(profiles.resolve(run["profile"])[run["train"]["task"]]["data"].get("tests", []))


def evaluate_grid(
    run_dir: Path,
    videos: int | None = None,
    device: str = "cpu",
    batch_size: int = 10,
    state: Path | None = None,
    sets: list[str] | None = None,
) -> Path:
    """Score the run's latest state (or the checkpoint file ``state``: an earlier step's, from
    git history) on every set of :func:`grid_sets` (or on those named in ``sets``); write its
    rows into ``grid.csv`` in the run's folder, replacing the rows of the same step and sets
    and keeping the others, and return the table's path. ``trail.npz`` is written for the
    run's latest state only, when the profile's last set is scored."""
    run = spec.read_run(run_dir)
    tracking = get_task(run["train"]["task"]).tracking
    if tracking is None:
        raise ValueError(f"{run_dir}: a {run['train']['task']} run; the grid scores tasks that track objects")
    if state is None and not (run_dir / STATE).is_file():
        raise FileNotFoundError(f"{run_dir}: the run has no checkpoint yet; train it first")
    if state is not None and not state.is_file():
        raise FileNotFoundError(f"{state}: no such checkpoint")
    profile_sets = grid_sets(run)
    chosen = select_sets(profile_sets, sets)
    if videos is not None and videos < 1:
        raise ValueError(f"--videos must be >= 1, got {videos}")
    trainer = restore(run, run_dir, device, state_file=state)
    cfg = trainer.cfg
    sweeps, particles = cfg.sweeps, cfg.particles
    rows: list[dict[str, Any]] = []
    for i, entry in enumerate(chosen):
        n = min(videos or entry["num_datasets"], entry["num_datasets"])
        sizes = entry.get("sizes", {})
        # the set's videos as the profile's files store them (cast to its x_dtype), and their truth
        x, arrays = spec.simulate(cfg.task, run["eval"], n, entry["seed"], sizes)
        truth = tracking.truth(arrays)
        set_cfg, proposals = with_network(cfg, trainer.model, trainer.proposals, entry.get("network"), device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(EVAL_SEED)
            budget = (sweeps, particles, batch_size, set_cfg.resample_mode)
            curves = tracking_errors(set_cfg, trainer.model, proposals, x, truth, *budget, mse=True)
        # a row per sweep the method reports (AVF: one, its last inference iteration's)
        for k, video in itertools.product(range(len(curves["pos_err"])), range(n)):
            rows.append(
                {
                    "iteration": trainer.iteration,
                    "set": entry["name"],
                    "T": sizes.get("num_frames"),
                    "D": sizes.get("num_digits"),
                    "video": video,
                    "sweep": k + 1,
                    **{name: float(curves[name][k, video]) for name in COLUMNS},
                }
            )
        print(
            f"grid {entry['name']}: {n} videos, position error {curves['pos_err'][-1].mean():.2f} px after "
            f"{sweeps} sweeps ({i + 1}/{len(chosen)})",
            flush=True,
        )
        if state is None and entry is profile_sets[-1]:
            _write_trail(run_dir / TRAIL, trainer, set_cfg, proposals, x[:1], truth, entry, sweeps, particles)
    scored = {entry["name"] for entry in chosen}
    kept = [
        r for r in read_rows(run_dir / GRID) if r["iteration"] != trainer.iteration or r["set"] not in scored
    ]
    write_history(run_dir / GRID, sorted(kept + rows, key=lambda r: int(r["iteration"])))
    return run_dir / GRID


def select_sets(profile_sets: list[dict[str, Any]], names: list[str] | None) -> list[dict[str, Any]]:
    """The profile's sets named in ``names`` (all of them for ``None``), in the profile's order;
    a name the profile does not have is an error that lists the ones it has."""
    if names is None:
        return profile_sets
    known = [entry["name"] for entry in profile_sets]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ValueError(
            f"--sets: unknown set(s) {', '.join(unknown) or '(none given)'}; the profile has {', '.join(known)}"
        )
    return [entry for entry in profile_sets if entry["name"] in names]


COLUMNS = ("mse", "pos_err", "tracked")  # grid.csv's values per set, video and sweep


def _write_trail(path, trainer, cfg, proposals, x, truth, entry, sweeps, particles) -> None:
    """The first video's inferred positions (highest-weight particle after the last sweep) and
    its true ones, in pixels, ``(T, D, 2)`` each, with where the video comes from."""
    tracking = get_task(cfg.task).tracking
    found: dict[str, np.ndarray] = {}

    def collect(k: int, z: dict[str, torch.Tensor], log_w: torch.Tensor) -> None:
        # each sweep the method reports replaces the last (AVF reports one)
        best = {name: t[None] for name, t in highest_weight_particle(z, log_w).items()}  # (1, 1, ...)
        found.update(tracking.positions(trainer.model, x, best))

    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(EVAL_SEED)
        make_method(cfg).run(
            trainer.model,
            proposals,
            x,
            sweeps,
            particles,
            cfg.resample_mode,
            cfg.resampler,
            collectors=[collect],
        )
    arrays = {f"found_{k}": np.asarray(v) for k, v in found.items()}
    arrays.update({f"true_{k}": np.asarray(v[:1]) for k, v in truth.items()})
    arrays["frames"] = (x[0].float().clamp(0, 1) * 255).round().to(torch.uint8).numpy()  # (T, H, W)
    meta = json.dumps(
        {
            "set": entry["name"],
            "seed": entry["seed"],
            "sizes": entry.get("sizes", {}),
            "video": 0,
            "iteration": trainer.iteration,
        }
    )

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, meta=np.array(meta), **arrays)

    atomic_write(path, write)
