"""Continuing runs in the report (``apg-pipeline continue``: every folder under ``recorded/``
with a ``run.json`` and an ``evals.csv``), read the same way whatever their task: for each
profile and task, every run's step, sittings and latest held-out scores, the methods side by
side at the latest step all their runs have been scored at, the paper's numbers beside them,
the held-out curves, each run's rate per device and, where the paper numbers give the task a
target for a held-out score, when each run would meet it at the rate measured
(:mod:`pipeline.report.reach`); then the held-out grid of each run that has one
(``grid.csv``, :mod:`pipeline.report.grid`), with the claims the paper numbers decide there.

Reads the runs' tables only (``run.json``, ``evals.csv``, ``segments.csv``, ``history.csv``,
``grid.csv``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from pipeline.present import markdown_table
from pipeline.report.departures import FLAG, FLAG_RULE, departure_note, is_far, paper_ratio, ratio_text
from pipeline.report.figures import _save
from pipeline.report.grid import Grids, grid_claims, grid_markdown, grid_metrics, read_grid
from pipeline.report.reach import (
    curve_reach_text,
    curve_target,
    curves_reach_figure,
    hours,
    power_law_fit,
    sitting_rates,
    steps_to_reach,
)
from pipeline.runs.spec import EVALS, HISTORY, RUN, RUNS_DIR, SEGMENTS, count_and_sizes
from pipeline.statistics import seed_interval

# Held-out scores in the order the tables show them, with their labels; a run shows those
# its task scores (evals.csv's columns).
SCORES = {
    "log_joint_true": "log p(x, mu, c) under the true model",
    "ari": "ARI",
    "log_joint": "log p(x, z) own model",
    "ess": "ESS/L (last sweep)",
    "pos_err": "position error (px)",
}
# The score a task's curve figure draws, the first of SCORES its runs have.
CURVE_ORDER = ("log_joint_true", "pos_err", "log_joint")
Member = tuple[Path, dict[str, Any], pd.DataFrame]  # a run's folder, run.json and evals.csv


def continued_runs(root: Path) -> list[Member]:
    """The runs under ``recorded/`` that have been scored (a ``run.json`` and an
    ``evals.csv``), in name order."""
    found = []
    for run_json in sorted((root / RUNS_DIR).glob(f"*/{RUN}")):
        folder = run_json.parent
        if (folder / EVALS).is_file():
            found.append((folder, json.loads(run_json.read_text()), pd.read_csv(folder / EVALS)))
    return found


def by_task(runs: list[Member]) -> dict[tuple[str, str], list[Member]]:
    """The runs grouped by profile and task, in the order first seen."""
    out: dict[tuple[str, str], list[Member]] = {}
    for member in runs:
        run = member[1]
        out.setdefault((run.get("profile", "?"), run["train"]["task"]), []).append(member)
    return out


def _segments(folder: Path) -> pd.DataFrame:
    return pd.read_csv(folder / SEGMENTS) if (folder / SEGMENTS).is_file() else pd.DataFrame()


def _run_row(folder: Path, run: dict[str, Any], evals: pd.DataFrame) -> dict[str, Any]:
    segments = _segments(folder)
    last = evals.iloc[-1]
    train = run["train"]
    row = {
        "run": folder.name,
        "method": train["method"],
        "seed": run["seed"],
        "trained": int(segments["to_iteration"].max()) if len(segments) else 0,
        "of": int(train["iterations"]),
        "step": int(last["iteration"]),
        "sittings": len(segments),
        "hours": float(segments["seconds"].sum()) / 3600 if len(segments) else 0.0,
    }
    for name in SCORES:
        if name in evals:
            row[name] = float(last[name])
            row[f"{name}_sem"] = float(last[f"{name}_sem"]) if f"{name}_sem" in evals else float("nan")
    return row


def _with_sem(value: float, sem: float) -> str:
    return f"{value:.4g}" if not np.isfinite(sem) else f"{value:.4g} ± {sem:.2g}"


def _score_text(rows: pd.DataFrame, name: str) -> str:
    values = rows[name].dropna().to_numpy()
    if len(values) == 0:
        return ""
    if len(values) == 1:
        return f"{values[0]:.4g} (one seed)"
    found = seed_interval(values)
    return f"{found.mean:.4g} [{found.lo:.4g}, {found.hi:.4g}]"


def _set_text(rows: dict[str, Any], noun: str) -> str:
    """``60,000 training datasets (num_frames 10, num_digits 3)``: a run's set and its sizes."""
    count, sizes = count_and_sizes(rows)
    shown = ", ".join(f"{k} {v}" for k, v in sizes.items() if k != "split")
    return f"{count:,} {noun}" + (f" ({shown})" if shown else "")


def runs_markdown(root: Path, out: Path, paper_all: dict[str, Any], fmt: str) -> str:
    """The report's section on the continuing runs ('' when there are none); ``paper_all``:
    ``pipeline/paper_numbers.yaml``."""
    runs = continued_runs(root)
    if not runs:
        return ""
    lines = [
        "## Continuing runs at the paper's configuration",
        "",
        "Cells of a profile trained a sitting at a time on whatever machine continues them "
        "(`apg-pipeline continue`, [docs/recorded.md](../docs/recorded.md#continuing-runs-any-cell-of-any-profile)): "
        "each run's latest held-out scores (its task's first held-out set, scored every few hundred steps, "
        "± the standard error over its datasets), then the methods side by side at the latest step every run "
        "of the task has been scored at (mean over seeds, 95% interval over seeds), the curves, each run's "
        "rate per device and, where the paper numbers give the task a target, when each run would meet it. "
        "These runs are short of the paper's steps; the claims table judges none of them until their curves "
        "plateau. A run scored on its profile's held-out grid (`apg-pipeline grid`) shows that grid below.",
        "",
    ]
    for (profile, task), members in by_task(runs).items():
        lines += _task_markdown(profile, task, members, paper_all.get(task) or {}, out, fmt)
    return "\n".join(lines) + "\n"


def _task_markdown(
    profile: str, task: str, members: list[Member], paper_task: dict[str, Any], out: Path, fmt: str
) -> list[str]:
    table = pd.DataFrame([_run_row(*member) for member in members])
    shown = [name for name in SCORES if name in table]
    first = members[0][1]
    train = first["train"]
    lines = [
        f"### {task}, `{profile}` profile",
        "",
        f"K = {train['sweeps']}, L = {train['particles']}, batch {train['batch_size']}, lr {train['lr']:g}, "
        f"{_set_text(first['rows'], 'training datasets')}; held-out set `{first['eval']['name']}`: "
        f"{_set_text(first['eval'], 'datasets')}, scored every {first['every']['eval']} steps.",
        "",
    ]
    header = ["run", "method", "seed", "steps trained", "of", "sittings", "hours", "scored at"]
    rows = [
        [f"`{r['run']}`", f"{r['method']}", f"{r['seed']}", f"{r['trained']:,}", f"{r['of']:,}"]
        + [f"{r['sittings']}", f"{r['hours']:.2f}", f"{r['step']:,}"]
        + [_with_sem(r[n], r[f"{n}_sem"]) for n in shown]
        for r in table.to_dict("records")
    ]
    lines.append(markdown_table(header + [SCORES[n] for n in shown], rows))
    shared = _shared_step(members)
    lines += ["", *_side_by_side(paper_task, members, shared, shown), ""]
    figure = out / "recorded" / f"runs-{profile}-{task}.{fmt}"
    curve = next((n for n in CURVE_ORDER if n in shown), None)
    if curve is not None and (table["step"] > 0).any():  # a curve needs a scored step after 0
        _curves_figure(members, curve, figure)
        lines += [f"![held-out curves](recorded/{figure.name})", ""]
    lines += _rates_and_reach(members, paper_task, shown, figure.with_name(f"{figure.stem}-reach.{fmt}"))
    grids, owners = _grids(members)
    decided = grid_claims(grids, paper_task, task) if grids else []
    for folder, _, _ in members:
        mine = [d for d in decided if owners.get(d[0]["method"]) == folder]
        rel = f"recorded/{folder.name}"
        if text := grid_markdown(folder, out / rel, rel, fmt, mine or None, paper_task):
            lines.append(text)
    return lines


def _grids(members: list[Member]) -> tuple[Grids, dict[str, Path]]:
    """The grids of the runs that have one, by method (the first run of a method, in name
    order: the grid claims compare one run per method), and the folder of each."""
    grids: Grids = {}
    owners: dict[str, Path] = {}
    for folder, run, _ in members:
        method = run["train"]["method"]
        if method not in grids and (grid := read_grid(folder)) is not None:
            grids[method] = (grid, (int(run["train"]["sweeps"]), int(run["train"]["particles"])))
            owners[method] = folder
    return grids, owners


def runs_headline(root: Path, paper_all: dict[str, Any]) -> dict[str, Any]:
    """``reports/metrics.json``'s ``long_run`` entry: the grid claims' verdicts and the reach
    of their target sets, of the first profile and task whose runs decide them (empty when
    none do)."""
    for (_, task), members in by_task(continued_runs(root)).items():
        grids, _ = _grids(members)
        found = grid_metrics(grids, paper_all.get(task) or {}, task) if grids else {}
        if found:
            return found
    return {}


def _rates_and_reach(
    members: list[Member], paper_task: dict[str, Any], shown: list[str], figure: Path
) -> list[str]:
    """Each run's steps, wall hours and seconds per step per device; for a run whose task has a
    target on one of its scores, where a power law fitted to its curve meets it, and how many
    more hours that is at each device's rate."""
    rates, reach_rows, curves, targets = [], [], [], {}
    for folder, run, evals in members:
        history = pd.read_csv(folder / HISTORY) if (folder / HISTORY).is_file() else None
        per = sitting_rates(_segments(folder), history) if (folder / SEGMENTS).is_file() else pd.DataFrame()
        spec = curve_target(paper_task, run, shown)
        reach, done = float("nan"), int(evals["iteration"].iloc[-1])
        if spec is not None:
            score, target, total = spec["metric"], float(spec["target"]), int(run["train"]["iterations"])
            fit = power_law_fit(evals["iteration"].to_numpy(float), evals[score].to_numpy(float))
            reach = steps_to_reach(fit, target) if fit is not None else reach
            slope = "–" if fit is None else f"step^{fit[1]:.3f}"
            reach_rows.append(
                f"| `{folder.name}` | {target:g} (`{spec['id']}`) | {done:,} | {slope} | "
                f"{curve_reach_text(fit, target, done, total)} |"
            )
            curves.append((folder.name, evals, fit))
            targets[target] = (score, total)
        for r in per.itertuples():
            more = hours((reach - done) * r.seconds_per_step / 3600) if done < reach < float("inf") else ""
            rates.append(
                f"| `{folder.name}` | {r.device} | {int(r.steps):,} | {r.seconds / 3600:.2f} | "
                f"{r.seconds_per_step:.2f} |" + (f" {more} |" if targets else "")
            )
    lines = [
        "Each run's steps, wall hours and seconds per step on each device it trained on (the median over "
        "its logged windows of steps: a paused sitting does not count its pause)"
        + (
            ", and the hours more it would train there to meet its target at the step below"
            if targets
            else ""
        )
        + ":",
        "",
        "| run | device | steps | wall hours | seconds per step |"
        + (" hours to the target |" if targets else ""),
        "|---|---|---|---|---|" + ("---|" if targets else ""),
        *rates,
        "",
    ]
    if not targets:
        return lines
    (score, total), target = next(iter(targets.values())), next(iter(targets))
    curves_reach_figure(curves, score, SCORES[score], target, total, figure)
    return lines + [
        f"When each run would meet its target at the rate measured: the target is the paper numbers' "
        f"threshold on its held-out {SCORES[score]} (`pipeline/paper_numbers.yaml`, the claim named); a power "
        "law (error ∝ step^b) fitted to the later half of its curve after step 0, and the step where it meets "
        "the target. An extrapolation of a fit, not a measurement.",
        "",
        "| run | target | scored at | error ∝ | meets the target at |",
        "|---|---|---|---|---|",
        *reach_rows,
        "",
        f"![reach](recorded/{figure.name})",
        "",
    ]


def _shared_step(members: list[Member]) -> int:
    """The latest step at which every run of ``members`` has a held-out score."""
    steps = [set(evals["iteration"].astype(int)) for _, _, evals in members]
    common = set.intersection(*steps)
    return max(common) if common else 0


def _side_by_side(
    paper_task: dict[str, Any], members: list[Member], step: int, shown: list[str]
) -> list[str]:
    frames = []
    for _, run, evals in members:
        at = evals[evals["iteration"] == step]
        if len(at):
            frames.append({"method": run["train"]["method"], **{n: float(at.iloc[0][n]) for n in shown}})
    if not frames:
        return []
    table = pd.DataFrame(frames)
    paper = {r["method"]: r for r in paper_task.get("rows", []) if r.get("K") in (None, 10)}
    beside = (
        " (beside them the paper's Table 1(b) ESS/L after 200,000 steps, its overall one: per-sweep "
        "resampling, where ours is the last sweep's with resampling before each block)"
        if paper
        else ""
    )
    header = ["method", "seeds", *(SCORES[n] for n in shown), *(["paper ESS/L"] if paper else [])]
    rows, notes = [], []
    for method, scored in table.groupby("method", sort=False):
        paper_ess = paper.get(method, {}).get("sweep_ess")
        cells = [_score_text(scored, n) for n in shown]
        ratio = paper_ratio(scored["ess"].mean(), paper_ess) if "ess" in scored else float("nan")
        if is_far(ratio):
            notes.append(
                f"{FLAG}{len(notes) + 1} ESS/L: ratio {ratio_text(ratio)} ({method}) to the paper: "
                f"{departure_note(paper_task.get('departure_notes'), 'sweep_ess', method)}"
            )
            cells[shown.index("ess")] += f" {FLAG}{len(notes)}"
        if paper:
            cells.append("" if paper_ess is None else f"{paper_ess:g}")
        rows.append([method, str(len(scored)), *cells])
    lines = [f"At step {step:,}, the latest every run of the task has been scored at{beside}:", ""]
    lines.append(markdown_table(header, rows))
    if notes:
        lines += ["", FLAG_RULE, "", *(f"- {n}" for n in notes)]
    return lines


def _curves_figure(members: list[Member], score: str, path: Path) -> None:
    """Each run's held-out curve; beside it the same curves from a quarter of the longest run's
    steps on, at the scale of the later scores (the first steps' scores, far below, would set
    the scale and hide the differences the comparison is about)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    later = 0.25 * max(float(evals["iteration"].max()) for _, _, evals in members)
    colours: dict[str, str] = {}
    for _, run, evals in members:
        method = run["train"]["method"]
        label = None if method in colours else method  # one legend entry a method
        colour = colours.setdefault(method, f"C{len(colours)}")
        tail = evals[evals["iteration"] >= later]
        axes[0].plot(evals["iteration"], evals[score], "o-", ms=2, lw=0.8, color=colour, label=label)
        axes[1].plot(tail["iteration"], tail[score], "o-", ms=2, lw=0.8, color=colour, label=label)
    for ax in axes:
        ax.set(xlabel="training step", ylabel=SCORES[score])
    axes[0].set_title("every step", fontsize=8)
    axes[1].set_title(f"from step {later:,.0f}", fontsize=8)
    axes[1].legend(fontsize=7)
    _save(
        fig,
        path,
        f"Held-out {SCORES[score]} of each continuing run against its training steps (one line a seed; "
        "right: the later steps at their own scale).",
    )
