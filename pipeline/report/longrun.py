"""The long Bouncing MNIST run (``apg-pipeline long-run``, ``recorded/bmnist-long/``) in the
report: its held-out learning curve with each sitting's device, its sittings, and, from a
power law fitted to the curve, when its target would be met at the rate measured; then the
baselines trained the same way (``recorded/bmnist-long-<method>/``) beside it, step for step."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from pipeline.report import exact
from pipeline.report.figures import _save, plain_numbers
from pipeline.report.longrun_grid import grid_markdown, long_run_metrics
from pipeline.runs.spec import EVALS, HISTORY, RUN, SEGMENTS, count_and_sizes
from pipeline.runs.spec import LONG_RUN_DIR as RUN_DIR
from pipeline.runs.spec import LONG_RUN_METHOD as METHOD
from pipeline.runs.spec import long_run_dir as run_dir_of

TARGET_PX = 3.0  # position error the paper's tracking reaches at T10_D3 (issue target)
FIT_MIN_POINTS = 3
BASELINES = ("rws-mlp", "avf")  # methods whose long runs stand beside APG's when recorded


def power_law_fit(steps: np.ndarray, errors: np.ndarray) -> tuple[float, float] | None:
    """``(a, b)`` of ``log err = a + b log step`` by least squares over the later half of the
    evaluations after step 0 (at least ``FIT_MIN_POINTS``); ``None`` with fewer points."""
    keep = steps > 0
    steps, errors = steps[keep], errors[keep]
    if len(steps) < FIT_MIN_POINTS:
        return None
    later = max(FIT_MIN_POINTS, (len(steps) + 1) // 2)
    return exact.line_fit(exact.log(steps[-later:]), exact.log(errors[-later:]))


def steps_to_reach(fit: tuple[float, float], target: float) -> float:
    """The step at which the fitted law reaches ``target``; ``inf`` when it does not fall."""
    a, b = fit
    return float(exact.exp((math.log(target) - a) / b)) if b < 0 else float("inf")


def sitting_rates(segments: pd.DataFrame, history: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per device: steps, wall seconds and seconds per step. With the run's ``history`` (a
    rate per logged window of steps), the median window's seconds per step: a sitting paused
    for a while (a stopped process, a suspended machine) does not count its pause as
    training; without it, wall seconds over steps (scoring included)."""
    frame = segments.assign(steps=segments["to_iteration"] - segments["from_iteration"])
    frame = frame[frame["steps"] > 0]
    per = frame.groupby("device", sort=False)[["steps", "seconds"]].sum().reset_index()
    per = per.assign(seconds_per_step=per["seconds"] / per["steps"])
    if history is not None and {"it_per_s", "device"} <= set(history.columns):
        median = (1.0 / history["it_per_s"]).groupby(history["device"]).median()
        per["seconds_per_step"] = per["device"].map(median).fillna(per["seconds_per_step"])
    return per


def long_run_markdown(root: Path, out: Path, fmt: str) -> str:
    run_dir = root / RUN_DIR
    if not (run_dir / EVALS).is_file():
        return ""
    run = json.loads((run_dir / RUN).read_text())
    evals = pd.read_csv(run_dir / EVALS)
    segments = pd.read_csv(run_dir / SEGMENTS)
    figure = out / "recorded" / run_dir.name / f"curve.{fmt}"
    fit = power_law_fit(evals["iteration"].to_numpy(float), evals["pos_err"].to_numpy(float))
    curve_figure(evals, fit, run, figure)
    train, ev = run["train"], run["eval"]
    (videos, sizes), (held, _) = count_and_sizes(run["rows"]), count_and_sizes(ev)
    last = evals.iloc[-1]
    history = pd.read_csv(run_dir / HISTORY) if (run_dir / HISTORY).is_file() else None
    rates = sitting_rates(segments, history)
    lines = [
        "## Bouncing MNIST at the paper's configuration: one long run",
        "",
        f"`apg-pipeline long-run` (`pipeline/runs/`, state in `{RUN_DIR.as_posix()}/`): APG, "
        f"K = {train['sweeps']}, L = {train['particles']}, batch {train['batch_size']}, lr {train['lr']:g}, "
        f"{videos:,} training videos of {sizes.get('num_digits', 3)} digits and "
        f"{sizes.get('num_frames', 10)} frames (the `{run['profile']}` profile), continued from where it "
        f"stopped on whatever machine runs it. Scored every {run['every']['eval']} steps on "
        f"{held} held-out {ev['name']} videos (position error of the highest-weight "
        f"particle after the last sweep, mean ± standard error over videos).",
        "",
        f"![learning curve](recorded/{run_dir.name}/{figure.name})",
        "",
        f"At step {int(last['iteration']):,} of {train['iterations']:,}: **{last['pos_err']:.2f} px** "
        f"(± {last['pos_err_sem']:.2f}) on {ev['name']}; target {TARGET_PX:g} px.",
        "",
        "| device | steps | wall hours | seconds per step (median over logged windows of steps) |",
        "|---|---|---|---|",
        *(
            f"| {r.device} | {int(r.steps):,} | {r.seconds / 3600:.2f} | {r.seconds_per_step:.2f} |"
            for r in rates.itertuples()
        ),
        "",
        extrapolation_text(fit, int(last["iteration"]), train["iterations"], rates),
        "",
        grid_markdown(
            run_dir,
            figure.parent,
            f"recorded/{run_dir.name}",
            fmt,
            others={m: root / run_dir_of(m) for m in BASELINES},
        ),
        baselines_markdown(root, out, fmt, evals),
    ]
    return "\n".join(lines)


def long_run_headline(root: Path) -> dict[str, Any]:
    """``reports/metrics.json``'s ``long_run`` entry (empty without the run's grid)."""
    run_dir = root / RUN_DIR
    if not (run_dir / RUN).is_file():
        return {}
    return long_run_metrics(run_dir, {m: root / run_dir_of(m) for m in BASELINES})


def baselines_markdown(root: Path, out: Path, fmt: str, apg: pd.DataFrame) -> str:
    """The baselines' long runs beside APG's: their held-out curves in one figure and the
    position errors at the steps APG and a baseline have scored (empty without a baseline run)."""
    curves = {METHOD: apg}
    for method in BASELINES:
        path = root / run_dir_of(method) / EVALS
        if path.is_file():
            curves[method] = pd.read_csv(path)
    if len(curves) == 1:
        return ""
    figure = out / "recorded" / RUN_DIR.name / f"methods.{fmt}"
    methods_figure(curves, figure)
    # The steps APG and at least one baseline scored (step 0: the untrained networks, left out)
    apg_steps = set(apg["iteration"]) - {0}
    steps = sorted(apg_steps & set().union(*(set(c["iteration"]) for m, c in curves.items() if m != METHOD)))
    lines = [
        "### Baselines trained the same way",
        "",
        "Each baseline's own long run (`apg-pipeline long-run --start paper --method M`, state in "
        f"`recorded/{RUN_DIR.name}-M/`): the `paper` profile's cell of the method at the same K·L, on "
        "the same videos in the same order with the same batch, learning rate and seed, scored on the "
        "same held-out videos, so the curves compare at equal training steps (one run each: no "
        "verdicts; the spreads are over videos).",
        "",
        f"![methods](recorded/{RUN_DIR.name}/{figure.name})",
        "",
    ]
    if steps:
        indexed = {m: c.set_index("iteration") for m, c in curves.items()}
        lines += [
            "| step | " + " | ".join(f"{m} (px)" for m in curves) + " |",
            "|---" * (len(curves) + 1) + "|",
            *(
                f"| {step:,} | "
                + " | ".join(
                    f"{indexed[m].loc[step, 'pos_err']:.2f} ± {indexed[m].loc[step, 'pos_err_sem']:.2f}"
                    if step in indexed[m].index
                    else "–"
                    for m in curves
                )
                + " |"
                for step in steps
            ),
            "",
        ]
    for method in curves:
        if method != METHOD:
            run_dir = root / run_dir_of(method)
            last = curves[method].iloc[-1]
            lines += [
                f"`{method}`: step {int(last['iteration']):,}, {last['pos_err']:.2f} px (± "
                f"{last['pos_err_sem']:.2f}).",
                "",
                grid_markdown(run_dir, out / "recorded" / run_dir.name, f"recorded/{run_dir.name}", fmt),
            ]
    return "\n".join(lines)


def draw_curve(ax, evals: pd.DataFrame, colour: str, label: str) -> None:
    """A held-out curve: position error ± its standard error against steps."""
    ax.errorbar(
        evals["iteration"],
        evals["pos_err"],
        yerr=evals["pos_err_sem"],
        fmt="o-",
        ms=3,
        color=colour,
        label=label,
    )


def methods_figure(curves: dict[str, pd.DataFrame], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, (method, evals) in enumerate(curves.items()):
        draw_curve(ax, evals[evals["iteration"] > 0], f"C{i}", method)
    ax.axhline(TARGET_PX, color="grey", lw=0.8, ls=":", label=f"target {TARGET_PX:g} px")
    ax.set(xscale="log", yscale="log", xlabel="training step", ylabel="T10_D3 position error (px)")
    plain_numbers(ax)
    ax.legend(fontsize=7)
    _save(
        fig,
        path,
        "Held-out T10_D3 position error of each method's long run (same videos, order, batch, "
        "learning rate and seed) against its training steps.",
    )


def _hours(hours: float) -> str:
    """Whole hours, or two significant figures below ten (a GPU's are fractions of one)."""
    return f"{hours:,.0f}" if hours >= 10 else f"{hours:.2g}"


def extrapolation_text(fit: tuple[float, float] | None, done: int, total: int, rates: pd.DataFrame) -> str:
    if fit is None:
        return f"Too few scored steps after the first to fit a trend (a fit needs {FIT_MIN_POINTS})."
    a, b = fit
    law = f"A power law fitted to the later half of the curve (error ∝ step^{b:.3f})"
    reach = steps_to_reach(fit, TARGET_PX)
    if not np.isfinite(reach):
        return f"{law} does not fall: at this rate of learning the target is not reached."
    if reach <= done:
        return f"{law} is at or below the target already."
    where = "within" if reach <= total else "beyond"
    times = "; ".join(
        f"{_hours((reach - done) * r.seconds_per_step / 3600)} more hours on {r.device}"
        for r in rates.itertuples()
    )
    return (
        f"{law} reaches {TARGET_PX:g} px at step {reach:,.0f}, {where} the paper's {total:,} steps: "
        f"{times} at the rates measured. An extrapolation of a fit, not a measurement."
    )


def curve_figure(
    evals: pd.DataFrame, fit: tuple[float, float] | None, run: dict[str, Any], path: Path
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    shown = evals[evals["iteration"] > 0]
    for i, (device, rows) in enumerate(shown.groupby("device", sort=False)):
        draw_curve(ax, rows, f"C{i}", device if len(device) < 60 else device[:57] + "...")
    if fit is not None and len(shown):
        a, b = fit
        steps = exact.geomspace(shown["iteration"].min(), run["train"]["iterations"], 100)
        fitted = exact.exp(a + b * exact.log(steps))
        ax.plot(steps, fitted, "k--", lw=0.8, label=f"power-law fit (step^{b:.2f})")
    ax.axhline(TARGET_PX, color="grey", lw=0.8, ls=":", label=f"target {TARGET_PX:g} px")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="training step",
        ylabel=f"{run['eval']['name']} position error (px)",
    )
    plain_numbers(ax)
    ax.legend(fontsize=6)
    _save(
        fig,
        path,
        f"Held-out {run['eval']['name']} position error as the long run trains; colour: the device of each sitting.",
    )
