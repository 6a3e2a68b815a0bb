"""When a continuing run would meet its task's target at the rate measured.

From its held-out curve (``evals.csv``): a power law fitted to the later half of the curve,
the step where it meets the target and the hours that are at each device's rate. The target
is the paper numbers' (``pipeline/paper_numbers.yaml``): the first threshold claim of the
task that bounds one of the run's held-out scores from above on the set the run is scored on,
at the run's K and L; a task without one (the rings) has no reach.

From its held-out grid (``grid.csv``, :mod:`pipeline.report.grid`): for each target set of
``bmnist.long_run_claims``, a power law fitted to the set's position error over the steps its
grid was scored at, with an inverse-regression interval, against the paper's training length
(the rule: ``bmnist.long_run_reach``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import LogLocator
from scipy import stats

from pipeline.report import exact
from pipeline.report.figures import _save, plain_numbers

FIT_MIN_POINTS = 3  # a curve's fit needs this many scored steps after step 0
CLAIM_LISTS = ("claims", "paper_scale_claims", "long_run_claims")  # where a task's targets are


def curve_target(paper_task: dict[str, Any], run: dict[str, Any], scores: list[str]) -> dict[str, Any] | None:
    """The claim (``paper_task``: the task's paper numbers) whose target the run's curve is
    read against: the first threshold ``<=`` on one of ``scores`` (the run's held-out
    scores) on the set the run is scored on (a claim that names no set: the first held-out
    set, the run's) at the run's K and L; ``None`` without one."""
    name, pair = run["eval"]["name"], [run["train"]["sweeps"], run["train"]["particles"]]
    for key in CLAIM_LISTS:
        for spec in paper_task.get(key) or []:
            if (spec["kind"], spec.get("op"), spec.get("pair")) == ("threshold", "<=", pair) and (
                spec["metric"] in scores and spec.get("test_set", name) == name
            ):
                return spec
    return None


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


def hours(value: float) -> str:
    """Whole hours, or two significant figures below ten (a GPU's are fractions of one)."""
    return f"{value:,.0f}" if value >= 10 else f"{value:.2g}"


def curve_reach_text(fit: tuple[float, float] | None, target: float, done: int, total: int) -> str:
    """A table cell: where the fitted law meets ``target``, against the run's ``total`` steps."""
    if fit is None:
        return f"too few scored steps after the first (a fit needs {FIT_MIN_POINTS})"
    reach = steps_to_reach(fit, target)
    if not np.isfinite(reach):
        return "does not fall: not reached at this rate of learning"
    if reach <= done:
        return "at or below the target already"
    return f"step {_steps(reach)}, {'within' if reach <= total else 'beyond'} the paper's {total:,} steps"


def curves_reach_figure(
    curves: list[tuple[str, pd.DataFrame, tuple[float, float] | None]],
    score: str,
    label: str,
    target: float,
    total: int,
    path: Path,
) -> None:
    """Each run's held-out curve (``(name, evals, fit)``) after step 0 on log axes, ± its
    standard error, with its power-law fit drawn to the ``total`` steps and the target."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, (name, evals, fit) in enumerate(curves):
        shown = evals[evals["iteration"] > 0]
        sem = shown[f"{score}_sem"] if f"{score}_sem" in shown else None
        ax.errorbar(shown["iteration"], shown[score], yerr=sem, fmt="o-", ms=3, color=f"C{i}", label=name)
        if fit is not None and len(shown):
            a, b = fit
            steps = exact.geomspace(shown["iteration"].min(), total, 100)
            ax.plot(steps, exact.exp(a + b * exact.log(steps)), "--", color=f"C{i}", lw=0.8)
    ax.axhline(target, color="grey", lw=0.8, ls=":", label=f"target {target:g}")
    ax.set(xscale="log", yscale="log", xlabel="training step", ylabel=label)
    plain_numbers(ax)
    ax.legend(fontsize=6)
    _save(
        fig,
        path,
        f"Held-out {label} of each run against its training steps, the power law fitted to the later "
        "half of its curve (dashed) and the target (dotted).",
    )


HORIZON = 1e12  # steps: a band that has not met the target by then is read as never meeting it


@dataclass(frozen=True)
class Reach:
    """One target set's trend: the steps and means it was fitted to, the fitted slope of
    log error on log step, and the steps where the line (``at``) and its band (``earliest``,
    ``latest``) meet the target (``inf``: never)."""

    set: str
    target: float
    points: pd.DataFrame  # iteration, pos_err (mean over videos), sem
    videos: int
    slope: float = float("nan")
    intercept: float = float("nan")
    at: float = float("nan")
    earliest: float = float("nan")
    latest: float = float("nan")
    verdict: str = "too few steps"
    band_terms: tuple[float, int, float, float] = (float("nan"), 0, float("nan"), float("nan"))

    def band(self, steps: np.ndarray) -> np.ndarray:
        """The half-width, in log error, of the fitted line's band at ``steps``."""
        return _half_width(self.band_terms, exact.log(steps))


def _half_width(terms: tuple[float, int, float, float], log_steps: np.ndarray) -> np.ndarray:
    """``t s sqrt(1/n + (x - mean x)^2 / Sxx)`` for ``terms = (t s, n, mean x, Sxx)``."""
    scale, n, centre, sxx = terms
    return scale * np.sqrt(1 / n + (log_steps - centre) ** 2 / sxx)


def trend_points(grid: pd.DataFrame, name: str) -> tuple[pd.DataFrame, int]:
    """The set's final-sweep position error per step, as means over videos, at the steps
    scored on the same videos as its latest step; and how many videos that is. A set's
    videos are fixed by its seed and their number (``simulate_videos`` draws them together),
    so the same videos are the same number of them."""
    rows = grid[grid["set"] == name]
    rows = rows[rows["sweep"] == rows.groupby(["iteration", "video"])["sweep"].transform("max")]
    counts = rows.groupby("iteration")["video"].nunique()
    videos = int(counts.loc[counts.index.max()])
    rows = rows[rows["iteration"].isin(counts[counts == videos].index)]
    by = rows.groupby("iteration")["pos_err"]
    points = pd.DataFrame({"pos_err": by.mean(), "sem": by.sem()}).reset_index()
    return points, videos


def reach(points: pd.DataFrame, name: str, target: float, videos: int, rule: dict[str, Any]) -> Reach:
    """Fit and read off :class:`Reach` by the rule (``limit_steps``, ``confidence``,
    ``min_steps``)."""
    base = Reach(name, target, points, videos)
    if len(points) < rule["min_steps"]:
        return base
    # exact: the fit, its line and band come out to the same bits on any CPU (the figure's bytes)
    x, y = exact.log(points["iteration"].to_numpy(float)), exact.log(points["pos_err"].to_numpy(float))
    intercept, slope = exact.line_fit(x, y)
    n = len(x)
    spread = np.sqrt(np.sum((y - intercept - slope * x) ** 2) / (n - 2))
    t = stats.t.ppf(0.5 + rule["confidence"] / 2, n - 2)
    terms = (float(t * spread), n, float(x.mean()), float(np.sum((x - x.mean()) ** 2)))
    xs = np.linspace(x.min(), math.log(HORIZON), 200_000)
    line = intercept + slope * xs
    half = _half_width(terms, xs)
    goal = math.log(target)

    def first(below: np.ndarray) -> float:
        return float(exact.exp(xs[np.argmax(below)])) if below.any() else float("inf")

    earliest, latest, at = first(line - half <= goal), first(line + half <= goal), first(line <= goal)
    if points["pos_err"].iloc[-1] <= target:
        verdict = "reached"
    elif earliest > rule["limit_steps"]:
        verdict = "out of reach"
    elif latest <= rule["limit_steps"]:
        verdict = "within reach"
    else:
        verdict = "undecided"
    return Reach(name, target, points, videos, slope, intercept, at, earliest, latest, verdict, terms)


def reaches(grid: pd.DataFrame, paper: dict[str, Any]) -> list[Reach]:
    """:func:`reach` for each threshold claim of ``paper`` (the ``bmnist`` section) whose set
    APG's ``grid`` has."""
    rule = paper["long_run_reach"]
    out = []
    for spec in paper.get("long_run_claims") or []:
        if spec["kind"] != "threshold" or spec["test_set"] not in set(grid["set"]):
            continue
        points, videos = trend_points(grid, spec["test_set"])
        out.append(reach(points, spec["test_set"], float(spec["target"]), videos, rule))
    return out


def _steps(value: float) -> str:
    if not np.isfinite(value):
        return "never"
    return f"{value:,.0f}" if value < 1e7 else f"{value:.1e}"


def reach_markdown(grid: pd.DataFrame, paper: dict[str, Any], out_dir: Path, rel: str, fmt: str) -> list[str]:
    """The section's lines: a row per target set and the figure of the fits."""
    found = reaches(grid, paper)
    if not found:
        return []
    rule = paper["long_run_reach"]
    limit = rule["limit_steps"]
    figure = out_dir / f"reach.{fmt}"
    reach_figure(found, limit, figure)
    lines = [
        "##### When the targets would be met at the rate measured",
        "",
        f"Each target set's final-sweep position error at every step its grid was scored on the "
        f"same videos, a power law fitted to it, and the step where the fit meets the target, "
        f"with the steps where its {rule['confidence']:.0%} band does (an inverse-regression "
        f"interval), against the paper's {limit:,} training steps. Rule (set before the grid was "
        "scored at more than two steps): `bmnist.long_run_reach` in `pipeline/paper_numbers.yaml`. "
        "An extrapolation of a fit, not a measurement; a power law has no floor, so it is the "
        "optimistic reading of a curve that levels off.",
        "",
        "| set | target (px) | videos | steps fitted | error at the last (px) | error ∝ step^b | "
        "meets the target at step [band] | × the paper's steps | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in found:
        steps = ", ".join(f"{int(s):,}" for s in r.points["iteration"])
        last = r.points.iloc[-1]
        if r.verdict == "too few steps":
            lines.append(
                f"| {r.set} | {r.target:g} | {r.videos} | {steps} | {last['pos_err']:.2f} | – | – | – | "
                f"too few steps (a fit needs {rule['min_steps']}) |"
            )
            continue
        ratio = f"{r.at / limit:,.2g}" if np.isfinite(r.at) else "–"
        lines.append(
            f"| {r.set} | {r.target:g} | {r.videos} | {steps} | {last['pos_err']:.2f} | {r.slope:.3f} | "
            f"{_steps(r.at)} [{_steps(r.earliest)}, {_steps(r.latest)}] | {ratio} | {r.verdict} |"
        )
    return lines + ["", f"![reach]({rel}/{figure.name})", ""]


def reach_figure(found: list[Reach], limit: int, path: Path) -> None:
    fig, axes = plt.subplots(1, len(found), figsize=(3.0 * len(found), 2.8), sharey=True, squeeze=False)
    for ax, r in zip(axes[0], found, strict=True):
        p = r.points
        ax.errorbar(p["iteration"], p["pos_err"], yerr=1.96 * p["sem"].fillna(0), fmt="o", ms=3, color="C0")
        if np.isfinite(r.slope):
            xs = exact.geomspace(p["iteration"].min(), 10 * limit, 100)
            line = r.intercept + r.slope * exact.log(xs)
            ax.plot(xs, exact.exp(line), "k--", lw=0.8)
            half = r.band(xs)
            ax.fill_between(xs, exact.exp(line - half), exact.exp(line + half), color="k", alpha=0.1, lw=0)
        ax.axhline(r.target, color="grey", ls=":", lw=0.8)
        ax.axvline(limit, color="C3", ls=":", lw=0.8)
        ax.set(xscale="log", yscale="log", title=f"{r.set}: {r.verdict}", xlabel="training step")
        ax.title.set_fontsize(8)
        plain_numbers(ax)
        ax.xaxis.set_major_locator(LogLocator(numticks=12))  # decades only: five share the width
    axes[0][0].set_ylabel("position error (px)")
    _save(
        fig,
        path,
        "Final-sweep position error of the run's states (mean and 95% interval over videos), "
        "the power law fitted to it (dashed) with its band (shaded), the target (dotted grey) "
        f"and the paper's {limit:,} steps (dotted red).",
    )
