"""The report's imputation part for one task (issue 22): the table, the figure and, for
videos, the GIF of what ``pipeline.evaluate.impute`` recorded in
``results/eval/<task>/imputation.parquet`` and ``imputation_examples.npz``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from pipeline.present import markdown_table, pm, write_gif
from pipeline.report.figures import _save
from pipeline.report.tables import write_table

# metric -> column header, in the order the tables show them
REPORT_METRICS = {
    "rmse": "RMSE, mean of the draws",
    "rmse_draw": "RMSE, last draw",
    "rmse_oracle": "RMSE, true-parameter predictor",
    "mse": "MSE on hidden pixels",
    "pos_err": "position error, occluded frames (px)",
    "tracked": "tracked occluded frames",
}
FIGURE_TEXT = {
    "imputation": (
        "Imputation of hidden entries by the chain of inference and generation (Rezende et al. "
        "2014, Appendix F): each method's cells infer the latents of the filled-in data, then the "
        "hidden entries are redrawn from p(x | z) (params `fill: sample`) or set to its mean "
        "(`fill: mean`). Error bars: std over seeds x datasets."
    ),
    "imputation_gif": (
        "An occluded held-out video (hidden pixels grey) | its imputation by the first cell of "
        "APG (else of the first method listed), the chain's last state | the true video, for the "
        "occlusion that blanks the most frames."
    ),
}


def final_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Each metric at the chain's last iteration."""
    return frame[frame["iteration"] == frame.groupby("metric")["iteration"].transform("max")]


def imputation_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean and std over seeds x datasets of every metric at the last iteration, per
    (setting, method, K, L), with the number of seeds."""
    last = final_rows(frame)
    keys = ["setting", "method", "K", "L", "train_K", "train_L"]
    stats = last.groupby([*keys, "metric"], sort=False)["value"].agg(["mean", "std"]).unstack("metric")
    stats.columns = [f"{stat}_{metric}" for stat, metric in stats.columns]
    seeds = last.groupby(keys, sort=False)["seed"].nunique().rename("seeds")
    return stats.join(seeds).reset_index()


def imputation_markdown(table: pd.DataFrame) -> str:
    metrics = [m for m in REPORT_METRICS if f"mean_{m}" in table]
    header = ["hidden", "method", "trained at", "K", "L", "seeds", *(REPORT_METRICS[m] for m in metrics)]
    rows = [
        [f"{r['setting']}", f"{r['method']}", f"K{r['train_K']} L{r['train_L']}", f"{r['K']}", f"{r['L']}"]
        + [f"{r['seeds']}", *(pm(r[f"mean_{m}"], r[f"std_{m}"]) for m in metrics)]
        for _, r in table.iterrows()
    ]
    return markdown_table(header, rows)


def imputation_figure(frame: pd.DataFrame, path: Path, caption: str) -> bool:
    """GMM: error versus chain iteration per method; Bouncing MNIST: the errors per
    occlusion, per method."""
    if frame.empty:
        return False
    methods = sorted(set(frame["method"]))

    def bars(ax, rows: pd.DataFrame, metric: str, by: str, marker: str, order: list | None = None) -> None:
        """Each method's mean ± std of ``metric`` per value of ``by`` (``order``: at 0, 1, ...)."""
        for i, method in enumerate(methods):
            sub = rows[(rows["method"] == method) & (rows["metric"] == metric)]
            stats = sub.groupby(by)["value"].agg(["mean", "std"])
            x = stats.index if order is None else range(len(order))
            stats = stats if order is None else stats.reindex(order)
            ax.errorbar(
                x, stats["mean"], yerr=stats["std"], label=method, color=f"C{i}", capsize=2, marker=marker
            )

    if "rmse" in set(frame["metric"]):
        fig, ax = plt.subplots(figsize=(6, 4))
        bars(ax, frame, "rmse", "iteration", ".")
        oracle = frame[frame["metric"] == "rmse_oracle"]["value"]
        if len(oracle):
            ax.axhline(oracle.mean(), ls="--", color="k", lw=1, label="true-parameter predictor")
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        ax.set_xlabel("chain iteration")
        ax.set_ylabel("RMSE of the hidden coordinates")
        ax.set_title(str(frame["setting"].iloc[0]), fontsize=9)
        ax.legend(fontsize=7)
    else:
        last = final_rows(frame)
        metrics = [m for m in ("mse", "pos_err") if m in set(last["metric"])]
        order = list(dict.fromkeys(last["setting"]))
        fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.8), squeeze=False)
        for ax, metric in zip(axes[0], metrics, strict=False):
            bars(ax, last, metric, "setting", "o", order)
            ax.set_xticks(range(len(order)), order, rotation=20, fontsize=7)
            ax.set_ylabel(REPORT_METRICS[metric])
        axes[0, 0].legend(fontsize=7)
    _save(fig, path, caption)
    return True


def imputation_gif(examples: dict[str, np.ndarray], frame: pd.DataFrame, path: Path) -> bool:
    """Bouncing MNIST: APG's (else the first method's) imputation of the setting that hides
    the most frames, as a GIF of observed | imputed | true frames."""
    settings = list(dict.fromkeys(frame["setting"]))
    methods = sorted({k.split("__")[0] for k in examples})
    method = "apg" if "apg" in methods else methods[0] if methods else None
    if method is None or examples[f"{method}__0__truth"].ndim != 3:
        return False
    counts = [
        int(examples[f"{method}__{j}__mask"].reshape(len(examples[f"{method}__{j}__mask"]), -1).all(1).sum())
        for j in range(len(settings))
    ]
    j = int(np.argmax(counts))
    truth, mask, imputed = (examples[f"{method}__{j}__{n}"] for n in ("truth", "mask", "imputed"))
    observed = np.where(mask, 0.5, truth)
    gap = np.ones((truth.shape[0], truth.shape[1], 4))
    panels = np.concatenate([observed, gap, imputed, gap, truth], axis=2)
    pixels = (np.clip(panels, 0, 1) * 255).astype(np.uint8)
    write_gif(path, [f.repeat(2, axis=0).repeat(2, axis=1) for f in pixels], 300)  # twice the size
    return True


def report_imputation(
    task: str, loaded: tuple[pd.DataFrame, dict[str, np.ndarray]] | None, out: Path, fmt: str, caption: str
) -> dict[str, Any] | None:
    """The report's imputation part for one task (``loaded``: what ``data.load_results`` read): a
    table (``tables/<task>_imputation.{csv,md}``), a figure and, for videos, a GIF;
    ``None`` when the evaluation made no imputations."""
    if loaded is None:
        return None
    frame, examples = loaded
    table = imputation_table(frame)
    md = imputation_markdown(table)
    write_table(out / "tables" / f"{task}_imputation", table, md)
    figures = {}
    if imputation_figure(frame, out / "figures" / f"{task}_imputation.{fmt}", caption):
        figures["imputation"] = f"figures/{task}_imputation.{fmt}"
    if imputation_gif(examples, frame, out / "figures" / f"{task}_imputation.gif"):
        figures["imputation_gif"] = f"figures/{task}_imputation.gif"
    headline: dict[str, dict[str, float]] = {}
    for _, r in table.iterrows():
        setting = "".join(ch if ch.isalnum() else "_" for ch in str(r["setting"]))
        headline.setdefault(f"{r['method']}/K{r['K']}/L{r['L']}", {}).update(
            {
                f"impute_{m}_{setting}": float(r[f"mean_{m}"])
                for m in REPORT_METRICS
                if f"mean_{m}" in r and np.isfinite(r[f"mean_{m}"])
            }
        )
    return {"md": md, "figures": figures, "headline": headline}
