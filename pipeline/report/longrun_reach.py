"""When the long run would meet its targets at the rate measured: for each target set of
``bmnist.long_run_claims``, a power law fitted to the set's position error over the steps
its grid was scored at, with an inverse-regression interval, against the paper's training
length (the rule: ``bmnist.long_run_reach`` in pipeline/paper_numbers.yaml)."""

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
        "#### When the targets would be met at the rate measured",
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
    path.parent.mkdir(parents=True, exist_ok=True)
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
        "Final-sweep position error of the long run's states (mean and 95% interval over videos), "
        "the power law fitted to it (dashed) with its band (shaded), the target (dotted grey) "
        f"and the paper's {limit:,} steps (dotted red).",
    )
