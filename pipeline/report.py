"""Stage ``report``: tables and figures from recorded results only (never retrains).

``python -m pipeline.report`` reads ``results/eval/<task>/`` for every task in
``tasks`` and writes into ``reports/``:

- ``README.md``: the index, with every table and figure and the scale it was made at; it
  opens with the claims table: the paper's claims (``paper_numbers.yaml``, ``claims``)
  checked against the evaluation metrics with 95% intervals over seeds (``check_claim``);
- ``tables/<task>_training.{md,csv}``: per cell, whether its training log joint has
  plateaued (``plateau``: the OLS trend over the last fifth of training against its
  standard error). Rows of every other table (and claims) whose numbers come from a
  cell that has not plateaued carry ``†`` (not assessable: ``‡``);
- ``tables/<task>_table1.{md,csv}``: Table 1 (our numbers, the paper's beside them);
- ``tables/<task>_methods.{md,csv}``: every method at the same sample budgets K*L: held-out
  log joint, ESS/L, both log-evidence estimates and HMC's acceptance rate, mean and std
  over seeds, with the cell ids and MLflow run ids each number comes from;
- ``figures/<task>_budget.png``: Figure 2, log joint and ESS/L versus K at K*L fixed: cells
  retrained per budget (solid) and one model at test-time budgets (dashed);
- ``figures/<task>_sweeps.png``: convergence versus sweeps; ``<task>_training.png``: the
  training log joint of every cell, one panel per method;
- ``figures/<task>_methods_sweeps.png``: every method's held-out log joint versus sweeps
  (when several methods run sweeps: APG and the companion-paper samplers on the GMM);
- ``figures/<task>_kl.png``: inclusive KL of the block kernels to the exact Gibbs
  conditionals, per block (tasks with exact conditionals);
- ``figures/<task>_compute.png``: reconstruction MSE versus compute (likelihood
  evaluations per dataset, ``Method.model_evaluations``), per held-out set;
- ``figures/<task>_samples.png``: Figure-1-style pictures (the task's ``draw`` hook),
  and ``<task>_samples.gif`` when the task has an ``animate`` hook;
- ``metrics.json``: headline numbers for ``dvc metrics show`` / ``dvc exp show``, and under
  ``claims`` each checked claim (``task/id``: value, lo, hi, target, pass).

Table 1, the method tables and the claims use each method's main cells (trained at its
grid ``pairs``); cells trained only for Figure 2 (grid ``budget``) feed its solid curve.

Every number is a mean over seeds and held-out datasets; ``std`` columns and shaded
bands are the standard deviation over the same (seed, dataset) pairs (the methods-sweeps
figure shades the standard error instead, and says so).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, NamedTuple

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
from pipeline import provenance, stages  # noqa: E402
from pipeline.common import project_root  # noqa: E402
from pipeline.config import load_params  # noqa: E402
from pipeline.impute import FIGURE_TEXT as IMPUTATION_FIGURE_TEXT  # noqa: E402
from pipeline.impute import load_imputation, report_imputation  # noqa: E402
from pipeline.present import number, pm, write_gif  # noqa: E402
from pipeline.recorded import GENERATIVE_ONLY, compress_samples, recorded_runs  # noqa: E402
from pipeline.statistics import (  # noqa: E402
    MIN_SEEDS,
    Estimate,
    detectable,
    difference,
    equivalent,
    seed_interval,
)

PAPER_NUMBERS = Path(__file__).with_name("paper_numbers.yaml")
CURVE_METRICS = ("log_joint", "ess")


# --------------------------------------------------------------------------- data


def load_results(eval_dir: Path) -> dict[str, Any]:
    for name in ("meta.json", "metrics.parquet", "training.parquet", "samples.npz"):
        if not (eval_dir / name).is_file():
            raise ValueError(f"{eval_dir / name} not found; run the evaluate stage first")
    with np.load(eval_dir / "samples.npz") as archive:
        samples = {k: archive[k] for k in archive.files}
    meta = json.loads((eval_dir / "meta.json").read_text())
    metrics = pd.read_parquet(eval_dir / "metrics.parquet")
    training = pd.read_parquet(eval_dir / "training.parquet")
    # A cell of a swept axis is a method of its own in every table and figure: "apg
    # [network.hidden=64]"; its plain method name stays in base_method.
    labels = {c["cell_id"]: method_label(c) for c in meta["cells"]}
    for cell in meta["cells"]:
        cell["base_method"], cell["method"] = cell["method"], labels[cell["cell_id"]]
    for frame in (metrics, training):
        frame["method"] = frame["cell_id"].map(labels).fillna(frame["method"])
    return {
        "meta": meta,
        "metrics": metrics,
        "training": training,
        "samples": samples,
        "imputation": load_imputation(eval_dir),
    }


def method_label(cell: dict[str, Any]) -> str:
    """``method``, or ``method [key=value,...]`` for a cell of a grid entry's axes."""
    axes = cell.get("axes") or {}
    return f"{cell['method']} [{','.join(f'{k}={v}' for k, v in axes.items())}]" if axes else cell["method"]


def finals(frame: pd.DataFrame) -> pd.DataFrame:
    """Each (cell, K, L, metric, dataset)'s value at the run's last sweep."""
    last = frame.groupby(["cell_id", "K", "L", "metric"])["sweep"].transform("max")
    return frame[frame["sweep"] == last]


def training_length(meta: dict[str, Any]) -> str:
    """How long the cells trained: the count most methods share, then the other methods'
    ("8000 training iterations (gibbs-bootstrap, reparam 5000; gibbs untrained)")."""
    per_method: dict[str, set[int]] = {}
    for cell in meta.get("cells", []):
        per_method.setdefault(cell["method"], set()).add(int(cell["iterations"]))
    if not per_method:  # results written before the metadata listed its cells
        return "/".join(str(i) for i in meta["iterations"]) + " training iterations"
    methods: dict[str, list[str]] = {}  # "8000" (or "3000/4500" for a method's grid) -> methods
    for method, counts in per_method.items():
        methods.setdefault("/".join(map(str, sorted(counts))), []).append(method)
    main = max((c for c in methods if c != "0"), key=lambda c: len(methods[c]), default="0")
    others = [
        f"{', '.join(methods[c])} {'untrained' if c == '0' else c}"
        for c in sorted(methods, key=lambda c: -int(c.split("/")[-1]))
        if c != main
    ]
    return f"{main} training iterations" + (f" ({'; '.join(others)})" if others else "")


def scale_caption(meta: dict[str, Any], label: str) -> str:
    sets = meta.get("test_sets") or []
    if len(sets) > 1:
        held_out = "held-out sets " + ", ".join(f"{s['name']} ({s['num_datasets']})" for s in sets)
    else:
        held_out = f"{meta['test_datasets']} held-out datasets"
    return (
        f"{label}: {training_length(meta)} on {meta['train_datasets']} simulated datasets "
        f"(batch {meta['batch_size']}), {held_out}, seeds {meta['seeds']}"
    )


def primary_test_set(frame: pd.DataFrame, meta: dict[str, Any]) -> pd.DataFrame:
    """Rows of the first held-out set (Table 1, method table, sweep and budget figures);
    results written before several test sets existed have one set and no column."""
    sets = meta.get("test_sets") or []
    if "test_set" not in frame or not sets:
        return frame
    return frame[frame["test_set"] == sets[0]["name"]]


def main_rows(frame: pd.DataFrame, meta: dict[str, Any]) -> pd.DataFrame:
    """Rows of the cells Table 1, the method tables and the claims use: those a ``pairs``
    grid entry trained (``roles`` in meta.json). Cells trained only for Figure 2's retrained
    curve (``budget``) would otherwise be averaged into Table 1 with cells trained at another
    (K, L). A method with no ``main`` cell, and results written before roles existed, keep
    every cell."""
    roles = {c["cell_id"]: c.get("roles", ["main"]) for c in meta["cells"]}
    is_main = {cid: "main" in r for cid, r in roles.items()}
    has_main = {c["method"] for c in meta["cells"] if is_main[c["cell_id"]]}
    keep = [
        is_main.get(cid, True) or method not in has_main
        for cid, method in zip(frame["cell_id"], frame["method"], strict=True)
    ]
    return frame[keep]


def retrained_rows(frame: pd.DataFrame, meta: dict[str, Any]) -> pd.DataFrame:
    """Rows of the cells a ``budget`` grid entry trained, evaluated at their own training
    pair: Figure 2 retrained per budget (one point per cell)."""
    budget = {c["cell_id"] for c in meta["cells"] if "budget" in c.get("roles", [])}
    own = (frame["K"] == frame["train_K"]) & (frame["L"] == frame["train_L"])
    return frame[frame["cell_id"].isin(budget) & own]


# --------------------------------------------------------------------------- training plateau

# A cell has plateaued when neither its training log joint nor its training ESS/L over the
# last fifth of its iterations shows a trend larger than 3 standard errors; fewer than 5
# logged points there cannot
# tell a trend from noise.
PLATEAU_FRACTION = 0.2
PLATEAU_MIN_POINTS = 5
PLATEAU_Z = 3.0
NOT_PLATEAUED, NOT_ASSESSABLE = "†", "‡"
FLAG_NOTES = {
    NOT_PLATEAUED: "not plateaued: see the training table",
    NOT_ASSESSABLE: f"plateau not assessable (fewer than {PLATEAU_MIN_POINTS} logged points in the last "
    "fifth of training): see the training table",
}


class Plateau(NamedTuple):
    """The trend of a training curve over its last fifth (``plateau``).

    points: logged values in the window. start, end: first and last iteration in it.
    final: mean value in the window (the smoothed final training log joint).
    delta: OLS slope x (end - start), the change the trend makes across the window.
    se: the slope's standard error x (end - start). z: delta / se.
    plateaued: ``|z| < PLATEAU_Z``; None when the window has fewer than
    ``PLATEAU_MIN_POINTS`` points (not assessable).
    """

    points: int
    start: float
    end: float
    final: float
    delta: float
    se: float
    z: float
    plateaued: bool | None


def plateau(iteration: np.ndarray, value: np.ndarray, fraction: float = PLATEAU_FRACTION) -> Plateau:
    """Fit ``value ~ a + b iteration`` by ordinary least squares over the logged points with
    ``iteration > (1 - fraction) * last iteration`` and test the trend: ``Delta = b (end -
    start)``, ``se(Delta) = se(b) (end - start)`` with ``se(b)^2 = s^2 / sum (t - mean t)^2``
    and ``s^2`` the residual variance on ``n - 2`` degrees of freedom, ``z = Delta / se``.

    The logged values are single training batches, so their scatter around the line is
    the batch-to-batch noise the trend is compared with.
    """
    t, v = np.asarray(iteration, dtype=float), np.asarray(value, dtype=float)
    finite = np.isfinite(t) & np.isfinite(v)
    t, v = t[finite], v[finite]
    nan = float("nan")
    if not len(t):
        return Plateau(0, nan, nan, nan, nan, nan, nan, None)
    window = t > (1.0 - fraction) * t.max()
    t, v = t[window], v[window]
    n = len(t)
    start, end, final = float(t.min()), float(t.max()), float(v.mean())
    delta = se = z = nan
    if n >= 3:
        dt = t - t.mean()
        sxx = float(dt @ dt)
        slope = float(dt @ (v - v.mean())) / sxx
        resid = v - v.mean() - slope * dt
        se_slope = math.sqrt(float(resid @ resid) / (n - 2) / sxx)
        delta, se = slope * (end - start), se_slope * (end - start)
        # A perfectly straight window: no noise to compare with; any trend is significant.
        z = delta / se if se > 0 else (0.0 if delta == 0 else math.copysign(math.inf, delta))
    ok = bool(abs(z) < PLATEAU_Z) if n >= PLATEAU_MIN_POINTS else None
    return Plateau(n, start, end, final, delta, se, z, ok)


# The training curves a cell must have settled on: the log joint (what every method
# improves) and ESS/L (what the proposals' own objective, an inclusive KL, moves; it keeps
# rising after the log joint is flat).
PLATEAU_METRICS = ("log_joint", "ess")


def training_table(training: pd.DataFrame, meta: dict[str, Any]) -> pd.DataFrame:
    """One row per cell: the ``plateau`` statistics of its training log joint and ESS/L,
    and a verdict (``yes`` when both are flat, ``no`` when either moves; ``not assessable``;
    ``not trained`` for cells with nothing to learn, e.g. exact Gibbs at 0 iterations), its
    iterations and mean iterations/s."""
    rows = []
    for cell in meta["cells"]:
        stats = {}
        for metric in PLATEAU_METRICS:
            curve = (
                training[(training["metric"] == metric) & (training["cell_id"] == cell["cell_id"])]
                if not training.empty
                else training
            )
            if len(curve):
                stats[metric] = plateau(curve["iteration"].to_numpy(), curve["value"].to_numpy())
        verdicts = [st.plateaued for st in stats.values()]
        if not cell["iterations"] or not stats:
            verdict = "not trained" if not cell["iterations"] else "not assessable"
        elif False in verdicts:
            verdict = "no"
        else:
            verdict = "not assessable" if None in verdicts else "yes"
        lj, ess = stats.get("log_joint"), stats.get("ess")
        rows.append(
            {
                "cell": cell["name"],
                "cell_id": cell["cell_id"],
                "method": cell["method"],
                "K": cell["K"],
                "L": cell["L"],
                "seed": cell["seed"],
                "iterations": cell["iterations"],
                "it_per_s": cell.get("mean_it_per_s"),
                "points": lj.points if lj else 0,
                "window_start": lj.start if lj else np.nan,
                "final_log_joint": lj.final if lj else np.nan,
                "delta": lj.delta if lj else np.nan,
                "se": lj.se if lj else np.nan,
                "z": lj.z if lj else np.nan,
                "final_ess": ess.final if ess else np.nan,
                "ess_delta": ess.delta if ess else np.nan,
                "ess_z": ess.z if ess else np.nan,
                "plateaued": verdict,
            }
        )
    table = pd.DataFrame(rows)
    return table.sort_values(["method", "K", "L", "seed"]).reset_index(drop=True) if rows else table


def cell_flags(training: pd.DataFrame) -> dict[str, str]:
    """``{cell_id: mark}``: ``†`` for a cell that has not plateaued, ``‡`` for one whose
    plateau cannot be assessed, nothing for the rest (``training_table`` rows)."""
    marks = {"no": NOT_PLATEAUED, "not assessable": NOT_ASSESSABLE}
    return {r.cell_id: marks[r.plateaued] for r in training.itertuples(index=False) if r.plateaued in marks}


def row_flag(cell_ids: Any, flags: dict[str, str]) -> str:
    """The marks of every cell a table row's numbers come from, each once (``†‡``)."""
    marks = {flags.get(cid, "") for cid in cell_ids}
    return "".join(m for m in (NOT_PLATEAUED, NOT_ASSESSABLE) if m in marks)


def with_flags(
    table: pd.DataFrame, frame: pd.DataFrame, keys: list[str], flags: dict[str, str]
) -> pd.DataFrame:
    """``table`` with a ``flag`` column: the marks of the cells whose rows in ``frame``
    share the table row's ``keys`` (e.g. method, K, L)."""
    cells = frame.groupby(keys)["cell_id"].unique()
    marks = [
        row_flag(cells.get(tuple(r) if len(keys) > 1 else r[0], []), flags)
        for r in table[keys].itertuples(index=False)
    ]
    return table.assign(flag=marks)


def flag_notes(marks: str) -> str:
    """Footnotes for the marks used in a table."""
    return " ".join(f"{m} {FLAG_NOTES[m]}." for m in (NOT_PLATEAUED, NOT_ASSESSABLE) if m in marks)


def training_markdown(table: pd.DataFrame) -> str:
    header = [
        "cell",
        "iterations",
        "it/s",
        "final log p(x,z)",
        "Δ last fifth",
        "se(Δ)",
        "z",
        "final ESS/L",
        "Δ ESS/L",
        "z (ESS/L)",
        "plateaued",
    ]
    rows = [header, ["---"] * len(header)]
    for r in table.itertuples(index=False):
        rows.append(
            [
                f"`{r.cell}`",
                str(r.iterations),
                number(r.it_per_s),
                number(r.final_log_joint),
                number(r.delta),
                number(r.se),
                "" if not np.isfinite(r.z) else f"{r.z:.1f}",
                number(r.final_ess),
                number(r.ess_delta) if np.isfinite(r.ess_delta) else "",
                "" if not np.isfinite(r.ess_z) else f"{r.ess_z:.1f}",
                r.plateaued
                + {"no": f" {NOT_PLATEAUED}", "not assessable": f" {NOT_ASSESSABLE}"}.get(r.plateaued, ""),
            ]
        )
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def stalled_seeds(table: pd.DataFrame, margin: float) -> pd.DataFrame:
    """Per training configuration (method, K, L) with more than one seed: how many seeds
    stalled, i.e. ended training (``final_log_joint``, the mean over the last fifth) more
    than ``margin`` below the best seed of the same configuration. A bistable method shows
    here as a count, where the intervals over seeds only show a wide spread."""
    rows = []
    trained = table[np.isfinite(table["final_log_joint"].astype(float))] if len(table) else table
    for (method, k, l), group in trained.groupby(["method", "K", "L"]) if len(trained) else []:
        if len(group) < 2:
            continue
        best = group["final_log_joint"].max()
        stalled = group[group["final_log_joint"] < best - margin]
        rows.append(
            {
                "method": method,
                "K": k,
                "L": l,
                "seeds": len(group),
                "stalled": len(stalled),
                "stalled_seeds": " ".join(str(seed) for seed in sorted(stalled["seed"])),
                "best_final_log_joint": best,
            }
        )
    return pd.DataFrame(rows)


def stalled_markdown(stalled: pd.DataFrame, margin: float) -> str:
    """The stalled-seed counts as one paragraph under the training table."""
    if stalled.empty:
        return ""
    counts = "; ".join(
        f"{r.method} K={r.K} L={r.L}: {r.stalled} of {r.seeds}"
        + (f" (seed{'s' if r.stalled > 1 else ''} {r.stalled_seeds.replace(' ', ', ')})" if r.stalled else "")
        for r in stalled.itertuples(index=False)
    )
    return (
        f"Stalled seeds (final training log joint more than {number(margin)} below the best seed's of the "
        f"same method and budget; the margin is set in pipeline/paper_numbers.yaml): {counts}."
    )


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
    head = [m for m in ("d_log_joint", "log_joint", "sweep_ess", "ess") if m in metrics]
    ess = [m for m in metrics if m.startswith("ess_")]
    kl = [m for m in metrics if m.startswith("kl_")]
    ari = [m for m in ("log_joint_true", "ari", "ari_ceiling", "centre_err") if m in metrics]
    rest = [m for m in metrics if m not in head + ess + kl + ari]
    return head + ess + kl + ari + rest


def paper_column(paper: dict[str, Any] | None, index: pd.MultiIndex, metric: str) -> list[float] | None:
    """The paper's value for each of our rows, matched by method and (if given) K."""
    rows = (paper or {}).get("rows") or []
    if not any(metric in row for row in rows):
        return None
    values = []
    for method, k, _ in index:
        match = [r for r in rows if r["method"] == method and r.get("K", k) == k]
        values.append(match[0].get(metric, np.nan) if match else np.nan)
    return values


def table_markdown(table: pd.DataFrame, labels: dict[str, str] | None = None) -> str:
    """Compact Markdown: ``mean ± std`` per metric, the paper's value in the next column.

    ``labels`` renames block suffixes for readers (``globals`` -> ``{tau,mu}``) and whole
    metrics (a task's ``metric_labels``)."""
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
    for row in table.to_dict("records"):
        line = [_flagged(row["method"], row.get("flag")), str(row["K"]), str(row["L"])]
        for m in metrics:
            line.append(pm(row[m], row.get(f"{m}_std")))
            if f"paper_{m}" in table:
                line.append(number(row[f"paper_{m}"]))
        cells.append(line)
    rows = ["| " + " | ".join(r) + " |" for r in [header, ["---"] * len(header), *cells]]
    return "\n".join(rows) + _footnote(table)


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


# --------------------------------------------------------------------------- method comparison

COMPARISON_METRICS = (
    "log_joint", "log_joint_true", "sweep_ess", "ess", "log_evidence", "log_evidence_is", "ari", "centre_err", "accept",
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
    rows = [header, ["---"] * len(header)]
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
    return "\n".join("| " + " | ".join(r) + " |" for r in rows) + _footnote(table)


# --------------------------------------------------------------------------- claims

CLAIM_KINDS = (
    "threshold", "above", "below", "at_least", "equivalent", "increasing", "falls_over_sweeps",
    "budget_above", "above_metric", "converges_within",
)
NOT_ENOUGH_SEEDS = "n/a ({n} seed{s})"
AT_CEILING = "at ceiling: not testable here"
VERDICT_RULES = (
    "Each number is a mean over seeds of the per-seed mean over the held-out datasets of the "
    "first test set (or of the set a claim names); [lo, hi] is a Student-t 95% interval over those "
    f"seed means. A claim resting on fewer than {MIN_SEEDS} seeds gets no verdict ('n/a (k seeds)') "
    "and is not counted. Threshold claims (≥, ≤) use the mean. Comparisons of two methods (or of two "
    "budgets' retrained cells) are about the difference of their means: 'A above B' ('below') needs "
    "Welch's 95% interval of mean(A) − mean(B) above (below) zero, 'A ≥ B' compares the means, and "
    "'equivalent within ±m' needs Welch's 90% interval inside (−m, m) (two one-sided tests at 5%; "
    "the margins m are set in pipeline/paper_numbers.yaml with their reasons). Claims about one "
    "cell are paired (same cell, same held-out dataset): 'falls over sweeps' takes per seed the mean "
    "of the last sweep's value minus the first sweep's and needs that change's 95% interval below "
    "zero; 'above another metric' takes per seed the mean of each metric minus the other one and "
    "needs every such difference's interval above zero; "
    "'increasing with K' takes the change from each K to the next the same way and needs "
    "every change's interval above zero, unless the metric already lies within the claim's stated "
    f"margin of its ceiling at the smallest K ('{AT_CEILING}'). 'converges within k sweeps' takes "
    "per seed the first sweep whose value (mean over the datasets) lies within the stated tolerance "
    "of the plateau, the mean of the run's last sweeps, and needs the upper end of the 95% interval "
    "of that sweep's mean over seeds at or below k. 'detectable': the smallest true "
    "effect (difference, change, or distance from a target) a two-sided 95% test on these seeds "
    "finds with 80% power, (t_0.975 + t_0.8)·SE. 'not run': the method, budget or metric is absent "
    "from these results."
)


def _rows(frame: pd.DataFrame, method: str, metric: str, pair: tuple[int, int]) -> pd.DataFrame:
    """``method``'s rows of ``metric`` at test-time ``pair``, indexed by (cell_id, dataset)."""
    k, l = pair
    at = frame[(frame["method"] == method) & (frame["K"] == k) & (frame["L"] == l) & (frame["metric"] == metric)]
    return at.set_index(["cell_id", "dataset"])


def _over_seeds(values: pd.Series, rows: pd.DataFrame) -> Estimate:
    """Per-dataset ``values`` (indexed like ``rows``): per seed their mean, then ``seed_interval``."""
    values = values.dropna()
    if values.empty:
        return seed_interval([])
    per_seed = values.groupby(rows["seed"].reindex(values.index)).mean()
    return seed_interval(per_seed.to_numpy(), tuple(sorted(set(values.index.get_level_values("cell_id")))))


def seed_estimate(fin: pd.DataFrame, method: str, metric: str, pair: tuple[int, int]) -> Estimate:
    """``metric`` of ``method``'s final particles at test-time ``pair``: per seed the mean
    over held-out datasets, then ``seed_interval``."""
    rows = _rows(fin, method, metric, pair)
    return _over_seeds(rows["value"], rows)


def paired_change(
    before: pd.DataFrame,
    after: pd.DataFrame,
    method: str,
    metric: str,
    pair: tuple[int, int],
    after_pair: tuple[int, int] | None = None,
    after_metric: str | None = None,
) -> Estimate:
    """``after - before`` of ``metric`` for the same cell and held-out dataset (two sweeps of
    one run at ``pair``, two test-time budgets ``pair`` → ``after_pair``, or two metrics
    ``metric`` → ``after_metric`` of the same run): per seed the
    mean over datasets, then ``seed_interval``. Paired, so the spread between seeds and
    datasets that both share cancels."""
    a, b = _rows(before, method, metric, pair), _rows(after, method, after_metric or metric, after_pair or pair)
    return _over_seeds(b["value"] - a["value"].reindex(b.index), b)


def retrained_estimates(retrained: pd.DataFrame, method: str, metric: str) -> dict[tuple[int, int], Estimate]:
    """``{(K, L): Estimate}`` over the cells retrained per budget (Figure 2), each evaluated
    at its own training pair."""
    sub = retrained[(retrained["method"] == method) & (retrained["metric"] == metric)]
    return {
        (int(k), int(l)): seed_estimate(part, method, metric, (int(k), int(l)))
        for (k, l), part in sub.groupby(["K", "L"])
    }


class ClaimResult(NamedTuple):
    """One checked claim: ``ours`` and ``target`` as printed; ``passed`` None when no verdict
    can be given (not run, fewer than ``MIN_SEEDS`` seeds, at the metric's ceiling), and then
    ``note`` says why; ``value``/``lo``/``hi``/``target_value`` for metrics.json;
    ``detectable``: the smallest effect its seeds could detect (``statistics.detectable``)."""

    task: str
    id: str
    claim: str
    section: str
    ours: str
    target: str
    passed: bool | None
    note: str
    value: Any
    lo: Any
    hi: Any
    target_value: Any
    cells: tuple[str, ...]
    detectable: float = math.nan


def _est(e: Estimate) -> str:
    """``mean [lo, hi]``, or ``mean (n/a, 1 seed)``."""
    if not e.n:
        return "n/a"
    if e.n < MIN_SEEDS:
        return f"{number(e.mean)} (interval n/a, {e.n} seed{'s' if e.n > 1 else ''})"
    return f"{number(e.mean)} [{number(e.lo)}, {number(e.hi)}]"


def _largest(values) -> float:
    """The largest of ``values``, NaN when any is NaN (a claim is as detectable as its least
    detectable part)."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def _seed_note(*estimates: Estimate) -> str:
    """Why no verdict: too few seeds behind one of ``estimates`` ('' when there are enough)."""
    n = min(e.n for e in estimates)
    return NOT_ENOUGH_SEEDS.format(n=n, s="s" if n > 1 else "") if n < MIN_SEEDS else ""


OPS = {">=": (lambda a, b: a >= b, "≥"), "<=": (lambda a, b: a <= b, "≤")}


def claim_target(spec: dict[str, Any]) -> str:
    """What a claim asks for, as printed in the claims table's ``target`` column."""
    kind = spec["kind"]
    if kind == "threshold":
        return f"{OPS[spec['op']][1]} {spec['target']}"
    if kind in ("above", "below"):
        at = f" at K={spec['other_pair'][0]} L={spec['other_pair'][1]}" if "other_pair" in spec else ""
        return f"{kind} {spec['other']}{at} (difference's 95% interval {kind} 0)"
    if kind == "falls_over_sweeps":
        return "last sweep below sweep 1 (paired change's 95% interval below 0)"
    if kind == "above_metric":
        return f"each above {spec['other_metric']} (paired differences' 95% intervals above 0)"
    if kind == "at_least":
        return f"≥ {spec['other']} (means)"
    if kind == "equivalent":
        return f"within ±{spec['margin']} of {spec['other']} (difference's 90% interval inside the margin)"
    if kind == "converges_within":
        return (
            f"first sweep within {spec['tolerance']} of the plateau (mean of the last "
            f"{spec['plateau_sweeps']} sweeps) ≤ {spec['sweeps']} (95% interval's upper end)"
        )
    if kind == "increasing":
        steps = "→".join(str(k) for k, _ in spec["pairs"])
        return f"increasing at every step of K {steps} (each paired change's 95% interval above 0)"
    return "largest K above smallest K (difference's 95% interval above 0)"  # budget_above


def check_claim(
    spec: dict[str, Any],
    task: str,
    fin: pd.DataFrame,
    retrained: pd.DataFrame,
    curves: pd.DataFrame | None = None,
) -> ClaimResult:
    """Evaluate one claim of ``<task>.claims`` (pipeline/paper_numbers.yaml) on the final
    metrics ``fin`` of the main cells (and the ``retrained`` budget cells), by the rules
    in ``VERDICT_RULES``. ``curves``: the main cells' rows of every held-out set and sweep,
    for claims that name a ``test_set`` or look at sweeps (``falls_over_sweeps``)."""
    kind = spec["kind"]
    if kind not in CLAIM_KINDS:
        raise ValueError(f"claim {task}/{spec['id']}: unknown kind {kind!r}; known: {CLAIM_KINDS}")
    method, metric = spec["method"], spec.get("metric", "")
    pair = tuple(spec.get("pair", (0, 0)))
    if "test_set" in spec:
        if curves is None or "test_set" not in curves:
            curves = pd.DataFrame(columns=["test_set", "method", "metric", "K", "L", "sweep", "cell_id"])
        curves = curves[curves["test_set"] == spec["test_set"]]
        fin = finals(curves)
    if "train" in spec:  # only the cells trained at this (K, L)
        k, l = spec["train"]
        fin = fin[(fin["train_K"] == k) & (fin["train_L"] == l)]
    # ``sweep``: the method's numbers after that sweep rather than its last (a budget that
    # matches another method's); the other method keeps its last sweep.
    at_sweep = spec.get("sweep")
    mine = fin
    if at_sweep is not None:
        if kind == "falls_over_sweeps":
            raise ValueError(f"claim {task}/{spec['id']}: a falls_over_sweeps claim takes no sweep")
        rows = curves if curves is not None and "sweep" in curves else fin.iloc[:0]
        mine = rows[rows["sweep"] == at_sweep]
    who = f"{method} K={pair[0]} L={pair[1]}" + (f" after sweep {at_sweep}" if at_sweep is not None else "")
    label = METRIC_LABELS.get(metric, metric)
    head = (task, spec["id"], spec["claim"], spec.get("section", ""))
    target = claim_target(spec)

    def result(ours, passed, note, value, lo, hi, target_value, cells, smallest=math.nan) -> ClaimResult:
        if "test_set" in spec and note != "not run":
            ours = f"{spec['test_set']}, {ours}"
        passed = None if note else passed
        return ClaimResult(*head, ours, target, passed, note, value, lo, hi, target_value, tuple(cells), smallest)

    not_run = result("not run", None, "not run", None, None, None, None, ())

    if kind == "threshold":
        e = seed_estimate(mine, method, metric, pair)
        if not e.n:
            return not_run
        ok = OPS[spec["op"]][0](e.mean, spec["target"])
        ours = f"{who}: {_est(e)}"
        return result(ours, bool(ok), _seed_note(e), e.mean, e.lo, e.hi, spec["target"], e.cells, detectable(e))

    if kind == "falls_over_sweeps":
        rows = curves if curves is not None else fin
        first = seed_estimate(rows[rows["sweep"] == 1], method, metric, pair)
        last = seed_estimate(fin, method, metric, pair)
        change = paired_change(rows[rows["sweep"] == 1], fin, method, metric, pair)
        if not first.n or not last.n or not change.n:
            return not_run
        note = _seed_note(change)
        ours = (
            f"{method} K={pair[0]} L={pair[1]}: sweep 1 {_est(first)} → sweep {pair[0]} {_est(last)}; "
            f"change {_est(change)}"
        )
        ok = change.hi < 0
        return result(ours, ok, note, last.mean, last.lo, last.hi, first.mean, last.cells, detectable(change))

    if kind in ("above", "below", "at_least", "equivalent"):
        other = spec["other"]
        other_pair = tuple(spec.get("other_pair", pair))
        a, b = seed_estimate(mine, method, metric, pair), seed_estimate(fin, other, metric, other_pair)
        if not a.n or not b.n:
            return not_run
        note = _seed_note(a, b)
        d = difference(a, b)
        if kind == "above":
            ok = d.lo > 0
        elif kind == "below":
            ok = d.hi < 0
        elif kind == "at_least":
            ok = a.mean >= b.mean
        else:
            ok = equivalent(d, spec["margin"])
        if other_pair != pair or at_sweep is not None:
            ours = f"{who} {_est(a)} vs {other} K={other_pair[0]} L={other_pair[1]} {_est(b)}"
        else:
            ours = f"K={pair[0]} L={pair[1]}: {method} {_est(a)} vs {other} {_est(b)}"
        if kind != "at_least":
            ours += f"; difference {_est(d)}"
        ref = {"method": other, "value": b.mean, "lo": b.lo, "hi": b.hi, "difference": [d.mean, d.lo, d.hi]}
        return result(ours, ok, note, a.mean, a.lo, a.hi, ref, a.cells + b.cells, detectable(d))

    if kind == "above_metric":
        # several metrics of one method's cells against another metric of the same cells
        other_metric = spec["other_metric"]
        ests = {m: seed_estimate(fin, method, m, pair) for m in spec["metrics"]}
        diffs = {m: paired_change(fin, fin, method, other_metric, pair, after_metric=m) for m in spec["metrics"]}
        other = seed_estimate(fin, method, other_metric, pair)
        if not other.n or any(not e.n for e in (*ests.values(), *diffs.values())):
            return not_run
        note = _seed_note(other, *diffs.values())
        ok = all(d.lo > 0 for d in diffs.values())
        ours = f"{who}: {other_metric} {_est(other)}; " + "; ".join(
            f"{m} {_est(ests[m])}, difference {_est(diffs[m])}" for m in spec["metrics"]
        )
        cells = tuple(c for e in ests.values() for c in e.cells)
        return result(
            ours,
            ok,
            note,
            [ests[m].mean for m in spec["metrics"]],
            [ests[m].lo for m in spec["metrics"]],
            [ests[m].hi for m in spec["metrics"]],
            {"metric": other_metric, "value": other.mean, "lo": other.lo, "hi": other.hi},
            cells,
            _largest(detectable(d) for d in diffs.values()),
        )

    if kind == "converges_within":
        # Per seed: the dataset-mean curve over sweeps, its plateau (the mean of the last
        # sweeps) and the first sweep whose value comes within the tolerance of it.
        rows = curves if curves is not None and "sweep" in curves else fin.iloc[:0]
        if "test_set" not in spec and "test_set" in rows and "test_set" in fin and len(fin):
            rows = rows[rows["test_set"] == fin["test_set"].iloc[0]]
        rows = _rows(rows, method, metric, pair).reset_index()
        if rows.empty:
            return not_run
        firsts = {}
        for cell_id, cell_rows in rows.groupby("cell_id"):
            curve = cell_rows.groupby("sweep")["value"].mean().sort_index()
            level = curve.iloc[-spec["plateau_sweeps"] :].mean()
            reached = curve.index[curve.to_numpy() >= level - spec["tolerance"]]
            firsts[cell_id] = (int(cell_rows["seed"].iloc[0]), float(reached[0]))
        per_seed = pd.Series({seed: k for seed, k in firsts.values()}, dtype=float)
        e = seed_interval(per_seed.to_numpy(), tuple(sorted(firsts)))
        ours = f"{who}: first sweep within {spec['tolerance']} of the plateau {_est(e)} (per seed: " + ", ".join(
            f"{int(k)}" for k in per_seed.sort_index()
        ) + ")"
        ok = e.hi <= spec["sweeps"]
        return result(ours, bool(ok), _seed_note(e), e.mean, e.lo, e.hi, spec["sweeps"], e.cells, detectable(e))

    if kind == "increasing":
        pairs = [tuple(p) for p in spec["pairs"]]
        ests = [seed_estimate(fin, method, metric, p) for p in pairs]
        if any(not e.n for e in ests):
            return not_run
        steps = [paired_change(fin, fin, method, metric, p, q) for p, q in zip(pairs, pairs[1:], strict=False)]
        if any(not c.n for c in steps):
            return not_run
        note = _seed_note(*ests, *steps)
        # A metric already at its ceiling at the smallest K has no room to rise: not a test,
        # unless it falls (a change's interval below 0 fails the claim wherever it starts).
        near = "ceiling" in spec and ests[0].mean >= spec["ceiling"] - spec["ceiling_margin"]
        if not note and near and not any(c.hi < 0 for c in steps):
            note = AT_CEILING
        ok = all(c.lo > 0 for c in steps)
        ours = f"{method}: " + "; ".join(f"K={k}: {_est(e)}" for (k, _), e in zip(pairs, ests, strict=True))
        ours += "; changes " + "; ".join(
            f"{p[0]}→{q[0]}: {_est(c)}" for p, q, c in zip(pairs, pairs[1:], steps, strict=False)
        )
        cells = tuple(c for e in ests for c in e.cells)
        return result(
            ours,
            ok,
            note,
            [e.mean for e in ests],
            [e.lo for e in ests],
            [e.hi for e in ests],
            "increasing",
            cells,
            _largest(detectable(c) for c in steps),
        )

    # budget_above: Figure 2 from cells retrained at each (K, L = total // K)
    ests = retrained_estimates(retrained, method, metric)
    if len(ests) < 2:
        return not_run
    pairs = sorted(ests)
    low, high = ests[pairs[0]], ests[pairs[-1]]
    note = _seed_note(low, high)
    d = difference(high, low)
    ok = d.lo > 0
    ours = f"{method} retrained, {label}: " + "; ".join(
        f"K={k} L={l}: {_est(ests[(k, l)])}" for k, l in pairs
    )
    ours += f"; difference K={pairs[-1][0]} − K={pairs[0][0]}: {_est(d)}"
    cells = tuple(c for e in ests.values() for c in e.cells)
    return result(
        ours,
        ok,
        note,
        [ests[p].mean for p in pairs],
        [ests[p].lo for p in pairs],
        [ests[p].hi for p in pairs],
        "increasing in K",
        cells,
        detectable(d),
    )


def task_claims(task: str, results: dict[str, Any], paper: dict[str, Any] | None) -> list[ClaimResult]:
    """Every claim of ``paper["claims"]`` checked on one task's evaluation rows (``load_results``)."""
    meta, everything = results["meta"], results["metrics"]
    all_sets = main_rows(everything, meta)
    frame = primary_test_set(all_sets, meta)
    retrained = retrained_rows(primary_test_set(everything, meta), meta)
    return [
        check_claim(spec, task, finals(frame), finals(retrained), all_sets)
        for spec in (paper or {}).get("claims") or []
    ]


def claims_not_run(task: str, specs: list[dict[str, Any]], why: str) -> list[ClaimResult]:
    """Claims of a task this run has no results for, listed so the table shows what was not checked."""
    blank = {"passed": None, "note": "not run", "value": None, "lo": None, "hi": None, "target_value": None}
    return [
        ClaimResult(task, s["id"], s["claim"], s.get("section", ""), why, claim_target(s), cells=(), **blank)
        for s in specs
    ]


def verdict(r: ClaimResult) -> str:
    if r.note:  # no verdict, and why: not run, too few seeds, at the ceiling
        return r.note
    return {True: "✓", False: "✗", None: "–"}[r.passed]


def claims_markdown(
    results: list[ClaimResult],
    flags: dict[str, str],
    unclaimed: list[str],
    replication: dict[str, ClaimResult] | None = None,
) -> str:
    """The claims table with its verdict rules; a claim whose numbers come from a cell that
    has not plateaued carries that cell's mark. ``replication``: the same claims checked on
    the recorded second run (``{task/id: result}``), shown as a last column."""
    header = ["task", "claim (paper section)", "ours (95% interval over seeds)", "target", "detectable", "✓/✗"]
    if replication is not None:
        header.append(f"✓/✗ [`{REPLICATION}`](recorded/{REPLICATION}/README.md)")
    rows = [header, ["---"] * len(header)]
    marks = ""
    for r in results:
        flag = row_flag(r.cells, flags)
        marks += flag
        section = f" ({r.section})" if r.section else ""
        smallest = number(r.detectable) if math.isfinite(r.detectable) else "n/a"
        row = [r.task, f"{r.claim}{section}", _flagged(r.ours, flag), r.target, smallest, verdict(r)]
        if replication is not None:
            other = replication.get(f"{r.task}/{r.id}")
            row.append(verdict(other) if other is not None else "not run")
        rows.append(row)
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", f"Verdict rules: {VERDICT_RULES}"]
    if replication is not None:
        lines += ["", REPLICATION_NOTE]
    if marks:
        lines += ["", flag_notes(marks)]
    if unclaimed:
        lines += ["", f"No claims defined yet for: {', '.join(unclaimed)}."]
    return "\n".join(lines)


def claims_json(results: list[ClaimResult]) -> dict[str, Any]:
    """``{task/id: {value, lo, hi, target, pass}}`` for metrics.json (NaN as null)."""

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        if isinstance(v, (float, np.floating)):
            return float(v) if math.isfinite(v) else None
        return v

    return {
        f"{r.task}/{r.id}": {
            "value": clean(r.value),
            "lo": clean(r.lo),
            "hi": clean(r.hi),
            "target": clean(r.target_value),
            "pass": r.passed,
            "note": r.note,  # why there is no verdict: not run, too few seeds, at the ceiling
            "detectable": clean(r.detectable),
        }
        for r in results
    }


# --------------------------------------------------------------------------- figures


def mean_std(frame: pd.DataFrame, by: list[str], spread: str = "std") -> pd.DataFrame:
    """Mean and ``spread`` (``std``, or ``sem`` for the standard error) of ``value`` per group."""
    return frame.groupby(by)["value"].agg(["mean", spread]).fillna(0.0).reset_index()


def budget_figure(
    frame: pd.DataFrame, retrained: pd.DataFrame, meta: dict[str, Any], caption: str, path: Path
) -> bool:
    """Figure 2: final log joint and ESS/L versus K at K*L fixed. Solid: cells retrained at
    each (K, L = total // K), each evaluated at its own pair; dashed: each method's main
    cells at the test-time budget pairs (one model, as the paper did). Shaded: std over
    seeds x datasets."""
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
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, CURVE_METRICS, strict=False):
        for part, style, what in (
            (own, "-", "retrained per budget"),
            (test_time, "--", "one model, test-time budgets"),
        ):
            stats = mean_std(part[part["metric"] == metric], ["method", "K"])
            for method, group in stats.groupby("method"):
                ax.plot(
                    group["K"],
                    group["mean"],
                    marker="o",
                    ls=style,
                    color=colors[method],
                    label=f"{method}: {what}",
                )
                ax.fill_between(
                    group["K"],
                    group["mean"] - group["std"],
                    group["mean"] + group["std"],
                    alpha=0.15,
                    color=colors[method],
                )
        ax.set_xscale("log")
        ks = sorted(set(test_time["K"]) | set(own["K"]))
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("K sweeps (L = total // K)")
        ax.set_ylabel("log p(x, z)" if metric == "log_joint" else "ESS / L")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Fixed budget K*L = {total} (Figure 2)" if total else "Fixed budget K*L (Figure 2)")
    _save(fig, path, caption)
    return True


def sweep_curves(ax, stats: pd.DataFrame, colors: dict[str, Any], at_once: str) -> None:
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
            group["sweep"], group["mean"] - group["sem"], group["mean"] + group["sem"], alpha=0.2, color=colors[method]
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
        sweep_curves(ax, stats, colors, f"{k_max * l_at} particles")
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
    "pos_err": ("position error (px)", "Position error against the true digits versus sweeps, per held-out set ("),
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
                yerr=group["std"],
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
        if len(values) and np.isfinite(values).any():
            lo, hi = float(values.min()), float(values.max())
            pad = 0.05 * (hi - lo) or 1.0
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


ANIMATION_FRAMES = "animation.npz"


def animation(
    task: str, samples: dict[str, np.ndarray], meta: dict[str, Any], root: Path, path: Path,
    frames_file: Path | None = None,
) -> bool:
    """A GIF of the last APG sweep's sample on the first figure set (tasks with ``animate``).

    Drawn with the pictured cell's generative model, whose frames are then kept in
    ``frames_file``; a report rebuilt from committed rows (no checkpoints) reads them back."""
    spec = get_task(task)
    if spec.animate is None or not meta["samples"]:
        return False
    entry = max(meta["samples"], key=lambda e: (len(e["sweeps"]), -e["seed"]))
    cell = next(c for c in meta["cells"] if c["cell_id"] == entry["cell_id"])
    if frames_file is not None and not (root / cell["checkpoint"]).is_file():
        if not frames_file.is_file():
            return False
        with np.load(frames_file) as archive:
            write_gif(path, list(archive["frames"]), 200)
        return True
    import torch

    from apg.checkpoint import load_checkpoint
    from apg.training import TrainConfig

    # The generative model alone draws the frames (a recorded run may keep no proposals).
    config, state = load_checkpoint(root / cell["checkpoint"])
    model = spec.build_model(**TrainConfig.from_dict(config).model)
    model.load_state_dict(state["model"])
    model.eval()
    sweep = max(entry["sweeps"])
    prefix = f"{entry['cell_id']}__{entry['figure_set']}__sweep{sweep}__"
    z = {k[len(prefix) :]: torch.from_numpy(v[0]) for k, v in samples.items() if k.startswith(prefix)}
    x = torch.from_numpy(samples[f"x__{entry['figure_set']}"][0]).to(torch.get_default_dtype())
    if f"truth__{entry['figure_set']}__z_where" in samples:
        z["true_where"] = torch.from_numpy(samples[f"truth__{entry['figure_set']}__z_where"][0])
    frames = np.asarray(spec.animate(model, x, z))
    write_gif(path, list(frames), 200)
    if frames_file is not None:
        frames_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(frames_file, lambda tmp: _write_frames(tmp, frames))
    return True


def _write_frames(tmp: Path, frames: np.ndarray) -> None:
    with open(tmp, "wb") as f:  # a file object: numpy would append ".npz" to the temporary name
        np.savez_compressed(f, frames=frames)


def _save(fig, path: Path, caption: str) -> None:
    fig.text(0.5, 0.005, caption, ha="center", va="bottom", fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    atomic_write(path, lambda tmp: fig.savefig(tmp, format=path.suffix.lstrip("."), dpi=110))
    plt.close(fig)


# --------------------------------------------------------------------------- swept axes

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
            rows.append((cell["base_method"], cell["K"], cell["L"], value, metric, cell["seed"], cid,
                         float(part["value"].mean())))
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
            ax.errorbar(part["x"], part["mean"], yerr=None if np.isnan(err).all() else err, marker="o",
                        capsize=3, label=f"{method} K={k} L={l}")
        if numeric and min(values) > 0 and max(values) / min(values) >= 8:
            ax.set_xscale("log")
        ax.set_xticks([position[v] for v in values], [str(v) for v in values])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel(key)
        ax.set_ylabel(f"{AXIS_LABELS.get(metric, _label(metric, None))}, held-out")
    axes[0, 0].legend(fontsize=7)
    _save(fig, path, caption)


def axes_markdown(frame: pd.DataFrame, meta: dict[str, Any], caption: str, out: Path, task: str, fmt: str) -> str:
    """Per swept key: a figure of each metric against the key's values and a table (with
    the cells each point averages); '' when no key has two values for one method."""
    parts = []
    for key in meta.get("axes", []):
        est = axis_estimates(frame, meta, key)
        if est.empty:
            continue
        stem = f"{task}_axis_{key.replace('.', '_')}"
        axis_figure(est, key, caption, out / "figures" / f"{stem}.{fmt}")
        atomic_write(out / "tables" / f"{stem}.csv", lambda tmp, est=est: est.to_csv(tmp, index=False))
        metrics = [m for m in AXIS_METRICS if m in set(est["metric"])]
        wide = est.pivot_table(index=["method", "K", "L", "value"], columns="metric", values="mean", aggfunc="first")
        seeds = est.groupby(["method", "K", "L", "value"])["seeds"].max()
        lines = [
            f"#### `{key}` ([csv](tables/{stem}.csv))",
            "",
            f"![{task} {key}](figures/{stem}.{fmt})",
            "",
            f"| method | K | L | {key} | " + " | ".join(AXIS_LABELS.get(m, _label(m, None)) for m in metrics)
            + " | seeds |",
            "| --- | --- | --- | --- | " + " | ".join("---" for _ in metrics) + " | --- |",
        ]
        for (method, k, l, value), row in wide.iterrows():
            numbers = " | ".join(number(row.get(m)) for m in metrics)
            lines.append(f"| {method} | {k} | {l} | {value} | {numbers} | {seeds[(method, k, l, value)]} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


# --------------------------------------------------------------------------- the stage


def report_task(
    task: str,
    results: dict[str, Any],
    paper: dict[str, Any] | None,
    out: Path,
    root: Path,
    label: str,
    fmt: str,
    keep_frames: bool = False,
) -> dict[str, Any]:
    """One task's tables, figures and claims; ``keep_frames``: keep the GIF's frames with the
    committed rows (the default run's report, whose checkpoints a clone does not have)."""
    meta, everything = results["meta"], results["metrics"]
    all_sets = main_rows(everything, meta)
    frame = primary_test_set(all_sets, meta)
    retrained = retrained_rows(primary_test_set(everything, meta), meta)
    caption = scale_caption(meta, label)
    tables, figures = out / "tables", out / "figures"
    training = training_table(results["training"], meta)
    flags = cell_flags(training)
    atomic_write(tables / f"{task}_training.csv", lambda tmp: training.to_csv(tmp, index=False))
    training_md = training_markdown(training)
    if (paper or {}).get("stalled_margin") is not None:
        stalled = stalled_seeds(training, paper["stalled_margin"])
        atomic_write(tables / f"{task}_stalled.csv", lambda tmp: stalled.to_csv(tmp, index=False))
        if not stalled.empty:
            training_md += "\n\n" + stalled_markdown(stalled, paper["stalled_margin"])
    atomic_write(tables / f"{task}_training.md", lambda tmp: tmp.write_text(training_md + "\n"))
    table = with_flags(table1(frame, meta, paper), frame, ["method", "K", "L"], flags)
    atomic_write(tables / f"{task}_table1.csv", lambda tmp: table.to_csv(tmp, index=False))
    md = table_markdown(table, {**(paper or {}).get("block_labels", {}), **(paper or {}).get("metric_labels", {})})
    atomic_write(tables / f"{task}_table1.md", lambda tmp: tmp.write_text(md + "\n"))
    methods = comparison_table(frame, meta)
    methods = methods.assign(flag=[row_flag(ids.split(), flags) for ids in methods["cells"]])
    atomic_write(tables / f"{task}_methods.csv", lambda tmp: methods.to_csv(tmp, index=False))
    methods_md = comparison_markdown(methods)
    atomic_write(tables / f"{task}_methods.md", lambda tmp: tmp.write_text(methods_md + "\n"))
    mse = set_table(all_sets, meta)
    mse_md = ""
    if not mse.empty:
        mse = with_flags(mse, all_sets.assign(test_set=all_sets.get("test_set", "test")), MSE_KEYS, flags)
        atomic_write(tables / f"{task}_mse.csv", lambda tmp: mse.to_csv(tmp, index=False))
        mse_md = "\n".join(
            ["| test set | method | K | L | MSE |", "| --- | --- | --- | --- | --- |"]
            + [
                f"| {r.test_set} | {_flagged(r.method, r.flag)} | {r.K} | {r.L} | {pm(r.mean, r.std)} |"
                for r in mse.itertuples(index=False)
            ]
        ) + _footnote(mse)
    tracking_md = tracking_markdown(all_sets, meta, flags, tables / f"{task}_tracking.csv")
    axes_md = axes_markdown(frame, meta, caption, out, task, fmt)
    claims = task_claims(task, results, paper)
    made = {}
    for name, ok in (
        *(
            (metric, set_curve_figure(all_sets, meta, caption, figures / f"{task}_{metric}.{fmt}", metric))
            for metric in SET_CURVES
        ),
        ("compute", compute_figure(all_sets, meta, caption, figures / f"{task}_compute.{fmt}")),
        (
            "methods_sweeps",
            methods_sweeps_figure(frame, meta, caption, figures / f"{task}_methods_sweeps.{fmt}"),
        ),
        (
            "kl",
            kl_figure(frame, meta, caption, figures / f"{task}_kl.{fmt}", (paper or {}).get("block_labels")),
        ),
        ("budget", budget_figure(frame, retrained, meta, caption, figures / f"{task}_budget.{fmt}")),
        ("sweeps", sweeps_figure(frame, meta, caption, figures / f"{task}_sweeps.{fmt}")),
        (
            "training",
            training_figure(results["training"], training, caption, figures / f"{task}_training.{fmt}"),
        ),
        (
            "samples",
            samples_figure(task, results["samples"], meta, caption, figures / f"{task}_samples.{fmt}"),
        ),
        (
            "animation",
            animation(
                task, results["samples"], meta, root, figures / f"{task}_samples.gif",
                out / COMMITTED_DATA / task / ANIMATION_FRAMES if keep_frames else None,
            ),
        ),
    ):
        if ok:
            made[name] = f"figures/{task}_{'samples.gif' if name == 'animation' else f'{name}.{fmt}'}"
    imputation = report_imputation(
        task, results.get("imputation"), out, fmt, lambda fig, path: _save(fig, path, caption)
    )
    if imputation is not None:
        made.update(imputation["figures"])
    headline = {
        f"{row.method}/K{row.K}/L{row.L}": {
            m: float(getattr(row, m))
            for m in ("log_joint", "d_log_joint", "ess", "ari", "ari_ceiling")
            if m in table and np.isfinite(getattr(row, m))
        }
        for row in table.itertuples(index=False)
    }
    for metric in ("mse", "pos_err", "tracked"):
        for r in (mse if metric == "mse" else set_table(all_sets, meta, metric)).itertuples(index=False):
            if np.isfinite(r.mean):
                headline.setdefault(f"{r.method}/K{r.K}/L{r.L}", {})[f"{metric}_{r.test_set}"] = float(r.mean)
    for key, values in (imputation or {}).get("headline", {}).items():
        headline.setdefault(key, {}).update(values)
    sets = meta.get("test_sets") or []
    return {
        "task": task,
        "imputation_md": (imputation or {}).get("md", ""),
        "imputation_set": (meta.get("imputation") or {}).get("test_set"),
        "caption": caption,
        "table_md": md,
        "methods_md": methods_md,
        "figures": made,
        "metrics": headline,
        "paper": paper,
        "mse_md": mse_md,
        "tracking_md": tracking_md,
        "axes_md": axes_md,
        "training_md": training_md,
        "cell_flags": flags,
        "claims": claims,
        "cells": meta["cells"],
        "primary": sets[0]["name"] if len(sets) > 1 else None,
    }


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


def tracking_markdown(frame: pd.DataFrame, meta: dict[str, Any], flags: dict[str, str], csv: Path) -> str:
    """The tracking table (Bouncing MNIST): final-sweep position error (at the digits' ink
    centres), tracked-frame fraction, the boxes' error and the motion error per (test
    set, method, K, L), written to ``csv``; "" when the task has no position truth."""
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
    atomic_write(csv, lambda tmp: table.to_csv(tmp, index=False))
    rows = [
        f"| {r.test_set} | {_flagged(r.method, r.flag)} | {r.K} | {r.L} | "
        + " | ".join(pm(getattr(r, f"mean_{m}"), getattr(r, f"std_{m}")) for m in columns)
        + " |"
        for r in table.itertuples(index=False)
    ]
    head = [
        "| test set | method | K | L | " + " | ".join(columns.values()) + " |",
        "| --- | --- | --- | --- | " + " | ".join("---" for _ in columns) + " |",
    ]
    notes = " ".join(TRACKING_NOTES[m] for m in columns if m in TRACKING_NOTES)
    return "\n".join(head + rows) + _footnote(table) + (f"\n\n{notes}" if notes else "")


FIGURE_TEXT = {
    "mse": "Figure 4: reconstruction MSE per pixel between held-out frames and the reconstructions of the weighted particles, versus sweep, one line per held-out set (e.g. per (T, D)); error bars: std over seeds x videos.",
    "pos_err": "Position error of the highest-weight particle against the simulator's digits (pixels between the centres of the inferred and the true digits' ink, best matching of digits per video), versus sweep, one line per held-out set; error bars: std over seeds x videos.",
    "tracked": "Fraction of frames whose every digit is within 3 px of its true position (highest-weight particle), versus sweep, one line per held-out set; error bars: std over seeds x videos.",
    "compute": "Reconstruction MSE per pixel versus compute, per held-out set. Compute: likelihood evaluations per dataset, in units of one evaluation of log p(x | z) over the whole dataset for one particle (for a video: all T frames; a gradient counts 2, a block's Markov blanket its share of the data; the proposal networks' own cost is not counted). APG: L (1 + 4 (k - 1)) after sweep k (every block's blanket before and after its update), drawn as a line over its sweeps; RWS: K*L (one encoder pass); AVF: K*L (1 + 4 n) for n inference iterations per frame and for the codes. Error bars: std over seeds x videos.",
    "methods_sweeps": "Held-out log joint versus sweep for every method at each test-time budget (K, L): APG, exact population Gibbs (gibbs), bootstrapped Gibbs, HMC-RWS (K-1 HMC transitions), and the one-step methods (RWS, reparam: K*L particles at once) as dashed levels; shaded: standard error of the mean over seeds x datasets (the same held-out datasets for every method; their spread is in Table 1).",
    "kl": "Inclusive KL (eq. 4) of each method's block kernels to the exact Gibbs conditionals, per block, using the final particles of each test-time budget as samples of the other blocks (4 exact draws each); gibbs uses the exact kernels (0 by construction) and gibbs-bootstrap the prior for the global block. Error bars: std over seeds x datasets.",
    "budget": "Figure 2: log joint and ESS/L of the final sweep versus K at a fixed budget K*L. Solid: APG retrained at each (K, L = total // K) and evaluated at that same (K, L); dashed: each method's main cell (trained at its grid pair) run at the test-time budgets, one model for every K, as the paper did. Shaded: std over seeds x datasets.",
    "sweeps": "Log joint and ESS/L versus sweep at the largest evaluation budget; RWS (one step with K*L particles) as a dashed level; shaded: standard error of the mean over seeds x datasets (their spread is in Table 1).",
    "training": "Training log joint of every cell (last sweep of each training batch; rolling mean over 1/50 of the logged points), one panel per method, one thin line per seed, coloured by the (K, L) it was trained at. Shaded: the last fifth of training, where the plateau test of the training table fits its trend; † / ‡ at a curve's end: not plateaued / not assessable.",
    "samples": "Figure 1/3 style: each method's highest-weight sample after k sweeps, on held-out datasets of different sizes (the task's draw hook: for videos, frames with the inferred digit boxes).",
    "animation": "Animated sample (the task's animate hook): for videos, each frame | its reconstruction, with the inferred boxes.",
    **IMPUTATION_FIGURE_TEXT,
}


def index_markdown(parts: list[dict[str, Any]], label: str, claims_md: str, recorded_md: str = "") -> str:
    lines = [
        "# Reproduction report",
        "",
        f"**Scale: {label}.** Generated by `dvc repro` (stage `report`) from recorded results in "
        "`results/eval/`; do not edit by hand. Paper: Wu et al., *Amortized Population Gibbs "
        "Samplers with Neural Sufficient Statistics* (arXiv 1911.01382). Our numbers come from far "
        "shorter training than the paper's and are not expected to match them; the paper's numbers "
        "are shown beside ours (`paper` columns), never in place of them. Each task's section "
        "states the iterations, datasets and seeds its numbers were made with.",
        "",
        "## Claims of the paper, checked",
        "",
        "Computed by the report stage from the evaluation metrics (claim definitions: "
        "`pipeline/paper_numbers.yaml`, `claims`); ✓ holds, ✗ does not, – no verdict.",
        "",
        claims_md,
        "",
        "## Where the settings come from",
        "",
        "Every setting is `params.yaml`'s; its comments say how each was chosen (the learning-rate "
        "schedules were measured per task). `apg-pipeline tune --task <task>` searches a task's "
        "training settings (`tune.yaml`) with `params.yaml`'s own as its first trial; each search's "
        "report, in [tune/](tune/), says whether the best beat them.",
        "",
        *([recorded_md] if recorded_md else []),
    ]
    return "\n".join(lines + task_sections(parts))


def task_sections(parts: list[dict[str, Any]]) -> list[str]:
    """Each task's tables and figures (links relative to the report holding them)."""
    lines: list[str] = []
    for part in parts:
        task = part["task"]
        lines += [f"## {task}", "", part["caption"] + ".", ""]
        if part.get("primary"):
            lines += [
                f"Tables and the sweep/budget figures use the first held-out set, `{part['primary']}`; "
                "Figure 4 and the MSE table cover every set.",
                "",
            ]
        if (part["paper"] or {}).get("scale"):
            lines += [f"Paper scale: {part['paper']['scale']}.", ""]
        lines += [
            f"### Table 1 ([csv](tables/{task}_table1.csv))",
            "",
            "Mean ± std over seeds and held-out datasets at each test-time budget (K, L); `paper`: the "
            "paper's value for the column to its left (Table 1), where it reports one. Δ log p(x,z): "
            "paired difference (same dataset) to the baseline method at the same budget; ESS/L: eq. 11; "
            "`ess`/`kl` per block: ESS/L after the block update and inclusive KL (eq. 4); numbered "
            "blocks (one per video frame) are averaged over t. ARI: adjusted Rand index of the "
            "highest-weight particle's assignments c against the true c (1: the true clustering up to "
            "relabeling, 0: chance); blank for a method whose particles carry no c. ARI ceiling: the "
            "ARI of argmax_i p(c_n = i | x_n, true mu, true tau), the best any sampler can do, the same "
            "for every row (GMM only). RWS rows "
            "spend K*L particles in one step. Rows average the cells trained at each method's grid "
            "pair (Figure 2's retrained cells appear only there). The CSV has every column unrounded.",
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
        if part.get("training_md"):
            lines += [
                f"### Training: has every cell plateaued? ([csv](tables/{task}_training.csv))",
                "",
                "Per cell, over the last fifth of its training iterations: the mean training log joint "
                "(`final`), the change Δ an ordinary least-squares line through the logged values makes "
                "across that window, its standard error, and z = Δ / se(Δ); the same for the training "
                "ESS/L (the proposals' objective, an inclusive KL, shows there after the log joint is "
                "flat). A cell has plateaued when "
                f"|z| < {PLATEAU_Z:g} for both; with fewer than {PLATEAU_MIN_POINTS} logged points in the window "
                "it is not assessable. Rows elsewhere whose numbers come from a cell that has not "
                f"plateaued carry {NOT_PLATEAUED} (not assessable: {NOT_ASSESSABLE}). Where the rate "
                "still falls in that window, the curves rise with it (less gradient noise) whether or "
                "not more steps would help; where the schedule holds its floor rate there "
                "(`lr_hold_fraction: 0.2`, as params.yaml's do), a trend is one that more steps would "
                "extend.",
                "",
                part["training_md"],
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
        if part.get("tracking_md"):
            lines += [
                f"### Tracking against the simulator's positions ([csv](tables/{task}_tracking.csv))",
                "",
                "The highest-weight particle after the last sweep, per video: pixels between each "
                "inferred digit and its true digit after the best matching of digits (one "
                "permutation per video: a digit keeps its identity), averaged over frames and digits; "
                "and the fraction of frames whose every digit is within 3 px. Mean ± std over seeds x videos. "
                "A digit is where its ink is: the position error compares the centres of the ink "
                "(box corner plus the ink centre of the decoded template, against box corner plus "
                "the ink centre of the MNIST digit). The boxes' error compares box corners alone; it "
                "also counts where the learned decoder draws a digit inside its 28 x 28 box, which "
                "the data cannot pin down (a digit drawn 2 px to the right in a box 2 px to the "
                "left makes the same frame). Motion error: the position error after removing each "
                "digit's mean offset over its video.",
                "",
                part["tracking_md"],
                "",
            ]
        if part.get("imputation_md"):
            lines += [
                f"### Imputation of hidden entries ([csv](tables/{task}_imputation.csv))",
                "",
                "Missing data filled in by a Markov chain that alternates inference and generation "
                "(Rezende et al. 2014, Appendix F; `apg.imputation`): each cell infers the latents of "
                "the data with its hidden entries at their current values (its method at the budget "
                "K, L; exact Gibbs uses the exact conditionals), picks one particle by its weight, and "
                "redraws the hidden entries from p(x | z) (or sets them to its mean), from a start at "
                "the dataset's mean, on held-out set "
                f"`{part.get('imputation_set')}`. Numbers at the chain's last iteration, mean ± std over "
                "seeds x datasets. GMM: RMSE of the hidden coordinates, for the mean of the chain's "
                "draws (after burn-in), for the last draw alone, and for the Bayes predictor at the "
                "simulator's true parameters (the best possible on average, which no method knows). "
                "Bouncing MNIST: pixel MSE on the hidden pixels, and the position error and tracked "
                "fraction of the digits the chain's last inference places on the occluded frames.",
                "",
                part["imputation_md"],
                "",
            ]
        if part.get("axes_md"):
            lines += [
                "### Swept settings (grid entries' `axes`)",
                "",
                "Each point: the cells trained at one value of the key (the task's own cells at "
                "theirs), evaluated at their training pair on the first held-out set after the last "
                "sweep; mean over seeds of the per-seed mean over datasets, error bars the 95% "
                "interval over seeds (with 3 or more). In the tables above such cells are rows "
                "`method [key=value]`.",
                "",
                part["axes_md"],
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
    return lines


# The recorded second run of the defaults (``apg-pipeline record replicate``: other training
# seeds, ideally another CPU type): its verdicts stand beside the main run's.
REPLICATION = "replicate"
REPLICATION_NOTE = (
    f"The last column: the same claims on the recorded run `{REPLICATION}` (the defaults again, "
    "training seeds moved by 100; its machine is named in its report). The headline counts the "
    "claims that hold in both runs."
)


def replication_claims(
    root: Path, tasks: list[str], paper_all: dict[str, Any]
) -> dict[str, ClaimResult] | None:
    """``{task/id: result}`` of the main claims on the recorded replication, None without one."""
    run = root / "recorded" / REPLICATION
    if not run.is_dir():
        return None
    found: dict[str, ClaimResult] = {}
    for task in tasks:
        if (run / "eval" / task).is_dir():
            results = load_results(run / "eval" / task)
            found.update({f"{c.task}/{c.id}": c for c in task_claims(task, results, paper_all.get(task))})
    return found


# The evaluation rows the report reads, kept beside it (``reports/data/<task>/``) so that a
# clone rebuilds every table, figure and verdict without retraining (``--from-committed``).
COMMITTED_DATA = "data"
COMMITTED_FILES = ("meta.json", "metrics.parquet", "training.parquet", "imputation.parquet")
COMMITTED_ARRAYS = ("samples.npz", "imputation_examples.npz")  # deflated: most of a video is empty canvas
STAGE_TIMES = "stage_times.json"


def commit_rows(eval_dir: Path, data_dir: Path) -> None:
    """Copy one task's evaluation rows into the report's ``data/<task>/``; files the
    evaluation no longer writes are removed there."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for name in (*COMMITTED_FILES, *COMMITTED_ARRAYS):
        source, target = eval_dir / name, data_dir / name
        if not source.is_file():
            target.unlink(missing_ok=True)
        elif name in COMMITTED_ARRAYS:
            atomic_write(target, lambda tmp, source=source: compress_samples(source, tmp))
        else:
            atomic_write(target, lambda tmp, source=source: tmp.write_bytes(source.read_bytes()))


def make_report(params: dict[str, Any], root: Path, from_committed: bool = False) -> Path:
    """Write ``reports/`` from ``results/eval/<task>`` (keeping those rows in
    ``reports/data/``), or with ``from_committed`` from the rows kept there, by a clone
    that has trained nothing: the same tables, figures and verdicts, provenance untouched."""
    cfg = params.get("report", {})
    out = root / cfg.get("out", "reports")
    fmt = cfg.get("figure_format", "png")
    label = cfg.get("scale", "CPU-sized")
    paper_all = yaml.safe_load(PAPER_NUMBERS.read_text())
    sns.set_theme(style="whitegrid", context="paper")
    data = out / COMMITTED_DATA
    parts = []
    for task in params["tasks"]:
        eval_dir = data / task if from_committed else root / "results" / "eval" / task
        results = load_results(eval_dir)
        if not from_committed:
            commit_rows(eval_dir, data / task)
        parts.append(report_task(task, results, paper_all.get(task), out, root, label, fmt, keep_frames=True))
    claims = [c for p in parts for c in p["claims"]]
    for task, section in paper_all.items():
        if task not in params["tasks"] and (section or {}).get("claims"):
            claims += claims_not_run(task, section["claims"], "not run (task not in this run)")
    unclaimed = [t for t in params["tasks"] if not (paper_all.get(t) or {}).get("claims")]
    flags = {cid: mark for p in parts for cid, mark in p["cell_flags"].items()}
    replication = replication_claims(root, params["tasks"], paper_all)
    claims_md = claims_markdown(claims, flags, unclaimed, replication)
    text = index_markdown(parts, label, claims_md, recorded_markdown(root, out, paper_all, fmt))
    if from_committed:
        times = json.loads((data / STAGE_TIMES).read_text()) if (data / STAGE_TIMES).is_file() else {}
    else:
        times = stages.stage_times(root)
        atomic_write(data / STAGE_TIMES, lambda tmp: tmp.write_text(json.dumps(times, indent=2) + "\n"))
    lead = reused_cells_markdown(parts) + pipeline_time_markdown(times, params.get("sweep", {}).get("torch_threads"))
    text = text.replace("\n## Claims of the paper, checked", f"\n{lead}## Claims of the paper, checked", 1)
    atomic_write(out / "README.md", lambda tmp: tmp.write_text(text + "\n"))
    readme = root / "README.md"
    if readme.is_file() and RESULTS_START in readme.read_text():
        block = readme_results(claims, claims_md, times, label, out.relative_to(root).as_posix(), replication)
        write_readme_results(readme, block)
    metrics = {p["task"]: p["metrics"] for p in parts}
    metrics["claims"] = claims_json(claims)
    if replication is not None:
        metrics["replication_claims"] = claims_json(list(replication.values()))
    payload = json.dumps(metrics, indent=2, sort_keys=True)
    atomic_write(out / "metrics.json", lambda tmp: tmp.write_text(payload + "\n"))
    # What produced these results (code and params digests, commit): the CI check that
    # committed results are the checkout's own reads it (pipeline.provenance). A rebuild
    # from the committed rows trained and evaluated nothing: the record stays as it was.
    if not from_committed:
        provenance.write_record(params, root, out)
    return out


RESULTS_START, RESULTS_END = "<!-- results:start -->", "<!-- results:end -->"


# --------------------------------------------------------------------------- recorded runs


def recorded_markdown(root: Path, out: Path, paper_all: dict[str, Any], fmt: str) -> str:
    """Each recorded run (``apg-pipeline record``, results kept in ``recorded/``): its own
    report under ``reports/recorded/<name>/``, and here its Table 1 beside the paper's, labelled
    with its scale and the commit that trained it. Nothing is retrained."""
    runs = recorded_runs(root)
    if not runs:
        return ""
    lines = [
        "## Recorded runs at other scales",
        "",
        "Runs too long for `dvc repro` (`apg-pipeline record <profile>`, `pipeline/recorded.py`): "
        "their evaluation results and trained weights are kept in `recorded/` and this stage "
        "rebuilds their tables and figures from them. Each names the commit whose code trained it; "
        "`training code today` says whether the training code (the sweep stage's code digest) is "
        "still that code.",
        "",
    ]
    for run_dir, manifest in runs:
        sub = out / "recorded" / run_dir.name
        params = yaml.safe_load((run_dir / "params.yaml").read_text())
        label = manifest["scale"]
        parts, claims = [], []
        for task in params["tasks"]:
            paper = paper_all.get(task) or {}
            paper = {**paper, "claims": (paper.get("claims") or []) + (paper.get("paper_scale_claims") or [])}
            part = report_task(task, load_results(run_dir / "eval" / task), paper, sub, root, label, fmt)
            parts.append(part)
            # A run at another scale has other held-out sets and budgets: the claims it cannot
            # test (the CPU defaults' sets) are left out of its table, not listed as not run.
            claims += [c for c in part["claims"] if c.note != "not run"]
        flags = {cid: mark for p in parts for cid, mark in p["cell_flags"].items()}
        claims_md = claims_markdown(claims, flags, [])
        same = all(
            stages.code_digest("sweep", t, stages.package_root()) == d
            for t, d in manifest["code_digest"].items()
        )
        about = (
            f"Trained by commit `{manifest['commit']}` ({manifest.get('started', '?')} to "
            f"{manifest['finished']}, last run {manifest['wall_minutes_last_run']} min wall; "
            f"{manifest['machine']}). Training code today: {'the same' if same else '**changed since**'}. "
            f"Profile `{manifest['profile']}` of `{manifest['base']}`; its params: "
            f"[`recorded/{run_dir.name}/params.yaml`]({{up}}recorded/{run_dir.name}/params.yaml)."
        )
        partial = [
            c["name"] for part in parts for c in part.get("cells", []) if Path(c["checkpoint"]).name == GENERATIVE_ONLY
        ]
        if partial:  # weights too large for git: the proposals were left out
            about += (
                f" Not re-checkable from a clone: {len(partial)} of its cells ({', '.join(f'`{n}`' for n in partial)}) "
                "keep their generative model's weights alone (their proposals were over the size kept in git), "
                "so their numbers are those their evaluation recorded and cannot be recomputed."
            )
        start = manifest.get("starts_from")
        if start:  # a curriculum's later step: its training continues another run's
            about += (
                f" A curriculum's later step: every cell started from the weights of the same method, K, L "
                f"and seed in the recorded run [`{start['profile']}`]({{up}}reports/recorded/{start['profile']}/README.md) "
                f"(commit `{start['commit']}`; checkpoints' sha256 in the manifest), so its training is "
                f"on top of that run's."
            )
        body = [
            f"# Recorded run `{run_dir.name}`: {label}",
            "",
            about.replace("{up}", "../../../"),
            "",
            "## Claims of the paper, checked at this scale",
            "",
            claims_md,
            "",
            *task_sections(parts),
        ]
        page = "\n".join(body) + "\n"
        atomic_write(sub / "README.md", lambda tmp, page=page: tmp.write_text(page))
        lines += [
            f"### [`{run_dir.name}`](recorded/{run_dir.name}/README.md): {label}",
            "",
            about.replace("{up}", "../"),
            "",
        ]
        for part in parts:
            lines += [f"Table 1, {part['task']} ({part['caption']}):", "", part["table_md"], ""]
        held = [c for c in claims if c.passed is not None]
        verdicts = (
            f"{sum(bool(c.passed) for c in held)} of its {len(held)} claims with a verdict hold"
            if held
            else f"None of its {len(claims)} claims has a verdict (each rests on fewer than {MIN_SEEDS} seeds)"
        )
        lines += [f"{verdicts} ([its report](recorded/{run_dir.name}/README.md)).", ""]
    return "\n".join(lines)


def reused_cells_markdown(parts: list[dict[str, Any]]) -> str:
    """A bold warning naming cells trained by other code (``sweep.reuse_across_code``)."""
    names = [c["name"] for p in parts for c in p.get("cells", []) if c.get("trained_by_other_code")]
    if not names:
        return ""
    return (
        f"**Reused across code changes: {len(names)} cell(s) were trained by other code than this "
        f"report's ({', '.join(names)}; `sweep.reuse_across_code: true`). Their numbers are not "
        "this code's results.**\n\n"
    )


def pipeline_time_markdown(times: dict[str, float], threads: int | None = None) -> str:
    """Wall time of each stage when it last ran (``results/timings``), and the machine."""
    if not times:
        return ""
    rows = "\n".join(f"| `{name}` | {seconds / 60:.1f} |" for name, seconds in times.items())
    total = sum(times.values()) / 60
    per_trial = f"; {threads} torch thread{'s' if threads != 1 else ''} per trial" if threads else ""
    return (
        "## Time\n\nWall time of each stage when it last ran (2 trials at once on a 2-core machine "
        "unless the params say otherwise; after a partial `dvc repro`, the stages it skipped keep "
        "the times of the run that made their outputs):\n\n| stage | minutes |\n| --- | ---: |\n"
        f"{rows}\n| **sum** | **{total:.1f}** |\n\n"
        f"Machine that made this report (a from-scratch `dvc repro` trains and evaluates on the same "
        f"one; trained numbers differ across CPUs): {provenance.machine_line(provenance.machine())}"
        f"{per_trial}.\n\n"
    )


def verdict_count(claims: list[ClaimResult], replication: dict[str, ClaimResult] | None = None) -> str:
    """"k of the n claims with a verdict hold", or with a replication the claims that hold in
    both runs, out of those with a verdict in both."""
    if replication is None:
        judged = [c for c in claims if c.passed is not None]
        return f"{sum(bool(c.passed) for c in judged)} of the {len(judged)} claims with a verdict hold"
    pairs = [(c, replication.get(f"{c.task}/{c.id}")) for c in claims]
    both = [(c, o) for c, o in pairs if c.passed is not None and o is not None and o.passed is not None]
    held = sum(bool(c.passed) and bool(o.passed) for c, o in both)
    agree = sum(c.passed == o.passed for c, o in both)
    return (
        f"{held} of the {len(both)} claims with a verdict in both runs hold in both "
        f"(the two runs' verdicts agree on {agree} of them)"
    )


def readme_results(
    claims: list[Any], claims_md: str, times: dict[str, float], label: str, report_dir: str,
    replication: dict[str, ClaimResult] | None = None,
) -> str:
    """The project README's results section: what the main command gives, from this run."""
    total = sum(times.values()) / 60 if times else None
    took = (
        f" Its stages took {total:.0f} minutes in all (each stage's wall time when it last ran); the"
        if total is not None
        else " The"
    )
    claims_md = claims_md.replace("](tables/", f"]({report_dir}/tables/").replace("](recorded/", f"]({report_dir}/recorded/")
    return (
        f"Written by the report stage of the run that made the committed [`{report_dir}/`]"
        f"({report_dir}/README.md) ({label}).{took} report has "
        f"the per-stage times, every table and figure, and each cell's training curve and plateau "
        f"check. {verdict_count(claims, replication)}:\n\n{claims_md}\n"
    )


def write_readme_results(readme: Path, block: str) -> None:
    text = readme.read_text()
    start, end = text.index(RESULTS_START), text.index(RESULTS_END)
    new = text[: start + len(RESULTS_START)] + "\n" + block + text[end:]
    atomic_write(readme, lambda tmp: tmp.write_text(new))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="apg-pipeline report", description="regenerate reports/ from recorded results")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument(
        "--from-committed",
        action="store_true",
        help="rebuild from the evaluation rows kept in reports/data/ (a clone: nothing trained or evaluated)",
    )
    args = parser.parse_args(argv)
    from pipeline.cli import run_guarded

    def work() -> None:
        out = make_report(load_params(args.params), project_root(), from_committed=args.from_committed)
        print(f"wrote {out}/README.md")

    run_guarded(work)


if __name__ == "__main__":
    main()
