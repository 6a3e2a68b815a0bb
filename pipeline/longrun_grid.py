"""The paper's Bouncing MNIST evaluation (Figures 3 and 4) of the long run's current state.

``apg-pipeline long-run --grid`` scores the state in ``recorded/bmnist-long/`` on the run's
profile's held-out sets (the ``paper`` profile: T in {10, 20, 100} x D in {3, 4, 5}, 100
test-split videos each; ``videos`` takes the first n of each) at the run's K and L, and
writes ``grid.csv``: per set and sweep, the reconstruction MSE and the position error (px)
of the highest-weight particle, each with its standard error over videos, and the fraction
of tracked frames, all at the step the state is of. The proposals track each set's D digits
(the trained weights do not depend on D). Each set is scored on a random stream of its own
(``EVAL_SEED``), so the same state gives the same table; ``trail.npz`` keeps, for the
first video of the last set (T=100, D=5 in the paper's grid), the inferred and true
positions of every digit in every frame and its frames (8 bits), which the report draws as
Figure 3.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from apg.data import atomic_write
from apg.training import evaluate
from pipeline.common import with_network
from pipeline.driver import write_history
from pipeline.evaluate_particles import tracking_errors
from pipeline.longrun import EVAL_SEED, RUN, RUN_DIR, STATE, restore, sem, simulate_videos

GRID, TRAIL = "grid.csv", "trail.npz"


def grid_sets(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The held-out sets of the run's profile (name, size, seed, sizes, network overrides)."""
    from pipeline import profiles

    return list(profiles.resolve(run["profile"])["bmnist"]["data"].get("tests", []))


def evaluate_grid(
    root: Path,
    run_dir: Path | None = None,
    videos: int | None = None,
    device: str = "cpu",
    batch_size: int = 10,
) -> Path:
    """Score the run's latest state on every set of :func:`grid_sets`; write ``grid.csv`` and
    ``trail.npz`` into the run's folder (replacing an earlier grid) and return the table's path."""
    run_dir = run_dir or root / RUN_DIR
    if not (run_dir / RUN).is_file():
        raise FileNotFoundError(f"{run_dir / RUN}: no long run there; start one with --start")
    run = json.loads((run_dir / RUN).read_text())
    if not (run_dir / STATE).is_file():
        raise FileNotFoundError(f"{run_dir}: the run has no checkpoint yet; train it first")
    trainer = restore(run, run_dir, device)
    cfg = trainer.cfg
    sweeps, particles = cfg.sweeps, cfg.particles
    rows: list[dict[str, Any]] = []
    sets = grid_sets(run)
    for i, entry in enumerate(sets):
        n = min(videos or entry["num_datasets"], entry["num_datasets"])
        sizes = entry.get("sizes", {})
        x, truth = simulate_videos(run, n, entry["seed"], sizes)
        set_cfg, proposals = with_network(cfg, trainer.model, trainer.proposals, entry.get("network"), device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(EVAL_SEED)
            curves = evaluate(
                set_cfg, trainer.model, proposals, x, sweeps, particles, batch_size, cfg.resample_mode
            )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(EVAL_SEED)
            errors = tracking_errors(
                set_cfg, trainer.model, proposals, x, truth, sweeps, particles, batch_size, cfg.resample_mode
            )
        for k in range(sweeps):
            rows.append(
                {
                    "iteration": trainer.iteration,
                    "set": entry["name"],
                    "T": sizes.get("num_frames"),
                    "D": sizes.get("num_digits"),
                    "videos": n,
                    "sweep": k + 1,
                    "mse": float(curves["mse"][k].mean()),
                    "mse_sem": sem(curves["mse"][k]),
                    "pos_err": float(errors["pos_err"][k].mean()),
                    "pos_err_sem": sem(errors["pos_err"][k]),
                    "tracked": float(errors["tracked"][k].mean()),
                }
            )
        print(
            f"grid {entry['name']}: {n} videos, position error {rows[-1]['pos_err']:.2f} px after "
            f"{sweeps} sweeps ({i + 1}/{len(sets)})",
            flush=True,
        )
        if i == len(sets) - 1:
            _write_trail(run_dir / TRAIL, trainer, set_cfg, proposals, x[:1], truth, entry, sweeps, particles)
    write_history(run_dir / GRID, rows)
    return run_dir / GRID


def _write_trail(path, trainer, cfg, proposals, x, truth, entry, sweeps, particles) -> None:
    """The first video's inferred positions (highest-weight particle after the last sweep) and
    its true ones, in pixels, ``(T, D, 2)`` each, with where the video comes from."""
    from apg.tasks import get_task

    tracking = get_task(cfg.task).tracking
    found: dict[str, np.ndarray] = {}

    def collect(k: int, z: dict[str, torch.Tensor], log_w: torch.Tensor) -> None:
        if k == sweeps - 1:
            best = log_w.argmax(0)
            rows = torch.arange(log_w.shape[1])
            found.update(tracking.positions(trainer.model, x, {n: t[best, rows][None] for n, t in z.items()}))

    from apg.training import make_method

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
        {"set": entry["name"], "seed": entry["seed"], "sizes": entry.get("sizes", {}), "video": 0}
    )

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, meta=np.array(meta), **arrays)

    atomic_write(path, write)
