"""Continuing runs at the paper's configuration in the report (``apg-pipeline continue``,
``recorded/<profile>-<task>-<method>-K<k>-L<l>-s<seed>/``): for each task, every run's step,
sittings and latest held-out scores, the methods side by side at the latest step all their
runs have been scored at, the paper's numbers beside them, and the held-out curves.

Reads the runs' tables only (``run.json``, ``evals.csv``, ``segments.csv``); the long
Bouncing MNIST runs have a section of their own (:mod:`pipeline.report.longrun`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd

from pipeline.report.departures import FLAG, FLAG_RULE, departure_note, is_far, paper_ratio, ratio_text
from pipeline.report.figures import _save
from pipeline.runs.spec import EVALS, LONG_RUN_DIR, RUN, RUNS_DIR, SEGMENTS
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


def continued_runs(root: Path) -> list[tuple[Path, dict[str, Any], pd.DataFrame]]:
    """The runs under ``recorded/`` that :func:`pipeline.runs.spec.run_name` names (every
    folder with a ``run.json`` but the long Bouncing MNIST runs'), in name order."""
    found = []
    for run_json in sorted((root / RUNS_DIR).glob(f"*/{RUN}")):
        folder = run_json.parent
        if folder.name.startswith(LONG_RUN_DIR.name) or not (folder / EVALS).is_file():
            continue
        found.append((folder, json.loads(run_json.read_text()), pd.read_csv(folder / EVALS)))
    return found


def _run_row(folder: Path, run: dict[str, Any], evals: pd.DataFrame) -> dict[str, Any]:
    segments = pd.read_csv(folder / SEGMENTS) if (folder / SEGMENTS).is_file() else pd.DataFrame()
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
    return row


def _score_text(rows: pd.DataFrame, name: str) -> str:
    values = rows[name].dropna().to_numpy()
    if len(values) == 0:
        return ""
    if len(values) == 1:
        return f"{values[0]:.4g} (one seed)"
    found = seed_interval(values)
    return f"{found.mean:.4g} [{found.lo:.4g}, {found.hi:.4g}]"


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
        "each run's latest held-out scores (its task's first held-out set, scored every few hundred steps), "
        "then the methods side by side at the latest step every run of the task has been scored at "
        "(mean over seeds, 95% interval over seeds). These runs are short of the paper's steps; no claim is "
        "judged on them until their curves plateau.",
        "",
    ]
    by_task: dict[tuple[str, str], list[tuple[Path, dict[str, Any], pd.DataFrame]]] = {}
    for folder, run, evals in runs:
        by_task.setdefault((run.get("profile", "?"), run["train"]["task"]), []).append((folder, run, evals))
    for (profile, task), members in by_task.items():
        table = pd.DataFrame([_run_row(*member) for member in members])
        shown = [name for name in SCORES if name in table]
        first = members[0][1]
        rows_spec = first["rows"]
        lines += [
            f"### {task}, `{profile}` profile",
            "",
            f"K = {first['train']['sweeps']}, L = {first['train']['particles']}, batch "
            f"{first['train']['batch_size']}, lr {first['train']['lr']:g}, "
            f"{rows_spec.get('num_datasets', rows_spec.get('num_videos')):,} training datasets; held-out set "
            f"`{first['eval']['name']}` ({first['eval'].get('num_datasets', first['eval'].get('num_videos'))} datasets).",
            "",
            "| run | method | seed | steps trained | of | sittings | hours | scored at | "
            + " | ".join(SCORES[n] for n in shown)
            + " |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in shown) + " |",
        ]
        for r in table.itertuples():
            values = " | ".join(f"{getattr(r, n):.4g}" for n in shown)
            lines.append(
                f"| `{r.run}` | {r.method} | {r.seed} | {r.trained:,} | {r.of:,} | {r.sittings} | {r.hours:.2f} "
                f"| {r.step:,} | {values} |"
            )
        shared = _shared_step(members)
        lines += ["", *_side_by_side(paper_all.get(task, {}), members, shared, shown), ""]
        figure = out / "recorded" / f"runs-{profile}-{task}.{fmt}"
        curve = next((n for n in CURVE_ORDER if n in shown), None)
        if curve is not None and (table["step"] > 0).any():  # a curve needs a scored step after 0
            _curves_figure(members, curve, figure)
            lines += [f"![held-out curves](recorded/{figure.name})", ""]
    return "\n".join(lines) + "\n"


def _shared_step(members: list[tuple[Path, dict[str, Any], pd.DataFrame]]) -> int:
    """The latest step at which every run of ``members`` has a held-out score."""
    steps = [set(evals["iteration"].astype(int)) for _, _, evals in members]
    common = set.intersection(*steps)
    return max(common) if common else 0


def _side_by_side(
    paper_task: dict[str, Any],
    members: list[tuple[Path, dict[str, Any], pd.DataFrame]],
    step: int,
    shown: list[str],
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
    lines = [
        f"At step {step:,}, the latest every run of the task has been scored at "
        "(beside them the paper's Table 1(b) ESS/L after 200,000 steps, its overall one: per-sweep "
        "resampling, where ours is the last sweep's with resampling before each block):",
        "",
        "| method | seeds | " + " | ".join(SCORES[n] for n in shown) + " | paper ESS/L |",
        "| --- | --- | " + " | ".join("---" for _ in shown) + " | --- |",
    ]
    notes = []
    for method, rows in table.groupby("method", sort=False):
        paper_ess = paper.get(method, {}).get("sweep_ess")
        cells = [_score_text(rows, n) for n in shown]
        ratio = paper_ratio(rows["ess"].mean(), paper_ess) if "ess" in rows else float("nan")
        if is_far(ratio):
            notes.append(
                f"{FLAG}{len(notes) + 1} ESS/L: ratio {ratio_text(ratio)} ({method}) to the paper: "
                f"{departure_note(paper_task.get('departure_notes'), 'sweep_ess', method)}"
            )
            cells[shown.index("ess")] += f" {FLAG}{len(notes)}"
        paper_text = "" if paper_ess is None else f"{paper_ess:g}"
        lines.append(f"| {method} | {len(rows)} | {' | '.join(cells)} | {paper_text} |")
    if notes:
        lines += ["", FLAG_RULE, "", *(f"- {n}" for n in notes)]
    return lines


def _curves_figure(members: list[tuple[Path, dict[str, Any], pd.DataFrame]], score: str, path: Path) -> None:
    """Each run's held-out curve; beside it the same curves from a quarter of the longest run's
    steps on, at the scale of the later scores (the first steps' scores, far below, would set
    the scale and hide the differences the comparison is about)."""
    path.parent.mkdir(parents=True, exist_ok=True)
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
