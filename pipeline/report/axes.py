"""Figures and tables for a grid entry's swept axes (one point per setting)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np
import pandas as pd

from pipeline.present import number
from pipeline.report.data import finals
from pipeline.report.figures import _save
from pipeline.report.tables import _label, write_table
from pipeline.statistics import seed_interval

AXIS_METRICS = ("log_joint", "ess", "ari", "pos_err", "mse")

AXIS_LABELS = {"pos_err": "position error (px)", "mse": "MSE per pixel"}


def axis_estimates(frame: pd.DataFrame, meta: dict[str, Any], key: str) -> pd.DataFrame:
    """One row per (method, training pair, value of ``key``, metric): the mean over seeds and
    its 95% interval of the final-sweep metric at the cells' own training pair, each seed
    first averaged over the held-out datasets. Only (method, pair) groups whose cells take
    two or more values of ``key`` (a line, not a point); the task's own cells count at their
    value, so a swept axis is drawn through the default."""
    cells = {c["cell_id"]: c for c in meta["cells"]}
    fin = finals(frame)
    fin = fin[(fin["K"] == fin["train_K"]) & (fin["L"] == fin["train_L"]) & fin["metric"].isin(AXIS_METRICS)]
    rows = []
    for (cid, metric), part in fin.groupby(["cell_id", "metric"]):
        value = cells.get(cid, {}).get("settings", {}).get(key)
        if value is not None:
            cell = cells[cid]
            rows.append(
                (
                    cell["base_method"],
                    cell["K"],
                    cell["L"],
                    value,
                    metric,
                    cell["seed"],
                    cid,
                    float(part["value"].mean()),
                )
            )
    per_seed = pd.DataFrame(rows, columns=["method", "K", "L", "value", "metric", "seed", "cell_id", "mean"])
    out = []
    for (method, k, l), group in per_seed.groupby(["method", "K", "L"]):
        if group["value"].nunique() < 2:
            continue
        for (value, metric), part in group.groupby(["value", "metric"]):
            est = seed_interval(part["mean"].to_numpy(), tuple(sorted(part["cell_id"])))
            out.append((method, k, l, value, metric, est.mean, est.lo, est.hi, est.n, " ".join(est.cells)))
    columns = ["method", "K", "L", "value", "metric", "mean", "lo", "hi", "seeds", "cells"]
    return pd.DataFrame(out, columns=columns)


def axis_figure(est: pd.DataFrame, key: str, caption: str, path: Path) -> None:
    metrics = [m for m in AXIS_METRICS if m in set(est["metric"])]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.4 * len(metrics), 3.6), squeeze=False)
    values = sorted(set(est["value"]), key=lambda v: (not isinstance(v, (int, float)), v))
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    position = {v: (v if numeric else i) for i, v in enumerate(values)}
    for ax, metric in zip(axes[0], metrics, strict=True):
        for (method, k, l), part in est[est["metric"] == metric].groupby(["method", "K", "L"]):
            part = part.assign(x=part["value"].map(position)).sort_values("x")
            err = np.vstack([part["mean"] - part["lo"], part["hi"] - part["mean"]])
            ax.errorbar(
                part["x"],
                part["mean"],
                yerr=None if np.isnan(err).all() else err,
                marker="o",
                capsize=3,
                label=f"{method} K={k} L={l}",
            )
        if numeric and min(values) > 0 and max(values) / min(values) >= 8:
            ax.set_xscale("log")
        ax.set_xticks([position[v] for v in values], [str(v) for v in values])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel(key)
        ax.set_ylabel(f"{AXIS_LABELS.get(metric, _label(metric, None))}, held-out")
    axes[0, 0].legend(fontsize=7)
    _save(fig, path, caption)


def axes_markdown(
    frame: pd.DataFrame, meta: dict[str, Any], caption: str, out: Path, task: str, fmt: str
) -> str:
    """Per swept key: a figure of each metric against the key's values and a table (with
    the cells each point averages); '' when no key has two values for one method."""
    parts = []
    for key in meta.get("axes", []):
        est = axis_estimates(frame, meta, key)
        if est.empty:
            continue
        stem = f"{task}_axis_{key.replace('.', '_')}"
        axis_figure(est, key, caption, out / "figures" / f"{stem}.{fmt}")
        write_table(out / "tables" / stem, est)
        metrics = [m for m in AXIS_METRICS if m in set(est["metric"])]
        wide = est.pivot_table(
            index=["method", "K", "L", "value"], columns="metric", values="mean", aggfunc="first"
        )
        seeds = est.groupby(["method", "K", "L", "value"])["seeds"].max()
        lines = [
            f"#### `{key}` ([csv](tables/{stem}.csv))",
            "",
            f"![{task} {key}](figures/{stem}.{fmt})",
            "",
            f"| method | K | L | {key} | "
            + " | ".join(AXIS_LABELS.get(m, _label(m, None)) for m in metrics)
            + " | seeds |",
            "| --- | --- | --- | --- | " + " | ".join("---" for _ in metrics) + " | --- |",
        ]
        for (method, k, l, value), row in wide.iterrows():
            numbers = " | ".join(number(row.get(m)) for m in metrics)
            lines.append(f"| {method} | {k} | {l} | {value} | {numbers} | {seeds[(method, k, l, value)]} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)
