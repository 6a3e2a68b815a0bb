"""The report's figures: Figure 2 (budgets), curves over sweeps, KL, compute, training
curves, Figure-1-style samples and the GIF."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np
import pandas as pd
import seaborn as sns

from apg.data import atomic_write
from apg.tasks import get_task
from pipeline.present import write_gif
from pipeline.report.data import CURVE_METRICS, finals
from pipeline.report.tables import _label
from pipeline.report.training import NOT_ASSESSABLE, NOT_PLATEAUED, PLATEAU_FRACTION


def mean_std(frame: pd.DataFrame, by: list[str], spread: str = "std") -> pd.DataFrame:
    """Mean and ``spread`` (``std``, or ``sem`` for the standard error) of ``value`` per group."""
    return frame.groupby(by)["value"].agg(["mean", spread]).fillna(0.0).reset_index()


# Where a metric's values can lie: a band of mean ± spread is cut there (an error bar below
# zero on a KL or a pixel error shows a value that cannot occur).
NONNEGATIVE = ("kl_", "mse", "pos_err", "box_err", "centre_err", "model_evals")
FRACTIONS = ("ess", "sweep_ess", "tracked", "swapped")


def support(metric: str) -> tuple[float, float]:
    """The range a metric's values can take: ``[0, 1]`` for ESS/L and fractions of frames,
    ``[0, inf)`` for divergences, errors and counts, else the real line."""
    if metric.startswith(FRACTIONS):
        return 0.0, 1.0
    if metric.startswith(NONNEGATIVE):
        return 0.0, math.inf
    return -math.inf, math.inf


def band(metric: str, mean: Any, spread: Any) -> tuple[np.ndarray, np.ndarray]:
    """``mean - spread`` and ``mean + spread`` cut to the metric's ``support`` (an estimate
    outside it, such as a KL estimate just below zero, keeps its own end there)."""
    lo, hi = support(metric)
    mean, spread = np.asarray(mean, dtype=float), np.asarray(spread, dtype=float)
    return np.maximum(mean - spread, np.minimum(mean, lo)), np.minimum(mean + spread, np.maximum(mean, hi))


def yerr(metric: str, mean: Any, spread: Any) -> np.ndarray:
    """Asymmetric error bars ``(2, n)`` for ``errorbar``: ``band`` as distances from the mean."""
    low, high = band(metric, mean, spread)
    mean = np.asarray(mean, dtype=float)
    return np.vstack([mean - low, high - mean])


# A method whose final log joint lies this far outside APG's range of means (in multiples
# of that range, plus a few nats) would set the scale of Figure 2's log-joint panel and hide
# the gain the fixed-budget claim tests: it is drawn in a panel of its own.
OFF_SCALE_RANGES, OFF_SCALE_NATS = 4.0, 10.0


def off_scale(stats: pd.DataFrame, reference: str = "apg") -> list[str]:
    """The methods of ``stats`` (``method``, ``mean``) whose mean leaves ``reference``'s range of
    means by more than ``OFF_SCALE_RANGES`` times its width plus ``OFF_SCALE_NATS``."""
    ref = stats.loc[stats["method"] == reference, "mean"]
    if ref.empty:
        return []
    lo, hi = float(ref.min()), float(ref.max())
    margin = OFF_SCALE_RANGES * max(hi - lo, 1.0) + OFF_SCALE_NATS
    far = stats[(stats["mean"] < lo - margin) | (stats["mean"] > hi + margin)]
    return sorted(set(far["method"]) - {reference})


def budget_figure(
    frame: pd.DataFrame, retrained: pd.DataFrame, meta: dict[str, Any], caption: str, path: Path
) -> bool:
    """Figure 2: final log joint and ESS/L versus K at K*L fixed. Solid: cells retrained at
    each (K, L = total // K), each evaluated at its own pair; dashed: each method's main
    cells at the test-time budget pairs (one model, as the paper did). Shaded: the standard
    error of the mean over seeds x datasets, the precision of the means the claims compare
    (datasets differ from each other by far more than methods do). Methods far off APG's
    scale of log joint (``off_scale``) get a third panel with every method, so that the
    first shows APG's gain with K at a scale where it can be seen."""
    pairs = {tuple(p) for p in (meta.get("budget") or {}).get("pairs", [])}
    fin = finals(frame)
    test_time = fin[[(k, l) in pairs for k, l in zip(fin["K"], fin["L"], strict=False)]]
    own = finals(retrained)
    if test_time.empty and own.empty:
        return False
    methods = sorted(set(test_time["method"]) | set(own["method"]))
    colors = dict(zip(methods, sns.color_palette("tab10", len(methods)), strict=False))
    totals = sorted({int(k * l) for k, l in zip(own["K"], own["L"], strict=False)})
    total = (meta.get("budget") or {}).get("total") or (totals[-1] if totals else None)
    parts = [(own, "-", "retrained per budget"), (test_time, "--", "one model, test-time budgets")]
    stats = {
        (style, metric): mean_std(part[part["metric"] == metric], ["method", "K"], "sem")
        for part, style, _ in parts
        for metric in CURVE_METRICS
    }
    joint = pd.concat([stats[(style, "log_joint")] for _, style, _ in parts], ignore_index=True)
    far = off_scale(joint) if "log_joint" in CURVE_METRICS else []
    panels = [(metric, far if metric == "log_joint" else []) for metric in CURVE_METRICS]
    if far:
        panels.append(("log_joint", []))
    fig, axes = plt.subplots(1, len(panels), figsize=(12.5 if len(panels) == 2 else 16, 4))
    for ax, (metric, left_out) in zip(axes, panels, strict=True):
        for _, style, what in parts:
            for method, group in stats[(style, metric)].groupby("method"):
                if method in left_out:
                    continue
                ax.plot(
                    group["K"],
                    group["mean"],
                    marker="o",
                    ls=style,
                    color=colors[method],
                    label=f"{method}: {what}",
                )
                ax.fill_between(
                    group["K"], *band(metric, group["mean"], group["sem"]), alpha=0.15, color=colors[method]
                )
        ax.set_xscale("log")
        ks = sorted(set(test_time["K"]) | set(own["K"]))
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("K sweeps (L = total // K)")
        ax.set_ylabel("log p(x, z)" if metric == "log_joint" else "ESS / L")
        if left_out:
            ax.set_title(f"without {', '.join(left_out)} (off this scale: last panel)", fontsize=8)
        elif far and metric == "log_joint":
            ax.set_title("every method", fontsize=8)
    # Beside the panels, not on them: inside, it hid the retrained curve.
    axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle(f"Fixed budget K*L = {total} (Figure 2)" if total else "Fixed budget K*L (Figure 2)")
    _save(fig, path, caption)
    return True


def sweep_curves(
    ax, stats: pd.DataFrame, colors: dict[str, Any], at_once: str, metric: str = "log_joint"
) -> None:
    """Each method's mean over sweeps with its standard error shaded; a one-step method
    (RWS, reparam: K*L particles at once) as a dashed level labelled ``method (at_once)``.
    APG is drawn in front: a sampler whose curve coincides with it (HMC-RWS on the GMM)
    would otherwise hide it."""
    for method, group in stats.groupby("method"):
        if len(group) == 1:
            ax.axhline(group["mean"].iloc[0], ls="--", color=colors[method], label=f"{method} ({at_once})")
            continue
        front = 3.0 if method == "apg" else 2.0
        ax.plot(group["sweep"], group["mean"], marker=".", color=colors[method], label=method, zorder=front)
        ax.fill_between(
            group["sweep"], *band(metric, group["mean"], group["sem"]), alpha=0.2, color=colors[method]
        )


def sweeps_figure(frame: pd.DataFrame, meta: dict[str, Any], caption: str, path: Path) -> bool:
    """Log joint and ESS/L versus sweep at the largest evaluation pair; shaded: the standard
    error of the mean over seeds x datasets (their spread, which differs between datasets
    far more than between methods, would hide the burn-in the figure is for)."""
    if not meta["pairs"]:
        return False
    k_max, l_at = max(tuple(p) for p in meta["pairs"])
    sub = frame[(frame["K"] == k_max) & (frame["L"] == l_at)]
    colors = dict(zip(sorted(set(sub["method"])), sns.color_palette("tab10"), strict=False))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, CURVE_METRICS, strict=False):
        stats = mean_std(sub[sub["metric"] == metric], ["method", "sweep"], "sem")
        sweep_curves(ax, stats, colors, f"{k_max * l_at} particles", metric)
        ax.set_xlabel("sweep k")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_ylabel("log p(x, z)" if metric == "log_joint" else "ESS / L")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Convergence over sweeps (K={k_max}, L={l_at})")
    _save(fig, path, caption)
    return True


# Per-held-out-set curves over sweeps (Figure 4 and its tracking twins): metric -> (y label, title).
SET_CURVES = {
    "mse": ("reconstruction MSE per pixel", "Reconstruction MSE versus sweeps, per held-out set (Figure 4"),
    "pos_err": (
        "position error (px)",
        "Position error against the true digits versus sweeps, per held-out set (",
    ),
    "tracked": ("frames with every digit within 3 px", "Tracked frames versus sweeps, per held-out set ("),
}


def set_curve_figure(
    frame: pd.DataFrame, meta: dict[str, Any], caption: str, path: Path, metric: str = "mse"
) -> bool:
    """A metric versus sweep, one line per held-out set (e.g. per (T, D)), one panel per
    method, at the largest evaluation pair; one-step methods (RWS) as points. For ``mse``
    this is Figure 4."""
    ylabel, title = SET_CURVES[metric]
    sub = frame[frame["metric"] == metric]
    if sub.empty or not meta["pairs"]:
        return False
    k_max, l_at = max(tuple(p) for p in meta["pairs"])
    sub = sub[(sub["K"] == k_max) & (sub["L"] == l_at)]
    if "test_set" not in sub:
        sub = sub.assign(test_set="test")
    order = [s["name"] for s in meta.get("test_sets") or []] or sorted(set(sub["test_set"]))
    methods = sorted(set(sub["method"]), key=lambda m: (-sub[sub["method"] == m]["sweep"].nunique(), m))
    fig, axes = plt.subplots(1, len(methods), figsize=(4.5 * len(methods), 3.8), squeeze=False, sharey=True)
    colors = dict(zip(order, sns.color_palette("viridis", len(order)), strict=False))
    for ax, method in zip(axes[0], methods, strict=False):
        stats = mean_std(sub[sub["method"] == method], ["test_set", "sweep"])
        for name in order:
            group = stats[stats["test_set"] == name]
            if group.empty:
                continue
            style = {"marker": "o", "ls": "none"} if len(group) == 1 else {"marker": "."}
            ax.errorbar(
                group["sweep"],
                group["mean"],
                yerr=yerr(metric, group["mean"], group["std"]),
                label=name,
                color=colors[name],
                capsize=2,
                **style,
            )
        ax.set_xlabel("sweep k" if stats["sweep"].nunique() > 1 else "one step (K*L particles)")
        ax.set_title(method, fontsize=9)
        ax.set_xticks(sorted(set(stats["sweep"])))
    axes[0, 0].set_ylabel(ylabel)
    axes[0, 0].legend(fontsize=7, title="test set", title_fontsize=7)
    fig.suptitle(f"{title}{'; ' if title.endswith('4') else ''}K={k_max}, L={l_at})")
    _save(fig, path, caption)
    return True


def methods_sweeps_figure(frame: pd.DataFrame, meta: dict[str, Any], caption: str, path: Path) -> bool:
    """Held-out log joint versus sweep for every method, one panel per evaluation pair
    (K, L); one-step methods (RWS, reparam: K*L particles at once) as dashed levels.
    Made when at least two methods run several sweeps (APG and the companion-paper
    samplers); otherwise the sweeps figure shows the same."""
    pairs = sorted(tuple(p) for p in meta["pairs"])
    sub = frame[frame["metric"] == "log_joint"]
    methods = sorted(set(sub["method"]))
    multi = sub.groupby("method")["sweep"].nunique()
    if not pairs or (multi > 1).sum() < 2:
        return False
    colors = dict(zip(methods, sns.color_palette("tab10", len(methods)), strict=False))
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.6 * len(pairs), 4), squeeze=False, sharey=True)
    for ax, (k, l) in zip(axes[0], pairs, strict=False):
        part = sub[(sub["K"] == k) & (sub["L"] == l)]
        sweep_curves(ax, mean_std(part, ["method", "sweep"], "sem"), colors, f"{k * l} at once")
        ax.set_title(f"K={k}, L={l}", fontsize=9)
        ax.set_xlabel("sweep k")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axes[0, 0].set_ylabel("log p(x, z), held-out")
    axes[0, -1].legend(fontsize=7, loc="lower right")
    fig.suptitle("Log joint versus sweeps, every method at the same test-time budget")
    _save(fig, path, caption)
    return True


def kl_figure(
    frame: pd.DataFrame, meta: dict[str, Any], caption: str, path: Path, labels: dict[str, str] | None
) -> bool:
    """Inclusive KL (eq. 4) of each method's block kernels to the exact Gibbs conditionals,
    one panel per block, versus the evaluation pair whose final particles stand in for
    p(z_-b | x); mean and std over seeds x datasets."""
    fin = finals(frame)
    fin = fin[fin["metric"].str.startswith("kl_")]
    pairs = sorted(tuple(p) for p in meta["pairs"])
    fin = fin[[(k, l) in set(pairs) for k, l in zip(fin["K"], fin["L"], strict=False)]]
    if fin.empty:
        return False
    blocks = sorted(set(fin["metric"]))
    methods = sorted(set(fin["method"]))
    colors = dict(zip(methods, sns.color_palette("tab10", len(methods)), strict=False))
    fig, axes = plt.subplots(1, len(blocks), figsize=(4.6 * len(blocks), 3.8), squeeze=False)
    position = {p: i for i, p in enumerate(pairs)}
    for ax, block in zip(axes[0], blocks, strict=False):
        stats = mean_std(fin[fin["metric"] == block], ["method", "K", "L"])
        for j, (method, group) in enumerate(stats.groupby("method")):
            x = np.array([position[(k, l)] for k, l in zip(group["K"], group["L"], strict=False)]) + 0.08 * (
                j - (len(methods) - 1) / 2
            )
            ax.errorbar(
                x,
                group["mean"],
                yerr=yerr(block, group["mean"], group["std"]),
                marker="o",
                capsize=2,
                color=colors[method],
                label=method,
            )
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(pairs)), [f"K={k}, L={l}" for k, l in pairs], fontsize=8)
        ax.set_title(f"block {_label(block, labels).removeprefix('kl ')}", fontsize=9)
        ax.set_ylabel("KL(p(z_b | x, z_-b) || q(z_b | x, z_-b))")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("Inclusive KL of the learned kernels to the exact Gibbs conditionals (eq. 4)")
    _save(fig, path, caption)
    return True


def compute_figure(frame: pd.DataFrame, meta: dict[str, Any], caption: str, path: Path) -> bool:
    """Reconstruction MSE versus compute (``model_evals``: likelihood evaluations per
    dataset, ``Method.model_evaluations``), one panel per held-out set: multi-sweep
    methods as a line over their sweeps at each evaluation pair, one-step methods as points."""
    sub = frame[frame["metric"].isin(["mse", "model_evals"])]
    if sub.empty or set(sub["metric"]) != {"mse", "model_evals"}:
        return False
    if "test_set" not in sub:
        sub = sub.assign(test_set="test")
    keys = ["test_set", "method", "K", "L", "seed", "dataset", "sweep"]
    wide = sub.pivot_table(index=keys, columns="metric", values="value").dropna().reset_index()
    if wide.empty:
        return False
    order = [s["name"] for s in meta.get("test_sets") or []] or sorted(set(wide["test_set"]))
    order = [name for name in order if name in set(wide["test_set"])]
    methods = sorted(set(wide["method"]))
    colors = dict(zip(methods, sns.color_palette("tab10", len(methods)), strict=False))
    cols = min(3, len(order))
    rows = -(-len(order) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False, sharex=True)
    for ax, name in zip(axes.flat, order, strict=False):
        part = wide[wide["test_set"] == name]
        stats = (
            part.groupby(["method", "K", "L", "sweep"])
            .agg(evals=("model_evals", "mean"), mse=("mse", "mean"), std=("mse", "std"))
            .fillna(0.0)
            .reset_index()
        )
        seen = set()
        for (method, _, _), group in stats.groupby(["method", "K", "L"]):
            label = None if method in seen else method
            seen.add(method)
            style = {"marker": "o", "ls": "none"} if len(group) == 1 else {"marker": ".", "ls": "-"}
            ax.errorbar(
                group["evals"],
                group["mse"],
                yerr=yerr("mse", group["mse"], group["std"]),
                color=colors[method],
                capsize=2,
                label=label,
                **style,
            )
        ax.set_xscale("log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(
            "likelihood evaluations per dataset (all of it, one particle; gradient = 2)", fontsize=8
        )
        ax.set_ylabel("reconstruction MSE per pixel")
    for ax in list(axes.flat)[len(order) :]:
        ax.axis("off")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("Reconstruction MSE versus compute")
    _save(fig, path, caption)
    return True


def smoothed(values: pd.Series, points: int = 50) -> pd.Series:
    """Trailing rolling mean over ~1/``points`` of the curve (at least 1 point): the logged
    values are single training batches, too noisy to read as they are."""
    return values.rolling(max(1, len(values) // points), min_periods=1).mean()


def training_figure(training: pd.DataFrame, table: pd.DataFrame, caption: str, path: Path) -> bool:
    """Training log joint (rolling mean) versus iteration, one panel per method, one colour
    per training (K, L), one thin line per seed; the last fifth of training (where
    ``plateau`` fits its trend) is shaded."""
    lj = training[training["metric"] == "log_joint"] if not training.empty else training
    if lj.empty:
        return False
    methods = sorted(set(lj["method"]))
    cols = min(3, len(methods))
    rows = -(-len(methods) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.8 * cols, 3.4 * rows), squeeze=False)
    verdict_of = dict(zip(table["cell_id"], table["plateaued"], strict=False)) if len(table) else {}
    for ax, method in zip(axes.flat, methods, strict=False):
        part = lj[lj["method"] == method]
        budgets = sorted({(k, l) for k, l in zip(part["K"], part["L"], strict=False)})
        colors = dict(zip(budgets, sns.color_palette("viridis", len(budgets)), strict=False))
        late = []  # smoothed values after the first tenth: the y range (early RWS values are far off)
        windows = set()  # shaded once each: overlapping spans would darken with every seed
        for (cell_id, k, l), curve in part.groupby(["cell_id", "K", "L"]):
            curve = curve.sort_values("iteration")
            smooth = smoothed(curve["value"])
            flag = {"no": f" {NOT_PLATEAUED}", "not assessable": f" {NOT_ASSESSABLE}"}.get(
                verdict_of.get(cell_id), ""
            )
            ax.plot(curve["iteration"], smooth, lw=0.8, color=colors[(k, l)], label=f"K{k} L{l}")
            if flag:  # the cell's mark at its last point, so a not-plateaued curve is visible
                ax.annotate(flag.strip(), (curve["iteration"].iloc[-1], smooth.iloc[-1]), fontsize=8)
            last = curve["iteration"].max()
            windows.add(((1 - PLATEAU_FRACTION) * last, last))
            late.append(smooth[curve["iteration"] > 0.1 * last])
        for lo_it, hi_it in windows:
            ax.axvspan(lo_it, hi_it, color="grey", alpha=0.12, lw=0)
        values = pd.concat(late)
        values = values[np.isfinite(values)]
        if len(values):
            # The middle 99%: one seed's brief spike (an RWS encoder's) would
            # otherwise flatten every other curve of the panel.
            lo, hi = (float(q) for q in np.quantile(values, [0.005, 0.995]))
            pad = 0.1 * (hi - lo) or 1.0
            ax.set_ylim(lo - pad, hi + pad)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=False))  # one entry per (K, L), not per seed
        ax.legend(unique.values(), unique.keys(), fontsize=7, title="trained at", title_fontsize=7)
        ax.set_title(method, fontsize=9)
        ax.set_xlabel("iteration")
        ax.set_ylabel("log p(x, z), training batch (rolling mean)", fontsize=8)
    for ax in list(axes.flat)[len(methods) :]:
        ax.axis("off")
    fig.suptitle(
        "Training log joint per cell (one thin line per seed; shaded: last fifth, the plateau test window)"
    )
    _save(fig, path, caption)
    return True


SIZE_NAMES = {"num_points": "N", "num_frames": "T", "num_digits": "D", "radius": "radius"}


def figure_set_title(meta: dict[str, Any], name: str) -> str:
    """``figure set 2 (N=150)`` for ``figure_1``: the set's number and its simulator sizes."""
    sets = [s for s in meta.get("figure_sets") or [] if s["name"] == name]
    number = int(name.rsplit("_", 1)[-1]) + 1 if name.rsplit("_", 1)[-1].isdigit() else name
    sizes = sets[0].get("sizes", {}) if sets else {}
    shown = ", ".join(f"{SIZE_NAMES[k]}={v}" for k, v in sizes.items() if k in SIZE_NAMES)
    return f"figure set {number}" + (f" ({shown})" if shown else "")


def samples_figure(
    task: str, samples: dict[str, np.ndarray], meta: dict[str, Any], caption: str, path: Path
) -> bool:
    """Figure 1 style: each method's best particle after several sweeps, per figure set."""
    spec = get_task(task)
    if spec.draw is None or not meta["samples"]:
        return False
    seed = min(meta["seeds"])
    entries = [e for e in meta["samples"] if e["seed"] == seed]
    columns = sorted({(e["figure_set"], s) for e in entries for s in e["sweeps"]})
    methods = sorted({e["method"] for e in entries})
    panels = {}  # (row, column) -> (title, x, z), only where the method has that sample
    for i, method in enumerate(methods):
        entry = {e["figure_set"]: e for e in entries if e["method"] == method}
        for j, (fset, sweep) in enumerate(columns):
            e = entry.get(fset)
            prefix = f"{e['cell_id']}__{fset}__sweep{sweep}__" if e else None
            z = {k[len(prefix) :]: v[0] for k, v in samples.items() if prefix and k.startswith(prefix)}
            if z:
                x = samples[f"x__{fset}"]
                if f"truth__{fset}__z_where" in samples:  # the simulator's paths (tracking)
                    z["true_where"] = samples[f"truth__{fset}__z_where"][0]
                panels[i, j] = (f"{method}, sweep {sweep}\n{figure_set_title(meta, fset)}", x[0], z)
    if not panels:
        return False
    aspect = _draw_aspect(spec, next(iter(panels.values())))
    if aspect > 2.0:  # wide pictures (a strip of video frames): one picture per row, no empty rows
        width = min(2.0 * aspect, 16.0)
        fig, grid = plt.subplots(
            len(panels), 1, figsize=(width, (width / aspect + 0.45) * len(panels) + 0.9), squeeze=False
        )
        axes = dict(zip(sorted(panels), grid[:, 0], strict=True))
    else:
        fig, grid = plt.subplots(
            len(methods), len(columns), figsize=(3 * len(columns), 3 * len(methods)), squeeze=False
        )
        axes = {(i, j): grid[i, j] for i in range(len(methods)) for j in range(len(columns))}
    for key, ax in axes.items():
        if key not in panels:
            ax.axis("off")
            continue
        title, x, z = panels[key]
        spec.draw(ax, x, z)
        ax.set_title(title, fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle("Samples: highest-weight particle after k sweeps (Figures 1 and 3 style)")
    _save(fig, path, caption)
    return True


def _draw_aspect(spec, panel: tuple[str, np.ndarray, dict[str, np.ndarray]]) -> float:
    """Width / height of what ``spec.draw`` makes of one sample (drawn on a scratch axes)."""
    _, x, z = panel
    fig, ax = plt.subplots()
    try:
        spec.draw(ax, x, z)
        (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        return abs(x1 - x0) / max(abs(y1 - y0), 1e-12)
    finally:
        plt.close(fig)


def animation(frames: np.ndarray | None, path: Path) -> bool:
    """The GIF of the evaluation's animation frames (``animation.npz`` beside its rows: the
    pictured cell's generative model drawing the last APG sweep's sample; tasks with an
    ``animate`` hook). False when the evaluation drew none."""
    if frames is None:
        return False
    write_picture(path, lambda tmp: write_gif(tmp, list(frames), 200))
    return True


def plain_numbers(ax) -> None:
    """Log axes labelled 500, 1000, 20k, 2M and 6 rather than 10^3, 2 x 10^4 and 6 x 10^0."""
    ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(
        matplotlib.ticker.FuncFormatter(
            lambda x, _: f"{x / 1e6:g}M" if x >= 1e6 else f"{x / 1000:g}k" if x >= 10_000 else f"{x:g}"
        )
    )
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    # 1, 2, 3 and 5 per decade: every minor tick labelled crowds an axis within one decade
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def _save(fig, path: Path, caption: str) -> None:
    fig.text(0.5, 0.005, caption, ha="center", va="bottom", fontsize=7, wrap=True)
    # A third of an inch at the top for the suptitle and ~0.4 at the bottom for the caption,
    # whatever the figure's height (a fixed fraction overlapped the first row's titles).
    height = fig.get_figheight()
    fig.tight_layout(rect=(0, min(0.4 / height, 0.1), 1, 1 - (0.3 / height if fig._suptitle else 0)))
    save_figure(fig, path)
    plt.close(fig)


# A rebuild of an unchanged report adds nothing to git. Figures are written without the
# writer's version or a date (``FIXED_METADATA``), and a figure whose picture is the one
# the file already there shows (``same_picture``) leaves that file's bytes as they were.
# The tolerance of one colour level takes in what the report cannot make exact on every
# CPU: the GIF's frames drawn by torch, and anti-aliased pixels of lines whose floats
# another CPU's vector unit rounds otherwise in the last bit (``exact`` fixes the report's
# own fits; matplotlib's transforms are its own).
SAME_PICTURE_LEVELS = 1


# ``savefig``'s metadata per format: None leaves out an entry that would name the
# matplotlib version or the time of writing.
FIXED_METADATA: dict[str, dict[str, Any]] = {
    "png": {"Software": None},
    "pdf": {"Creator": None, "Producer": None, "CreationDate": None},
    "svg": {"Creator": None, "Date": None},
}


def save_figure(fig, path: Path, dpi: int = 110) -> bool:
    """``fig`` to ``path`` in the format its suffix names, with ``write_picture``."""
    fmt = path.suffix.lstrip(".")

    def draw(tmp: Path) -> None:
        # SVG element ids are random unless salted.
        with matplotlib.rc_context({"svg.hashsalt": "apg-report"}):
            fig.savefig(tmp, format=fmt, dpi=dpi, metadata=FIXED_METADATA.get(fmt))

    return write_picture(path, draw)


def write_picture(path: Path, write: Callable[[Path], object]) -> bool:
    """Call ``write(tmp)`` for a figure or an animation and move it to ``path`` atomically,
    unless the file at ``path`` shows the same picture (``same_picture``): then that file
    stays as it was. Whether it wrote."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    new = Path(name)
    try:
        write(new)
        if path.is_file() and same_picture(path, new):
            return False
        atomic_write(path, lambda tmp: os.replace(new, tmp))
        return True
    finally:
        new.unlink(missing_ok=True)


def same_picture(a: Path, b: Path, levels: int = SAME_PICTURE_LEVELS) -> bool:
    """Whether two image files show the same picture: the same bytes, or images of one
    format and size, with the same frames, timing and loop, whose every pixel's RGBA values
    differ by at most ``levels`` (files PIL cannot read: the same bytes only)."""
    if a.read_bytes() == b.read_bytes():
        return True
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(a) as x, Image.open(b) as y:
            frames = getattr(x, "n_frames", 1)
            if (x.format, x.size, frames, x.info.get("loop")) != (
                y.format,
                y.size,
                getattr(y, "n_frames", 1),
                y.info.get("loop"),
            ):
                return False
            for frame in range(frames):
                x.seek(frame)
                y.seek(frame)
                if x.info.get("duration") != y.info.get("duration"):
                    return False
                pixels = [np.asarray(im.convert("RGBA"), dtype=np.int16) for im in (x, y)]
                if np.abs(pixels[0] - pixels[1]).max(initial=0) > levels:
                    return False
    except (UnidentifiedImageError, OSError):
        return False
    return True
