"""Table 1, the table of methods at equal budgets, and the per-set MSE and tracking tables:
frames in, Markdown and CSV out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from apg.data import atomic_write
from pipeline.present import markdown_table, number, pm
from pipeline.report.data import finals
from pipeline.report.departures import (
    FLAG,
    FLAG_RULE,
    flagged_cells,
    paper_value,
    ratio_text,
    with_paper_ratios,
)
from pipeline.report.training import flag_notes, with_flags


def write_table(stem: Path, table: pd.DataFrame, md: str | None = None) -> None:
    """``table`` to ``<stem>.csv`` (every column unrounded) and, given its Markdown, ``<stem>.md``."""
    atomic_write(stem.with_name(f"{stem.name}.csv"), lambda tmp: table.to_csv(tmp, index=False))
    if md is not None:
        atomic_write(stem.with_name(f"{stem.name}.md"), lambda tmp: tmp.write_text(md + "\n"))


def table1(frame: pd.DataFrame, meta: dict[str, Any], paper: dict[str, Any] | None) -> pd.DataFrame:
    """One row per (method, K, L) of the evaluation pairs: mean and std of final metrics.

    ``d_log_joint`` is the paired difference (same held-out dataset) to the baseline
    method at the same test-time budget, like the paper's left column. Beside each metric
    the paper reports: ``paper_<metric>``, and ``paper_ratio_<metric>`` / ``paper_note_<metric>``
    (``departures.with_paper_ratios``: ours / paper, and the reason where that is more than
    2x either way).
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
    table = table.sort_values(
        ["method", "K", "L"], key=lambda s: s.map(rank) if s.name == "method" else s
    ).reset_index(drop=True)
    return with_paper_ratios(table, paper)


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
    head = [m for m in ("d_log_joint", "log_joint", "sweep_ess", "ess") if m in metrics]
    ess = [m for m in metrics if m.startswith("ess_")]
    kl = [m for m in metrics if m.startswith("kl_")]
    ari = [m for m in ("log_joint_true", "ari", "ari_ceiling", "centre_err") if m in metrics]
    rest = [m for m in metrics if m not in head + ess + kl + ari]
    return head + ess + kl + ari + rest


def paper_column(paper: dict[str, Any] | None, index: pd.MultiIndex, metric: str) -> list[float] | None:
    """The paper's value for each of our rows (``departures.paper_value``); None when it reports none."""
    if not any(metric in row for row in (paper or {}).get("rows") or []):
        return None
    return [paper_value(paper, method, k, metric) for method, k, _ in index]


def table_markdown(table: pd.DataFrame, labels: dict[str, str] | None = None) -> str:
    """Compact Markdown: ``mean ± std`` per metric, the paper's value in the next column.

    ``labels`` renames block suffixes for readers (``globals`` -> ``{tau,mu}``) and whole
    metrics (a task's ``metric_labels``). A number more than 2x from the paper's, either way,
    carries ``⚑n``; the footnote ``n`` gives the ratios and the recorded reason
    (``departures``)."""
    metrics = [
        c
        for c in table.columns
        if c not in ("method", "K", "L", "flag") and not c.endswith("_std") and not c.startswith("paper_")
    ]
    header, cells = ["method", "K", "L"], []
    for m in metrics:
        header.append(_label(m, labels))
        if f"paper_{m}" in table:
            header.append("paper")
    marks, notes = _departure_marks(table, labels)
    for pos, row in enumerate(table.to_dict("records")):
        line = [_flagged(row["method"], row.get("flag")), str(row["K"]), str(row["L"])]
        for m in metrics:
            line.append(_flagged(pm(row[m], row.get(f"{m}_std")), marks.get((pos, m))))
            if f"paper_{m}" in table:
                line.append(number(row[f"paper_{m}"]))
        cells.append(line)
    return markdown_table(header, cells) + _footnote(table) + notes


def _departure_marks(
    table: pd.DataFrame, labels: dict[str, str] | None
) -> tuple[dict[tuple[int, str], str], str]:
    """``{(row position, metric): "⚑n"}`` for the numbers far from the paper's, one ``n`` per
    (metric, reason), and the footnotes: per ``n``, the metric, each flagged row's ratio and
    the reason ("" when nothing is flagged)."""
    groups: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for pos, metric, ratio, note in flagged_cells(table):
        groups.setdefault((metric, note), []).append((pos, ratio))
    if not groups:
        return {}, ""
    marks, lines = {}, []
    rows = table.to_dict("records")
    for n, ((metric, note), cells) in enumerate(groups.items(), start=1):
        mark = f"{FLAG}{n}"
        marks.update({(pos, metric): mark for pos, _ in cells})
        where = ", ".join(
            f"{ratio_text(ratio)} ({rows[pos]['method']} K={rows[pos]['K']})" for pos, ratio in cells
        )
        lines.append(f"- {mark} {_label(metric, labels)}: ratio {where} to the paper: {note}.")
    return marks, "\n\n" + FLAG_RULE + "\n\n" + "\n".join(lines)


def _flagged(text: str, flag: Any) -> str:
    return f"{text} {flag}" if isinstance(flag, str) and flag else text


def _footnote(table: pd.DataFrame) -> str:
    """The flags' footnote under a Markdown table (nothing when no row is flagged)."""
    marks = "".join(table["flag"].dropna()) if "flag" in table else ""
    return f"\n\n{flag_notes(marks)}" if marks else ""


def _label(metric: str, labels: dict[str, str] | None) -> str:
    if labels and metric in labels:  # a task's own name for a metric (paper_numbers.yaml)
        return labels[metric]
    if metric.startswith(("ess_", "kl_")) and metric.endswith("_t"):
        kind, block = metric[: metric.index("_")], metric[metric.index("_") + 1 :]
        return f"{kind} {block} (mean over t)"
    for prefix in ("ess_", "kl_"):
        if metric.startswith(prefix) and labels and metric[len(prefix) :] in labels:
            return f"{prefix.rstrip('_')} {labels[metric[len(prefix) :]]}"
    return METRIC_LABELS.get(metric, metric)


METRIC_LABELS = {
    "d_log_joint": "Δ log p(x,z)",
    "log_joint": "log p(x,z)",
    # Two ESS of the whole state: the paper's (Table 1, section 5.3: resampling once per
    # sweep, so the weights span every block of the sweep) and the one of the weights since
    # the last resampling under per-block resampling (the last block's, ``ess`` otherwise).
    "sweep_ess": "ESS/L all blocks (per-sweep resampling)",
    "ess": "ESS/L last block (per-block resampling)",
    "ari": "ARI",
    "ari_ceiling": "ARI ceiling",
    "centre_err": "centre error",
    "log_joint_true": "log p(x,μ,c) true model",
}


COMPARISON_METRICS = (
    "log_joint",
    "log_joint_true",
    "sweep_ess",
    "ess",
    "log_evidence",
    "log_evidence_is",
    "ari",
    "centre_err",
    "accept",
)


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
        "sweep_ess": "ESS/L per-sweep resampling",
        "ess": "ESS/L last block",
        "log_evidence": "log p(x) SMC",
        "log_evidence_is": "log p(x) IS",
        "ari": "ARI",
        "log_joint_true": "log p(x,μ,c) true model",
        "centre_err": "centre error",
        "accept": "HMC accept",
    }
    metrics = [m for m in COMPARISON_METRICS if m in table]
    header = ["K×L", "method", "K", "L", *(labels[m] for m in metrics), "seeds", "cells (MLflow runs)"]
    rows = []
    for row in table.to_dict("records"):
        trace = ", ".join(
            f"`{c}` ({r[:8]})" if r else f"`{c}`"
            for c, r in zip(row["cells"].split(), (row["runs"].split() + [""] * 99), strict=False)
        )
        rows.append(
            [
                str(row["budget"]),
                _flagged(row["method"], row.get("flag")),
                str(row["K"]),
                str(row["L"]),
                *(pm(row[m], row.get(f"{m}_std")) for m in metrics),
                str(row["seeds"]),
                trace,
            ]
        )
    return markdown_table(header, rows) + _footnote(table)


def set_table(frame: pd.DataFrame, meta: dict[str, Any], metric: str = "mse") -> pd.DataFrame:
    """A metric's final sweep per (test set, method, K, L): mean and std over seeds x datasets."""
    sub = finals(frame[frame["metric"] == metric])
    if sub.empty:
        return pd.DataFrame()
    if "test_set" not in sub:
        sub = sub.assign(test_set="test")
    table = sub.groupby(["test_set", "method", "K", "L"])["value"].agg(["mean", "std"]).reset_index()
    rank = {s["name"]: i for i, s in enumerate(meta.get("test_sets") or [])}
    return table.sort_values(
        ["test_set", "method", "K"], key=lambda c: c.map(rank) if c.name == "test_set" else c
    ).reset_index(drop=True)


MSE_KEYS = ["test_set", "method", "K", "L"]


# The tracking table's columns after the position error: metric -> header.
TRACKING_COLUMNS = {
    "tracked": "tracked frames",
    "box_err": "boxes' error (px)",
    "pos_err_aligned": "motion error, offsets removed (px)",
    "pos_err_frame": "error, each frame matched alone (px)",
    "tracked_frame": "tracked frames, each frame matched alone",
    "swapped": "frames with traded digits",
}


# What a column means, under the table when it has the column (older runs lack the last three).
TRACKING_NOTES = {
    "pos_err_frame": "Each frame matched alone: the position error and tracked frames with every frame's "
    "digits matched on their own, which tells where the boxes are whichever digit each follows.",
    "swapped": "Frames with traded digits: those whose every box is within 3 px of some digit but not of "
    "its own (boxes that swapped digits, typically where two digits pass close by).",
}


def tracking_markdown(frame: pd.DataFrame, meta: dict[str, Any], flags: dict[str, str], stem: Path) -> str:
    """The tracking table (Bouncing MNIST): final-sweep position error (at the digits' ink
    centres), tracked-frame fraction, the boxes' error and the motion error per (test
    set, method, K, L), written to ``<stem>.csv``; "" when the task has no position truth."""
    table = set_table(frame, meta, "pos_err")
    if table.empty:
        return ""
    table = table.rename(columns={"mean": "mean_pos_err", "std": "std_pos_err"})
    columns = {"pos_err": "position error (px)"}
    for metric, header in TRACKING_COLUMNS.items():
        part = set_table(frame, meta, metric)
        if not part.empty:
            part = part.rename(columns={"mean": f"mean_{metric}", "std": f"std_{metric}"})
            table = table.merge(part, on=MSE_KEYS, how="left")
            columns[metric] = header
    table = with_flags(table, frame.assign(test_set=frame.get("test_set", "test")), MSE_KEYS, flags)
    write_table(stem, table)
    rows = [
        [r.test_set, _flagged(r.method, r.flag), f"{r.K}", f"{r.L}"]
        + [pm(getattr(r, f"mean_{m}"), getattr(r, f"std_{m}")) for m in columns]
        for r in table.itertuples(index=False)
    ]
    header = ["test set", "method", "K", "L", *columns.values()]
    notes = " ".join(TRACKING_NOTES[m] for m in columns if m in TRACKING_NOTES)
    return markdown_table(header, rows) + _footnote(table) + (f"\n\n{notes}" if notes else "")
