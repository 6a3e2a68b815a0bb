"""A run's evaluation on its profile's held-out grid (``apg-pipeline grid``, ``grid.csv`` and
``trail.npz`` in any run's folder) in the report: a row per held-out set, Figure 4
(reconstruction MSE against sweeps, one panel per (T, D)) and Figure 3 (frames of one video
of the last set with the inferred and true paths). The claims the paper numbers decide on
the grids (``bmnist.long_run_claims`` and ``long_run_every_set``) go in the table of the run
of the method they name, with the reach of its target sets (:mod:`pipeline.report.reach`);
the other runs show their grids alone."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator

from apg.tasks.bmnist.config import BMNISTConfig
from pipeline.report.claims import ClaimResult, check_claim, claims_not_run, verdict
from pipeline.report.data import finals
from pipeline.report.figures import _save
from pipeline.report.reach import reach_markdown, reaches
from pipeline.runs.grid import COLUMNS, GRID, TRAIL
from pipeline.statistics import seed_interval

STRIP_FRAMES = 8
# Each panel draws the paths over the frames up to it, at most this many (digits move ~8 px a frame).
TRAIL_FRAMES = 4
GRID_RULES = (
    "One training run per method: each held-out video stands in for a seed in the claims "
    "table's rules (a 95% interval over the videos; two methods compared by Welch's interval, "
    "on the same videos when both scored the set on as many: a set's seed and number of videos "
    "fix them), so a verdict says what this trained run does on the held-out sets, not "
    "what training does across seeds, and the headline does not count it. Rules and targets: "
    "`pipeline/paper_numbers.yaml`, `bmnist.long_run_claims` and `long_run_every_set`, set "
    "before the grid was first scored. A comparison is made at the latest step both runs have "
    "scored ('–': no common step yet)."
)
Grids = dict[str, tuple[pd.DataFrame, tuple[int, int]]]  # {method: (its run's grid, (K, L))}
Decided = list[tuple[dict[str, Any], ClaimResult, int | None]]  # (spec, result, step) per claim


def read_grid(run_dir: Path) -> pd.DataFrame | None:
    """The run's ``grid.csv`` (a row per step, set, video and sweep), or ``None``."""
    return pd.read_csv(run_dir / GRID) if (run_dir / GRID).is_file() else None


def latest_per_set(grid: pd.DataFrame) -> pd.DataFrame:
    """Each set's rows of the latest step it was scored at (sets can be scored at different
    steps: ``grid --sets``)."""
    return grid[grid["iteration"] == grid.groupby("set")["iteration"].transform("max")]


def per_set(grid: pd.DataFrame) -> pd.DataFrame:
    """One step's grid as a row per set and sweep (in order of T, then D): the videos, and the
    mean and standard error over videos of each of ``COLUMNS``."""
    keys = ["set", "T", "D", "sweep"]
    by = grid.sort_values(["T", "D"], kind="stable").groupby(keys, sort=False)  # the profile's order
    out = by.size().rename("videos").to_frame()
    for name in COLUMNS:
        out[name] = by[name].mean()
        out[f"{name}_sem"] = by[name].sem()
    return out.reset_index()


def as_evaluation_rows(grid: pd.DataFrame, task: str, method: str, pair: tuple[int, int]) -> pd.DataFrame:
    """One step's grid of a run at ``pair`` (its K, L) in the evaluation's long form
    (``pipeline/evaluate/stage.py``), each video in place of a seed: what ``check_claim`` reads."""
    long = grid.melt(
        id_vars=["iteration", "set", "video", "sweep"], value_vars=list(COLUMNS), var_name="metric"
    )
    return long.assign(
        task=task,
        method=method,
        K=pair[0],
        L=pair[1],
        seed=long["video"],
        dataset=long["video"],
        cell_id=f"grid/{method}/step{int(grid['iteration'].iloc[0])}",
        test_set=long["set"],
    )


def grid_claims(grids: Grids, paper: dict[str, Any], task: str = "bmnist") -> Decided:
    """``(spec, result, step)`` for each claim of ``paper`` (the task's section of
    pipeline/paper_numbers.yaml: ``long_run_claims``, and ``long_run_every_set`` on every set of
    the grid of the method it names) whose method has a grid in ``grids``, each at the latest
    step its set was scored at by the runs it reads; a comparison with a run that has no step in
    common with the method's on the set is not run (step ``None``)."""
    specs = list(paper.get("long_run_claims") or [])
    specs += [
        {**spec, "id": f"{spec['id']}_{name}", "test_set": name}
        for method, (grid, _) in grids.items()
        for name in dict.fromkeys(grid["set"])
        for spec in paper.get("long_run_every_set") or []
        if spec["method"] == method
    ]
    out = []
    for spec in specs:
        if spec["method"] not in grids:
            continue
        runs = [spec["method"]] + ([spec["other"]] if spec.get("other") else [])
        common = set.intersection(
            *(steps_of(grids[m][0], spec["test_set"]) if m in grids else set() for m in runs)
        )
        step = max(common) if common else None  # the method's alone: its latest
        if step is None:
            out.append((spec, claims_not_run(task, [spec], "no step scored by both runs")[0], None))
            continue
        frame = pd.concat(
            [
                as_evaluation_rows(at_step(grids[m][0], spec["test_set"], step), task, m, grids[m][1])
                for m in runs
            ]
        )
        out.append((spec, check_claim(spec, task, finals(frame), frame.iloc[:0], frame), step))
    return out


def grid_metrics(grids: Grids, paper: dict[str, Any], task: str = "bmnist") -> dict[str, Any]:
    """``reports/metrics.json``'s ``long_run`` (empty without the claims' method's grid): each
    grid claim's verdict (1, 0 or None, as the claims table's) and each target set's reach
    verdict."""
    decided = grid_claims(grids, paper, task)
    if not decided:
        return {}
    claims = {spec["id"]: None if r.passed is None else int(bool(r.passed)) for spec, r, _ in decided}
    owner = grids[decided[0][0]["method"]][0]
    return {"claims": claims, "reach": {r.set: r.verdict for r in reaches(owner, paper)}}


def steps_of(grid: pd.DataFrame, name: str) -> set[int]:
    """The steps at which the set ``name`` was scored."""
    return set(grid.loc[grid["set"] == name, "iteration"])


def at_step(grid: pd.DataFrame, name: str, step: int) -> pd.DataFrame:
    return grid[(grid["set"] == name) & (grid["iteration"] == step)]


def grid_markdown(
    run_dir: Path,
    out_dir: Path,
    rel: str,
    fmt: str,
    decided: Decided | None = None,
    paper: dict[str, Any] | None = None,
) -> str:
    """The run's grid section (empty when the run has no ``grid.csv``): its latest step's grid,
    Figures 3 and 4; with ``decided`` (the grid claims on this run's method, and ``paper``: the
    task's paper numbers) each set's claims and the reach of its target sets as well."""
    grid = read_grid(run_dir)
    if grid is None:
        return ""
    run = json.loads((run_dir / "run.json").read_text())
    latest = latest_per_set(grid)
    steps = latest.groupby("set", sort=False)["iteration"].first()
    sets = per_set(latest)
    last = sets[sets["sweep"] == sets["sweep"].max()]
    first = sets[sets["sweep"] == 1].set_index("set")
    mse_figure = out_dir / f"figure4.{fmt}"
    figure4(sets, mse_figure)
    if steps.nunique() == 1:
        at, scored = f"at step {int(steps.iloc[0]):,}", f"the state of step {int(steps.iloc[0]):,}"
    else:
        at = f"at steps {int(steps.min()):,}–{int(steps.max()):,}"
        scored = "each set with the latest state it was scored at (the step column)"
    lines = [
        f"#### The paper's held-out grid {at} (`{run_dir.name}`, {run['train']['method']})",
        "",
        f"`apg-pipeline grid` scored {scored} on the profile's held-out "
        f"sets at K = {run['train']['sweeps']} (position error of the highest-weight particle after "
        "the last sweep and the reconstruction MSE weighted over particles"
        + ("; mean and 95% interval over videos)." if decided else "; mean ± standard error over videos)."),
        "",
    ]
    if not decided:
        lines += [
            "| set | videos | step | position error (px) | tracked frames | MSE, sweep 1 → last |",
            "|---|---|---|---|---|---|",
            *(
                f"| {r.set} | {int(r.videos)} | {int(steps[r.set]):,} | {r.pos_err:.2f} ± {r.pos_err_sem:.2f} | {r.tracked:.2f} | "
                f"{first.loc[r.set, 'mse']:.4f} → {r.mse:.4f} |"
                for r in last.itertuples()
            ),
        ]
    else:
        lines += claims_grid_markdown(latest, last, decided)
        lines += ["", *reach_markdown(grid, paper or {}, out_dir, rel, fmt)]
    lines += ["", f"![Figure 4]({rel}/{mse_figure.name})", ""]
    if (run_dir / TRAIL).is_file():
        trail_figure = out_dir / f"figure3.{fmt}"
        figure3(run_dir / TRAIL, trail_figure)
        lines += [f"![Figure 3]({rel}/{trail_figure.name})", ""]
    return "\n".join(lines)


def claims_grid_markdown(
    grid: pd.DataFrame, last: pd.DataFrame, results: list[tuple[dict[str, Any], ClaimResult, int | None]]
) -> list[str]:
    """The grid's table (``grid``: each set's rows of its latest step; ``last``: its sets after
    the last sweep) with each set's claims: the position error against its target, the MSE's
    change over sweeps, APG minus each baseline (95% intervals over videos)."""
    final = grid[grid["sweep"] == grid["sweep"].max()]
    steps = final.groupby("set")["iteration"].first()
    errors = {name: seed_interval(rows["pos_err"].to_numpy()) for name, rows in final.groupby("set")}
    by_set: dict[str, dict[str, tuple[ClaimResult, int | None]]] = {}
    for spec, r, step in results:
        by_set.setdefault(spec["test_set"], {})[spec.get("other") or spec["kind"]] = (r, step)
    others = list(dict.fromkeys(spec["other"] for spec, _, _ in results if spec.get("other")))
    header = [
        "set",
        "videos",
        "step",
        "position error (px)",
        "target",
        "✓/✗",
        "tracked",
        "MSE: sweep 1 → last",
        "✓/✗",
    ]
    header += [h for other in others for h in (f"APG − {other} (px)", "✓/✗")]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in last.itertuples():
        claims = by_set.get(r.set, {})
        row = [r.set, str(int(r.videos)), f"{int(steps[r.set]):,}"]
        pos = errors[r.set]
        row.append(_interval(pos.mean, pos.lo, pos.hi))
        if "threshold" in claims:
            target = claims["threshold"][0]
            row += [target.target, _verdict(target)]
        else:
            row += ["", ""]
        row.append(f"{r.tracked:.2f}")
        if "falls_over_sweeps" in claims and claims["falls_over_sweeps"][0].note != "not run":
            mse = claims["falls_over_sweeps"][0]
            change = mse.ours.rsplit("change ", 1)[-1] if mse.passed is not None else ""
            row += [f"{mse.target_value:.4f} → {mse.value:.4f} (change {change})", _verdict(mse)]
        else:
            row += ["–", "–"]
        for other in others:
            got = claims.get(other)
            if got is None or got[1] is None or got[0].note == "not run":
                row += ["–", "–"]
                continue
            (result, step), (d, lo, hi) = got, got[0].target_value["difference"]
            them = result.target_value["value"]
            row += [
                f"{_interval(d, lo, hi)} (step {step:,}: {result.value:.2f} vs {them:.2f})",
                _verdict(result),
            ]
        lines.append("| " + " | ".join(row) + " |")
    return lines + ["", GRID_RULES]


def _verdict(r: ClaimResult) -> str:
    """The verdict, its videos named as such (the rules count them as seeds)."""
    return verdict(r).replace("seed", "video")


def _interval(mean: float, lo: float, hi: float) -> str:
    if lo is None or not np.isfinite(lo):
        return f"{mean:.2f}"
    return f"{mean:.2f} [{lo:.2f}, {hi:.2f}]"


def figure4(grid: pd.DataFrame, path: Path) -> None:
    """Reconstruction MSE against sweeps, one panel per (T, D), ± standard error (floored at 0)."""
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
        "Reconstruction MSE (weighted over particles) against sweeps, per held-out set (T frames, D digits), ± standard error over videos.",
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
        f"One {meta['set']} video (seed {meta['seed']}, video {meta['video']}"
        + (f"; the state of step {meta['iteration']:,}" if "iteration" in meta else "")
        + "): each digit's true path "
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
