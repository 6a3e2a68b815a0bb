"""Stage ``report``: tables and figures from recorded results only (never retrains).

``python -m pipeline.report`` reads ``results/eval/<task>/`` for every task in
``tasks`` and writes into ``reports/``:

- ``README.md``: the index, with every table and figure and the scale it was made at;
- ``tables/<task>_table1.{md,csv}``: Table 1 (our numbers, the paper's beside them);
- ``tables/<task>_methods.{md,csv}``: every method at the same sample budgets K*L: held-out
  log joint, ESS/L, both log-evidence estimates and HMC's acceptance rate, mean and std
  over seeds, with the cell ids and MLflow run ids each number comes from;
- ``figures/<task>_budget.png``: Figure 2, log joint and ESS/L versus K at K*L fixed;
- ``figures/<task>_sweeps.png``: convergence versus sweeps; ``<task>_training.png``;
- ``figures/<task>_methods_sweeps.png``: every method's held-out log joint versus sweeps
  (when several methods run sweeps: APG and the companion-paper samplers on the GMM);
- ``figures/<task>_kl.png``: inclusive KL of the block kernels to the exact Gibbs
  conditionals, per block (tasks with exact conditionals);
- ``figures/<task>_compute.png``: reconstruction MSE versus compute (likelihood
  evaluations per dataset, ``Method.model_evaluations``), per held-out set;
- ``figures/<task>_samples.png``: Figure-1-style pictures (the task's ``draw`` hook),
  and ``<task>_samples.gif`` when the task has an ``animate`` hook;
- ``metrics.json``: headline numbers for ``dvc metrics show`` / ``dvc exp show``.

Every number is a mean over seeds and held-out datasets; ``std`` columns and shaded
bands are the standard deviation over the same (seed, dataset) pairs (the methods-sweeps
figure shades the standard error instead, and says so).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")  # files only; no display on servers and CI

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
import yaml  # noqa: E402

from apg.data import atomic_write  # noqa: E402
from apg.tasks import get_task  # noqa: E402
from pipeline import provenance  # noqa: E402
from pipeline.common import project_root  # noqa: E402
from pipeline.config import load_params  # noqa: E402

PAPER_NUMBERS = Path(__file__).with_name("paper_numbers.yaml")
CURVE_METRICS = ("log_joint", "ess")


# --------------------------------------------------------------------------- data


def load_results(eval_dir: Path) -> dict[str, Any]:
    for name in ("meta.json", "metrics.parquet", "training.parquet", "samples.npz"):
        if not (eval_dir / name).is_file():
            raise ValueError(f"{eval_dir / name} not found; run the evaluate stage first")
    with np.load(eval_dir / "samples.npz") as archive:
        samples = {k: archive[k] for k in archive.files}
    return {
        "meta": json.loads((eval_dir / "meta.json").read_text()),
        "metrics": pd.read_parquet(eval_dir / "metrics.parquet"),
        "training": pd.read_parquet(eval_dir / "training.parquet"),
        "samples": samples,
    }


def finals(frame: pd.DataFrame) -> pd.DataFrame:
    """Each (cell, K, L, metric, dataset)'s value at the run's last sweep."""
    last = frame.groupby(["cell_id", "K", "L", "metric"])["sweep"].transform("max")
    return frame[frame["sweep"] == last]


def scale_caption(meta: dict[str, Any], label: str) -> str:
    iters = "/".join(str(i) for i in meta["iterations"])
    sets = meta.get("test_sets") or []
    if len(sets) > 1:
        held_out = "held-out sets " + ", ".join(f"{s['name']} ({s['num_datasets']})" for s in sets)
    else:
        held_out = f"{meta['test_datasets']} held-out datasets"
    return (
        f"{label}: {iters} training iterations on {meta['train_datasets']} simulated datasets "
        f"(batch {meta['batch_size']}), {held_out}, seeds {meta['seeds']}"
    )


def primary_test_set(frame: pd.DataFrame, meta: dict[str, Any]) -> pd.DataFrame:
    """Rows of the first held-out set (Table 1, method table, sweep and budget figures);
    results written before several test sets existed have one set and no column."""
    sets = meta.get("test_sets") or []
    if "test_set" not in frame or not sets:
        return frame
    return frame[frame["test_set"] == sets[0]["name"]]


# --------------------------------------------------------------------------- Table 1


def table1(frame: pd.DataFrame, meta: dict[str, Any], paper: dict[str, Any] | None) -> pd.DataFrame:
    """One row per (method, K, L) of the evaluation pairs: mean and std of final metrics.

    ``d_log_joint`` is the paired difference (same held-out dataset) to the baseline
    method at the same test-time budget, like the paper's left column.
    """
    pairs = {tuple(p) for p in meta["pairs"]}
    fin = finals(frame)
    fin = fin[[(k, l) in pairs for k, l in zip(fin["K"], fin["L"], strict=False)]]
    fin = average_indexed_blocks(fin[~fin["metric"].isin(NOT_IN_TABLE1)])
    baseline = meta.get("baseline")
    lj = fin[fin["metric"] == "log_joint"]
    base = lj[lj["method"] == baseline].groupby(["K", "L", "dataset"])["value"].mean().rename("base")
    diff = lj.join(base, on=["K", "L", "dataset"])
    diff = diff.assign(metric="d_log_joint", value=diff["value"] - diff["base"]).drop(columns="base")
    full = pd.concat([fin, diff.dropna(subset=["value"])], ignore_index=True)
    stats = full.groupby(["method", "K", "L", "metric"])["value"].agg(["mean", "std"]).reset_index()
    wide = stats.pivot_table(index=["method", "K", "L"], columns="metric", values=["mean", "std"])
    order = metric_order(sorted(set(full["metric"])))
    table = pd.DataFrame(index=wide.index)
    for metric in order:
        table[metric] = wide[("mean", metric)]
        table[f"{metric}_std"] = wide[("std", metric)]
        paper_col = paper_column(paper, table.index, metric)
        if paper_col is not None:
            table[f"paper_{metric}"] = paper_col
    table = table.reset_index()
    rank = {m: i for i, m in enumerate([baseline, *sorted(set(table["method"]) - {baseline})])}
    return table.sort_values(
        ["method", "K", "L"], key=lambda s: s.map(rank) if s.name == "method" else s
    ).reset_index(drop=True)


# In the methods table (accept) and the compute figure (model_evals) instead.
NOT_IN_TABLE1 = ("model_evals", "accept")
INDEXED_BLOCK = r"^(ess|kl)_(.+)_(\d+)$"


def average_indexed_blocks(fin: pd.DataFrame) -> pd.DataFrame:
    """Per-block metrics of numbered blocks (``ess_where_1 .. ess_where_T``: one block per
    video frame) averaged over the index into one metric ``ess_where_t`` per (cell, K, L,
    dataset), so Table 1 keeps one column per kind of block whatever T is."""
    parts = fin["metric"].str.extract(INDEXED_BLOCK)
    indexed = parts[0].notna()
    if not indexed.any():
        return fin
    sub = fin[indexed].assign(metric=parts[0][indexed] + "_" + parts[1][indexed] + "_t")
    keys = [c for c in fin.columns if c not in ("value", "sweep")]
    averaged = (
        sub.groupby(keys, dropna=False)[["value", "sweep"]]
        .agg({"value": "mean", "sweep": "max"})
        .reset_index()
    )
    return pd.concat([fin[~indexed], averaged[fin.columns]], ignore_index=True)


def metric_order(metrics: list[str]) -> list[str]:
    head = [m for m in ("d_log_joint", "log_joint", "ess") if m in metrics]
    ess = [m for m in metrics if m.startswith("ess_")]
    kl = [m for m in metrics if m.startswith("kl_")]
    rest = [m for m in metrics if m not in head + ess + kl]
    return head + ess + kl + rest


def paper_column(paper: dict[str, Any] | None, index: pd.MultiIndex, metric: str) -> list[float] | None:
    """The paper's value for each of our rows, matched by method and (if given) K."""
    if not paper or not any(metric in row for row in paper["rows"]):
        return None
    values = []
    for method, k, _ in index:
        match = [r for r in paper["rows"] if r["method"] == method and r.get("K", k) == k]
        values.append(match[0].get(metric, np.nan) if match else np.nan)
    return values


def table_markdown(table: pd.DataFrame, labels: dict[str, str] | None = None) -> str:
    """Compact Markdown: ``mean ± std`` per metric, the paper's value in the next column.

    ``labels`` renames block suffixes for readers (``globals`` -> ``{tau,mu}``)."""
    metrics = [
        c
        for c in table.columns
        if c not in ("method", "K", "L") and not c.endswith("_std") and not c.startswith("paper_")
    ]
    header, cells = ["method", "K", "L"], []
    for m in metrics:
        header.append(_label(m, labels))
        if f"paper_{m}" in table:
            header.append("paper")
    for row in table.to_dict("records"):
        line = [row["method"], str(row["K"]), str(row["L"])]
        for m in metrics:
            line.append(_pm(row[m], row.get(f"{m}_std")))
            if f"paper_{m}" in table:
                line.append(_num(row[f"paper_{m}"]))
        cells.append(line)
    rows = ["| " + " | ".join(r) + " |" for r in [header, ["---"] * len(header), *cells]]
    return "\n".join(rows)


def _label(metric: str, labels: dict[str, str] | None) -> str:
    if metric.startswith(("ess_", "kl_")) and metric.endswith("_t"):
        kind, block = metric[: metric.index("_")], metric[metric.index("_") + 1 :]
        return f"{kind} {block} (mean over t)"
    for prefix in ("ess_", "kl_"):
        if metric.startswith(prefix) and labels and metric[len(prefix) :] in labels:
            return f"{prefix.rstrip('_')} {labels[metric[len(prefix) :]]}"
    return {"d_log_joint": "Δ log p(x,z)", "log_joint": "log p(x,z)", "ess": "ESS/L"}.get(metric, metric)


def _num(v: Any) -> str:
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return ""
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def _pm(mean: Any, std: Any) -> str:
    text = _num(mean)
    return f"{text} ± {_num(std)}" if text and _num(std) else text


# --------------------------------------------------------------------------- method comparison

COMPARISON_METRICS = ("log_joint", "ess", "log_evidence", "log_evidence_is", "accept")


def comparison_table(frame: pd.DataFrame, meta: dict[str, Any]) -> pd.DataFrame:
    """One row per (budget K*L, method, K, L) of the evaluation pairs.

    Each cell (one trained seed) is first averaged over the held-out datasets; the table
    gives the mean and std of those per-seed numbers over seeds, so ``std`` is the spread
    between training runs. ``cells`` / ``runs`` list the cell ids and MLflow run ids the
    row averages.
    """
    pairs = {tuple(p) for p in meta["pairs"]}
    fin = finals(frame)
    fin = fin[[(k, l) in pairs for k, l in zip(fin["K"], fin["L"], strict=False)]]
    fin = fin[fin["metric"].isin(COMPARISON_METRICS)]
    per_seed = fin.groupby(["method", "K", "L", "seed", "cell_id", "metric"])["value"].mean().reset_index()
    stats = per_seed.groupby(["method", "K", "L", "metric"])["value"].agg(["mean", "std"]).reset_index()
    wide = stats.pivot_table(
        index=["method", "K", "L"], columns="metric", values=["mean", "std"], dropna=False
    )
    table = pd.DataFrame(index=wide.index)
    for metric in COMPARISON_METRICS:
        if ("mean", metric) in wide:
            table[metric] = wide[("mean", metric)]
            table[f"{metric}_std"] = wide[("std", metric)]
    run_of = {c["cell_id"]: c.get("mlflow_run_id") or "" for c in meta["cells"]}
    cells = per_seed.groupby(["method", "K", "L"])["cell_id"].agg(lambda ids: sorted(set(ids)))
    table["seeds"] = per_seed.groupby(["method", "K", "L"])["seed"].nunique()
    table["cells"] = [" ".join(ids) for ids in cells.reindex(table.index)]
    table["runs"] = [" ".join(run_of.get(i, "") for i in ids) for ids in cells.reindex(table.index)]
    table = table.reset_index()
    table.insert(0, "budget", table["K"] * table["L"])
    return table.sort_values(["budget", "method", "K"]).reset_index(drop=True)


def comparison_markdown(table: pd.DataFrame) -> str:
    labels = {
        "log_joint": "log p(x,z)",
        "ess": "ESS/L",
        "log_evidence": "log p(x) SMC",
        "log_evidence_is": "log p(x) IS",
        "accept": "HMC accept",
    }
    metrics = [m for m in COMPARISON_METRICS if m in table]
    header = ["K×L", "method", "K", "L", *(labels[m] for m in metrics), "seeds", "cells (MLflow runs)"]
    rows = [header, ["---"] * len(header)]
    for row in table.to_dict("records"):
        trace = ", ".join(
            f"`{c}` ({r[:8]})" if r else f"`{c}`"
            for c, r in zip(row["cells"].split(), (row["runs"].split() + [""] * 99), strict=False)
        )
        rows.append(
            [
                str(row["budget"]),
                row["method"],
                str(row["K"]),
                str(row["L"]),
                *(_pm(row[m], row.get(f"{m}_std")) for m in metrics),
                str(row["seeds"]),
                trace,
            ]
        )
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


# --------------------------------------------------------------------------- figures


def mean_std(frame: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    return frame.groupby(by)["value"].agg(["mean", "std"]).fillna(0.0).reset_index()


def budget_figure(frame: pd.DataFrame, meta: dict[str, Any], caption: str, path: Path) -> bool:
    """Figure 2: final log joint and ESS/L versus K at K*L fixed, shaded std."""
    if not meta.get("budget"):
        return False
    pairs = {tuple(p) for p in meta["budget"]["pairs"]}
    fin = finals(frame)
    fin = fin[[(k, l) in pairs for k, l in zip(fin["K"], fin["L"], strict=False)]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, CURVE_METRICS, strict=False):
        stats = mean_std(fin[fin["metric"] == metric], ["method", "K"])
        for (method, group), color in zip(stats.groupby("method"), sns.color_palette(), strict=False):
            ax.plot(group["K"], group["mean"], marker="o", label=method, color=color)
            ax.fill_between(
                group["K"], group["mean"] - group["std"], group["mean"] + group["std"], alpha=0.2, color=color
            )
        ax.set_xscale("log")
        ax.set_xlabel(f"K sweeps (L = {meta['budget']['total']} // K)")
        ax.set_ylabel("log p(x, z)" if metric == "log_joint" else "ESS / L")
    axes[0].legend()
    fig.suptitle(f"Fixed budget K*L = {meta['budget']['total']} (Figure 2)")
    _save(fig, path, caption)
    return True


def sweeps_figure(frame: pd.DataFrame, meta: dict[str, Any], caption: str, path: Path) -> bool:
    """Log joint and ESS/L versus sweep at the largest evaluation pair."""
    if not meta["pairs"]:
        return False
    k_max, l_at = max(tuple(p) for p in meta["pairs"])
    sub = frame[(frame["K"] == k_max) & (frame["L"] == l_at)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, CURVE_METRICS, strict=False):
        stats = mean_std(sub[sub["metric"] == metric], ["method", "sweep"])
        for (method, group), color in zip(stats.groupby("method"), sns.color_palette(), strict=False):
            if len(group) == 1:  # one-step methods (RWS with K*L particles): a level line
                ax.axhline(
                    group["mean"].iloc[0], ls="--", color=color, label=f"{method} ({k_max * l_at} particles)"
                )
                continue
            ax.plot(group["sweep"], group["mean"], marker=".", label=method, color=color)
            ax.fill_between(
                group["sweep"],
                group["mean"] - group["std"],
                group["mean"] + group["std"],
                alpha=0.2,
                color=color,
            )
        ax.set_xlabel("sweep k")
        ax.set_ylabel("log p(x, z)" if metric == "log_joint" else "ESS / L")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Convergence over sweeps (K={k_max}, L={l_at})")
    _save(fig, path, caption)
    return True


def mse_figure(frame: pd.DataFrame, meta: dict[str, Any], caption: str, path: Path) -> bool:
    """Figure 4: reconstruction MSE versus sweep, one line per held-out set (e.g. per (T, D)),
    one panel per method, at the largest evaluation pair; one-step methods (RWS) as points."""
    sub = frame[frame["metric"] == "mse"]
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
                yerr=group["std"],
                label=name,
                color=colors[name],
                capsize=2,
                **style,
            )
        ax.set_xlabel("sweep k" if stats["sweep"].nunique() > 1 else "one step (K*L particles)")
        ax.set_title(method, fontsize=9)
        ax.set_xticks(sorted(set(stats["sweep"])))
    axes[0, 0].set_ylabel("reconstruction MSE per pixel")
    axes[0, 0].legend(fontsize=7, title="test set", title_fontsize=7)
    fig.suptitle(f"Reconstruction MSE versus sweeps, per held-out set (Figure 4; K={k_max}, L={l_at})")
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
        stats = part.groupby(["method", "sweep"])["value"].agg(["mean", "sem"]).fillna(0.0).reset_index()
        for method, group in stats.groupby("method"):
            if len(group) == 1:
                ax.axhline(
                    group["mean"].iloc[0], ls="--", color=colors[method], label=f"{method} ({k * l} at once)"
                )
                continue
            ax.plot(group["sweep"], group["mean"], marker=".", color=colors[method], label=method)
            ax.fill_between(
                group["sweep"],
                group["mean"] - group["sem"],
                group["mean"] + group["sem"],
                alpha=0.2,
                color=colors[method],
            )
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
                x, group["mean"], yerr=group["std"], marker="o", capsize=2, color=colors[method], label=method
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
                yerr=group["std"],
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


def mse_table(frame: pd.DataFrame, meta: dict[str, Any]) -> pd.DataFrame:
    """Final-sweep reconstruction MSE per (test set, method, K, L): mean and std over seeds x datasets."""
    sub = finals(frame[frame["metric"] == "mse"])
    if sub.empty:
        return pd.DataFrame()
    if "test_set" not in sub:
        sub = sub.assign(test_set="test")
    table = sub.groupby(["test_set", "method", "K", "L"])["value"].agg(["mean", "std"]).reset_index()
    rank = {s["name"]: i for i, s in enumerate(meta.get("test_sets") or [])}
    return table.sort_values(
        ["test_set", "method", "K"], key=lambda c: c.map(rank) if c.name == "test_set" else c
    ).reset_index(drop=True)


def training_figure(training: pd.DataFrame, caption: str, path: Path) -> bool:
    if training.empty:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, metric in zip(axes, ("log_joint", "ess", "it_per_s"), strict=False):
        sub = training[training["metric"] == metric].copy()
        sub["cell"] = (
            sub["method"]
            + " K"
            + sub["K"].astype(str)
            + " L"
            + sub["L"].astype(str)
            + " s"
            + sub["seed"].astype(str)
        )
        sns.lineplot(data=sub, x="iteration", y="value", hue="cell", ax=ax, legend=ax is axes[0])
        ax.set_ylabel(
            {"log_joint": "log p(x, z) (training batch)", "ess": "ESS / L", "it_per_s": "iterations / s"}[
                metric
            ]
        )
    if axes[0].get_legend():
        axes[0].legend(fontsize=7)
    fig.suptitle("Training curves (last sweep of each training batch)")
    _save(fig, path, caption)
    return True


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
                panels[i, j] = (f"{method}, sweep {sweep}\n{fset} (x {tuple(x.shape[1:])})", x[0], z)
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


def animation(
    task: str, samples: dict[str, np.ndarray], meta: dict[str, Any], root: Path, path: Path
) -> bool:
    """A GIF of the last APG sweep's sample on the first figure set (tasks with ``animate``)."""
    spec = get_task(task)
    if spec.animate is None or not meta["samples"]:
        return False
    import torch
    from PIL import Image

    from pipeline.common import load_trained

    entry = max(meta["samples"], key=lambda e: (len(e["sweeps"]), -e["seed"]))
    cell = next(c for c in meta["cells"] if c["cell_id"] == entry["cell_id"])
    _, model, _ = load_trained(root / cell["checkpoint"])
    sweep = max(entry["sweeps"])
    prefix = f"{entry['cell_id']}__{entry['figure_set']}__sweep{sweep}__"
    z = {k[len(prefix) :]: torch.from_numpy(v[0]) for k, v in samples.items() if k.startswith(prefix)}
    x = torch.from_numpy(samples[f"x__{entry['figure_set']}"][0]).to(torch.get_default_dtype())
    frames = np.asarray(spec.animate(model, x, z))
    images = [Image.fromarray(f) for f in frames]
    atomic_write(
        path,
        lambda tmp: images[0].save(
            tmp, format="GIF", save_all=True, append_images=images[1:], duration=200, loop=0
        ),
    )
    return True


def _save(fig, path: Path, caption: str) -> None:
    fig.text(0.5, 0.005, caption, ha="center", va="bottom", fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    atomic_write(path, lambda tmp: fig.savefig(tmp, format=path.suffix.lstrip("."), dpi=110))
    plt.close(fig)


# --------------------------------------------------------------------------- the stage


def report_task(
    task: str,
    results: dict[str, Any],
    paper: dict[str, Any] | None,
    out: Path,
    root: Path,
    label: str,
    fmt: str,
) -> dict[str, Any]:
    meta, all_sets = results["meta"], results["metrics"]
    frame = primary_test_set(all_sets, meta)
    caption = scale_caption(meta, label)
    table = table1(frame, meta, paper)
    tables, figures = out / "tables", out / "figures"
    atomic_write(tables / f"{task}_table1.csv", lambda tmp: table.to_csv(tmp, index=False))
    md = table_markdown(table, (paper or {}).get("block_labels"))
    atomic_write(tables / f"{task}_table1.md", lambda tmp: tmp.write_text(md + "\n"))
    methods = comparison_table(frame, meta)
    atomic_write(tables / f"{task}_methods.csv", lambda tmp: methods.to_csv(tmp, index=False))
    methods_md = comparison_markdown(methods)
    atomic_write(tables / f"{task}_methods.md", lambda tmp: tmp.write_text(methods_md + "\n"))
    mse = mse_table(all_sets, meta)
    mse_md = ""
    if not mse.empty:
        atomic_write(tables / f"{task}_mse.csv", lambda tmp: mse.to_csv(tmp, index=False))
        mse_md = "\n".join(
            ["| test set | method | K | L | MSE |", "| --- | --- | --- | --- | --- |"]
            + [
                f"| {r.test_set} | {r.method} | {r.K} | {r.L} | {_pm(r.mean, r.std)} |"
                for r in mse.itertuples(index=False)
            ]
        )
    made = {}
    for name, ok in (
        ("mse", mse_figure(all_sets, meta, caption, figures / f"{task}_mse.{fmt}")),
        ("compute", compute_figure(all_sets, meta, caption, figures / f"{task}_compute.{fmt}")),
        (
            "methods_sweeps",
            methods_sweeps_figure(frame, meta, caption, figures / f"{task}_methods_sweeps.{fmt}"),
        ),
        (
            "kl",
            kl_figure(frame, meta, caption, figures / f"{task}_kl.{fmt}", (paper or {}).get("block_labels")),
        ),
        ("budget", budget_figure(frame, meta, caption, figures / f"{task}_budget.{fmt}")),
        ("sweeps", sweeps_figure(frame, meta, caption, figures / f"{task}_sweeps.{fmt}")),
        ("training", training_figure(results["training"], caption, figures / f"{task}_training.{fmt}")),
        (
            "samples",
            samples_figure(task, results["samples"], meta, caption, figures / f"{task}_samples.{fmt}"),
        ),
        ("animation", animation(task, results["samples"], meta, root, figures / f"{task}_samples.gif")),
    ):
        if ok:
            made[name] = f"figures/{task}_{'samples.gif' if name == 'animation' else f'{name}.{fmt}'}"
    headline = {
        f"{row.method}/K{row.K}/L{row.L}": {
            m: float(getattr(row, m))
            for m in ("log_joint", "d_log_joint", "ess")
            if m in table and np.isfinite(getattr(row, m))
        }
        for row in table.itertuples(index=False)
    }
    for r in mse.itertuples(index=False):
        if np.isfinite(r.mean):
            headline.setdefault(f"{r.method}/K{r.K}/L{r.L}", {})[f"mse_{r.test_set}"] = float(r.mean)
    sets = meta.get("test_sets") or []
    return {
        "task": task,
        "caption": caption,
        "table_md": md,
        "methods_md": methods_md,
        "figures": made,
        "metrics": headline,
        "paper": paper,
        "mse_md": mse_md,
        "primary": sets[0]["name"] if len(sets) > 1 else None,
    }


FIGURE_TEXT = {
    "mse": "Figure 4: reconstruction MSE per pixel between held-out frames and the reconstructions of the weighted particles, versus sweep, one line per held-out set (e.g. per (T, D)); error bars: std over seeds x videos.",
    "compute": "Reconstruction MSE per pixel versus compute, per held-out set. Compute: likelihood evaluations per dataset, in units of one evaluation of log p(x | z) over the whole dataset for one particle (for a video: all T frames; a gradient counts 2, a block's Markov blanket its share of the data; the proposal networks' own cost is not counted). APG: L (1 + 4 (k - 1)) after sweep k (every block's blanket before and after its update), drawn as a line over its sweeps; RWS: K*L (one encoder pass); AVF: K*L (1 + 4 n) for n inference iterations per frame and for the codes. Error bars: std over seeds x videos.",
    "methods_sweeps": "Held-out log joint versus sweep for every method at each test-time budget (K, L): APG, exact population Gibbs (gibbs), bootstrapped Gibbs, HMC-RWS (K-1 HMC transitions), and the one-step methods (RWS, reparam: K*L particles at once) as dashed levels; shaded: standard error of the mean over seeds x datasets (the same held-out datasets for every method; their spread is in Table 1).",
    "kl": "Inclusive KL (eq. 4) of each method's block kernels to the exact Gibbs conditionals, per block, using the final particles of each test-time budget as samples of the other blocks (4 exact draws each); gibbs uses the exact kernels (0 by construction) and gibbs-bootstrap the prior for the global block. Error bars: std over seeds x datasets.",
    "budget": "Figure 2: log joint and ESS/L of the final sweep versus K at a fixed budget K*L (test time, each trained cell); shaded: std over seeds x datasets.",
    "sweeps": "Log joint and ESS/L versus sweep at the largest evaluation budget; RWS (one step with K*L particles) as a dashed level.",
    "training": "Training curves recorded by the sweep (last sweep of each training batch) and per-trial iterations/s.",
    "samples": "Figure 1/3 style: each method's highest-weight sample after k sweeps, on held-out datasets of different sizes (the task's draw hook: for videos, frames with the inferred digit boxes).",
    "animation": "Animated sample (the task's animate hook): for videos, each frame | its reconstruction, with the inferred boxes.",
}


def index_markdown(parts: list[dict[str, Any]], label: str) -> str:
    lines = [
        "# Reproduction report",
        "",
        "Generated by `dvc repro` (stage `report`) from recorded results in `results/eval/`; "
        "do not edit by hand. Paper: Wu et al., *Amortized Population Gibbs Samplers with "
        "Neural Sufficient Statistics* (arXiv 1911.01382).",
        "",
        f"**Scale: {label}.** Our numbers come from far shorter training than the paper's and are "
        "not expected to match them; the paper's numbers are shown beside ours (`paper` columns), "
        "never in place of them.",
        "",
    ]
    for part in parts:
        task = part["task"]
        lines += [f"## {task}", "", part["caption"] + ".", ""]
        if part.get("primary"):
            lines += [
                f"Tables and the sweep/budget figures use the first held-out set, `{part['primary']}`; "
                "Figure 4 and the MSE table cover every set.",
                "",
            ]
        if part["paper"]:
            lines += [f"Paper scale: {part['paper']['scale']}.", ""]
        lines += [
            f"### Table 1 ([csv](tables/{task}_table1.csv))",
            "",
            "Mean ± std over seeds and held-out datasets at each test-time budget (K, L); `paper`: the "
            "paper's value for the column to its left (Table 1), where it reports one. Δ log p(x,z): "
            "paired difference (same dataset) to the baseline method at the same budget; ESS/L: eq. 11; "
            "`ess`/`kl` per block: ESS/L after the block update and inclusive KL (eq. 4); numbered "
            "blocks (one per video frame) are averaged over t. RWS rows "
            "spend K*L particles in one step. The CSV has every column unrounded.",
            "",
            part["table_md"],
            "",
            f"### Methods at equal sample budgets ([csv](tables/{task}_methods.csv))",
            "",
            "Every method at each test-time budget K×L: held-out log joint, ESS/L, the SMC estimate "
            "of log p(x) and the importance-sampled one from the method's encoder with K×L samples "
            "(Rezende et al. 2014, appendix E). Mean ± std over seeds (each seed first averaged over "
            "the held-out datasets). RWS, reparam and AVF draw K×L samples in one step (AVF: K×L "
            "independent variational filters); HMC-RWS runs L chains through K-1 HMC transitions "
            "(extra gradient evaluations per transition; `HMC accept`: its mean Metropolis acceptance "
            "probability, also logged per training step as `accept` in MLflow); gibbs uses the exact "
            "conditionals. Each row names the sweep cells (and MLflow child runs, tag `apg.cell_id`) "
            "it averages.",
            "",
            part["methods_md"],
            "",
        ]
        if part.get("mse_md"):
            lines += [
                f"### Reconstruction MSE per held-out set ([csv](tables/{task}_mse.csv))",
                "",
                "Final-sweep MSE per pixel, mean ± std over seeds x videos (Figure 4's last points).",
                "",
                part["mse_md"],
                "",
            ]
        for name, rel in part["figures"].items():
            lines += [
                f"### {name}",
                "",
                f"![{task} {name}]({rel})",
                "",
                f"{FIGURE_TEXT[name]} {part['caption']}.",
                "",
            ]
    return "\n".join(lines)


def make_report(params: dict[str, Any], root: Path) -> Path:
    cfg = params.get("report", {})
    out = root / cfg.get("out", "reports")
    fmt = cfg.get("figure_format", "png")
    label = cfg.get("scale", "CPU-sized")
    paper_all = yaml.safe_load(PAPER_NUMBERS.read_text())
    sns.set_theme(style="whitegrid", context="paper")
    parts = []
    for task in params["tasks"]:
        results = load_results(root / "results" / "eval" / task)
        parts.append(report_task(task, results, paper_all.get(task), out, root, label, fmt))
    text = index_markdown(parts, label)
    atomic_write(out / "README.md", lambda tmp: tmp.write_text(text + "\n"))
    metrics = {p["task"]: p["metrics"] for p in parts}
    payload = json.dumps(metrics, indent=2, sort_keys=True)
    atomic_write(out / "metrics.json", lambda tmp: tmp.write_text(payload + "\n"))
    # What produced these results (code and params digests, commit): the CI check that
    # committed results are the checkout's own reads it (pipeline.provenance).
    provenance.write_record(params, root, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="regenerate reports/ from recorded results")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    from pipeline.cli import run_guarded

    def work() -> None:
        out = make_report(load_params(args.params), project_root())
        print(f"wrote {out}/README.md")

    run_guarded(work)


if __name__ == "__main__":
    main()
