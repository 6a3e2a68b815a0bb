"""Has every cell finished learning: the plateau test of each training curve, the marks
(† ‡) it puts on every number a cell feeds, and the count of seeds that stalled."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from pipeline.present import markdown_table, number
from pipeline.report import exact

# A cell has plateaued when neither its training log joint nor its training ESS/L over the
# last fifth of its iterations shows a trend larger than 3 standard errors; fewer than 5
# logged points there cannot tell a trend from noise.
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
        # Correctly rounded sums (``exact.dot``), not BLAS's: its summation order, so the
        # last bit of these columns, depends on the CPU that rebuilds the report.
        sxx = exact.dot(dt, dt)
        slope = exact.dot(dt, v - v.mean()) / sxx
        resid = v - v.mean() - slope * dt
        se_slope = math.sqrt(exact.dot(resid, resid) / (n - 2) / sxx)
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
    rows = []
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
    return markdown_table(header, rows)


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
