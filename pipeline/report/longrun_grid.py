"""The long run's T x D evaluation (``apg-pipeline long-run --grid``, ``grid.csv`` and
``trail.npz``) in the report: a table per held-out set, Figure 4 (reconstruction MSE against
sweeps, one panel per (T, D)) and Figure 3 (frames of one T=100, D=5 video with the inferred
and true paths)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator

from apg.tasks.bmnist.config import BMNISTConfig
from pipeline.longrun_grid import GRID, TRAIL
from pipeline.report.figures import _save

# The run's targets (position error in px, after the last sweep): 3 px on the paper's T=10 and
# T=100 three-digit videos, 4 px with four and five digits on T=20 ones.
TARGETS_PX = {"T10_D3": 3.0, "T100_D3": 3.0, "T20_D4": 4.0, "T20_D5": 4.0}
STRIP_FRAMES = 8
# Each panel draws the paths over the frames up to it, at most this many (digits move ~8 px a frame).
TRAIL_FRAMES = 4


def grid_markdown(run_dir: Path, out_dir: Path, rel: str, fmt: str) -> str:
    """The section's lines (empty when the run has no ``grid.csv``)."""
    if not (run_dir / GRID).is_file():
        return ""
    grid = pd.read_csv(run_dir / GRID)
    step = int(grid["iteration"].iloc[0])
    last = grid[grid["sweep"] == grid["sweep"].max()]
    first = grid[grid["sweep"] == 1].set_index("set")
    mse_figure = out_dir / f"figure4.{fmt}"
    figure4(grid, mse_figure)
    lines = [
        f"### The paper's held-out grid at step {step:,}",
        "",
        f"`apg-pipeline long-run --grid` scored the state of step {step:,} on the profile's held-out "
        f"sets at K = {int(grid['sweep'].max())} (position error of the highest-weight particle after "
        "the last sweep and the reconstruction MSE, mean ± standard error over videos; one trained "
        "run, so no verdicts: the targets are the run's, set before it was scored).",
        "",
        "| set | videos | position error (px) | tracked frames | MSE, sweep 1 → last | target (px) | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in last.itertuples():
        target = TARGETS_PX.get(r.set)
        met = "" if target is None else ("yes" if r.pos_err <= target else "no")
        lines.append(
            f"| {r.set} | {int(r.videos)} | {r.pos_err:.2f} ± {r.pos_err_sem:.2f} | {r.tracked:.2f} | "
            f"{first.loc[r.set, 'mse']:.4f} → {r.mse:.4f} | {'' if target is None else f'{target:g}'} | {met} |"
        )
    lines += ["", f"![Figure 4]({rel}/{mse_figure.name})", ""]
    if (run_dir / TRAIL).is_file():
        trail_figure = out_dir / f"figure3.{fmt}"
        figure3(run_dir / TRAIL, trail_figure)
        lines += [f"![Figure 3]({rel}/{trail_figure.name})", ""]
    return "\n".join(lines)


def figure4(grid: pd.DataFrame, path: Path) -> None:
    """Reconstruction MSE against sweeps, one panel per (T, D), ± standard error (floored at 0)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    frames, digits = sorted(grid["T"].unique()), sorted(grid["D"].unique())
    fig, axes = plt.subplots(
        len(frames), len(digits), figsize=(2.4 * len(digits), 1.9 * len(frames)), squeeze=False, sharex=True
    )
    for i, t in enumerate(frames):
        for j, d in enumerate(digits):
            ax = axes[i][j]
            rows = grid[(grid["T"] == t) & (grid["D"] == d)].sort_values("sweep")
            if rows.empty:
                ax.set_axis_off()
                continue
            low = np.minimum(rows["mse_sem"], rows["mse"])
            ax.errorbar(rows["sweep"], rows["mse"], yerr=[low, rows["mse_sem"]], fmt="o-", ms=3)
            ax.set_title(f"T={t}, D={d}", fontsize=8)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.tick_params(labelsize=7)
            if j == 0:
                ax.set_ylabel("MSE", fontsize=8)
            if i == len(frames) - 1:
                ax.set_xlabel("sweep", fontsize=8)
    _save(
        fig,
        path,
        "Reconstruction MSE of the highest-weight particle against sweeps, per held-out set (T frames, D digits).",
    )


def figure3(trail_path: Path, path: Path) -> None:
    """Evenly spaced frames of one video with each digit's true path (solid) and inferred path
    (dashed) over the frames up to it (``TRAIL_FRAMES`` at most), the current positions marked."""
    with np.load(trail_path) as npz:
        meta = json.loads(str(npz["meta"]))
        frames = npz["frames"]
        true_px = pixels(npz["true_z_where"][0], npz["true_centres"][0])
        found_px = matched(pixels(npz["found_z_where"][0], npz["found_centres"][0]), true_px)
    count = len(frames)
    shown = np.linspace(0, count - 1, min(STRIP_FRAMES, count)).round().astype(int)
    fig, axes = plt.subplots(1, len(shown), figsize=(1.6 * len(shown), 2.0), squeeze=False)
    for ax, t in zip(axes[0], shown, strict=True):
        ax.imshow(frames[t], cmap="gray", vmin=0, vmax=255)
        for d in range(true_px.shape[1]):
            colour = f"C{d}"
            span = slice(max(0, t + 1 - TRAIL_FRAMES), t + 1)
            ax.plot(true_px[span, d, 0], true_px[span, d, 1], "-", color=colour, lw=0.8)
            ax.plot(found_px[span, d, 0], found_px[span, d, 1], "--", color=colour, lw=0.8)
            ax.plot(*found_px[t, d], "x", color=colour, ms=4)
        ax.set(xlim=(-0.5, frames.shape[2] - 0.5), ylim=(frames.shape[1] - 0.5, -0.5))  # the canvas only
        ax.set_title(f"frame {t + 1}", fontsize=7)
        ax.set_axis_off()
    _save(
        fig,
        path,
        f"One {meta['set']} video (seed {meta['seed']}, video {meta['video']}): each digit's true path "
        f"(solid) and inferred path (dashed) over the last {TRAIL_FRAMES} frames up to the one shown (x: "
        "the inferred position in it), one colour per digit "
        "(inferred digits matched to true ones over the whole video).",
    )


def pixels(where: np.ndarray, centres: np.ndarray, cfg: BMNISTConfig = BMNISTConfig()) -> np.ndarray:
    """Ink positions ``(T, D, 2)`` in pixels (column, row) from box positions in model
    coordinates ``(T, D, 2)`` and the digits' ink centres in their boxes ``(D, 2)``."""
    half = 0.5 * (cfg.canvas_size - cfg.digit_size)
    return (where + 1.0) * half + centres[None]


def matched(found: np.ndarray, true: np.ndarray) -> np.ndarray:
    """``found (T, D, 2)`` with its digits reordered to the true digits they are nearest over
    the whole video (one permutation, as the position error matches them)."""
    best = min(
        itertools.permutations(range(true.shape[1])),
        key=lambda perm: float(np.linalg.norm(found[:, list(perm)] - true, axis=-1).mean()),
    )
    return found[:, list(best)]
