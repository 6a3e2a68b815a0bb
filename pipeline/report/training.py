"""Has every cell finished learning: the plateau test of each training curve, pooled over
the seeds of each configuration, the marks († ‡) it puts on every number a cell feeds, and
the count of seeds that stalled.

The rule. A curve's trend is the ordinary least-squares slope through its logged values over
the last fifth of its training (``plateau``). A cell is tested on its own, and the cells of one
configuration (same task, method, K, L, swept settings and iterations: cells that differ only
by seed) are tested together (``pooled_plateau``): one slope common to the seeds, one intercept
per seed, over every seed's window, its standard error from the pooled residuals. A cell is
not plateaued (``†``) when its own trend or its configuration's pooled trend, of the training
log joint or of ESS/L, is more than ``PLATEAU_Z`` standard errors from zero; not assessable
(``‡``) when its own window holds fewer than ``PLATEAU_MIN_POINTS`` points.

Why pooled, and why this pooling. The logged values are single training batches, so a cell's
window of 18 points (the rings' default) has a standard error of 60-190 nats for the window's
change: a rise of 100 nats a window, still seen on average over the rings' seeds, passes a
cell's own test nearly always. The seeds of a configuration share that rise, so their windows
are pooled. The batches are independent draws around each seed's curve; the seeds differ in
level (the intercepts take it out) and in noise. With windows on the same iterations the
common slope is the plain mean of the seeds' slopes, and the pooled residual variance
estimates the mean of the seeds' noise variances, which is what that mean slope's variance
needs, so different noise levels leave the standard error right. The alternative, the mean of
per-seed slopes against their spread over seeds (Welch-style), estimates the same noise from
S slopes instead of N residuals, on S - 1 degrees of freedom: a flat configuration of 10 seeds
crosses 3 standard errors 1.5% of the time (0.3% on the pooled residuals' 169), and at the
threshold that matches the pooled test's false alarms it has about half its power
(tests/pipeline/report/test_plateau.py); and it counts true differences of slope between
seeds as noise, which asks whether a new seed would still rise, not whether these cells,
whose numbers the report prints, still rise. The cell's own test stays: it sees one
seed moving while the mean of the others is flat (a stalled seed recovering, a seed falling
away), which the pooled slope averages away.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from pipeline.present import markdown_table, number
from pipeline.report import exact

# A curve has plateaued when its trend over the last fifth of its iterations is within 3
# standard errors of zero; fewer than 5 logged points in a seed's window cannot tell a trend
# from noise.
PLATEAU_FRACTION = 0.2
PLATEAU_MIN_POINTS = 5
PLATEAU_Z = 3.0
NOT_PLATEAUED, NOT_ASSESSABLE = "†", "‡"

FLAG_NOTES = {
    NOT_PLATEAUED: "not plateaued (the cell's own trend, or its seeds' pooled trend): see the training table",
    NOT_ASSESSABLE: f"plateau not assessable (fewer than {PLATEAU_MIN_POINTS} logged points in the last "
    "fifth of training): see the training table",
}


class Plateau(NamedTuple):
    """The trend of a training curve, or of a configuration's seeds' curves, over the last
    fifth of each (``pooled_plateau``).

    points: logged values in the windows. start, end: first and last iteration in them.
    final: mean value in the windows (the smoothed final training log joint).
    delta: slope x the windows' span (end - start of a window, averaged over the seeds), the
    change the trend makes across a window. se: the slope's standard error x that span.
    z: delta / se. plateaued: ``|z| < PLATEAU_Z``; None when a window has fewer than
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


_NONE = Plateau(0, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan, None)  # no logged point


def plateau(iteration: np.ndarray, value: np.ndarray, fraction: float = PLATEAU_FRACTION) -> Plateau:
    """One curve's trend: ``value ~ a + b iteration`` by ordinary least squares over the logged
    points with ``iteration > (1 - fraction) * last iteration`` (``pooled_plateau`` of one
    curve)."""
    return pooled_plateau([(iteration, value)], fraction)


def pooled_plateau(
    curves: Sequence[tuple[np.ndarray, np.ndarray]], fraction: float = PLATEAU_FRACTION
) -> Plateau:
    """The common trend of S curves ``(iteration, value)``, each over its own last fraction:
    ``value_si = a_s + b t_si`` by least squares (one intercept per curve, one slope), so
    ``b = sum_si dt dv / sum_si dt^2`` with ``dt, dv`` each curve's deviations from its window's
    means, ``se(b)^2 = s^2 / sum dt^2`` with ``s^2`` the pooled residual variance on
    ``N - S - 1`` degrees of freedom, ``Delta = b * span``, ``se(Delta) = se(b) * span`` and
    ``z = Delta / se(Delta)``. One curve is plain OLS (``N - 2`` degrees of freedom).

    The logged values are single training batches, so their scatter around each curve's line
    is the batch-to-batch noise the trend is compared with.
    """
    windows = []
    for iteration, value in curves:
        t, v = np.asarray(iteration, dtype=float), np.asarray(value, dtype=float)
        finite = np.isfinite(t) & np.isfinite(v)
        t, v = t[finite], v[finite]
        window = t > (1.0 - fraction) * t.max() if len(t) else np.zeros(0, dtype=bool)
        windows.append((t[window], v[window]))
    assessable = bool(windows) and min(len(t) for t, _ in windows) >= PLATEAU_MIN_POINTS
    windows = [(t, v) for t, v in windows if len(t)]
    if not windows:
        return _NONE
    n = sum(len(t) for t, _ in windows)
    start, end = min(float(t.min()) for t, _ in windows), max(float(t.max()) for t, _ in windows)
    final = float(np.concatenate([v for _, v in windows]).mean())
    span = math.fsum(float(t.max() - t.min()) for t, _ in windows) / len(windows)
    dof = n - len(windows) - 1
    delta = se = z = math.nan
    dt = np.concatenate([t - t.mean() for t, _ in windows])
    dv = np.concatenate([v - v.mean() for _, v in windows])
    # Correctly rounded sums (``exact.dot``), not BLAS's: its summation order, so the last bit
    # of these columns, depends on the CPU that rebuilds the report.
    sxx = exact.dot(dt, dt)
    if dof >= 1 and sxx > 0:
        slope = exact.dot(dt, dv) / sxx
        resid = dv - slope * dt
        se_slope = math.sqrt(exact.dot(resid, resid) / dof / sxx)
        delta, se = slope * span, se_slope * span
        # A perfectly straight window: no noise to compare with; any trend is significant.
        z = delta / se if se > 0 else (0.0 if delta == 0 else math.copysign(math.inf, delta))
    ok = bool(abs(z) < PLATEAU_Z) if assessable else None
    return Plateau(n, start, end, final, delta, se, z, ok)


# The training curves a cell must have settled on: the log joint (what every method
# improves) and ESS/L (what the proposals' own objective, an inclusive KL, moves; it keeps
# rising after the log joint is flat).
PLATEAU_METRICS = ("log_joint", "ess")


def configurations(cells: Sequence[dict[str, Any]]) -> dict[str, str]:
    """``{cell_id: configuration}``: the cells a pooled plateau test takes together, named by
    the cell's name without its seed (``dgmm/apg/K5/L10``), with its iterations and swept
    settings added where cells of that name differ in them."""
    keys = {
        c["cell_id"]: (
            re.sub(r"/seed\d+(?=/|$)", "", c["name"]),
            c["iterations"],
            json.dumps(c.get("settings") or {}, sort_keys=True),
        )
        for c in cells
    }
    names = Counter(name for name, _, _ in set(keys.values()))
    return {
        cid: name if names[name] == 1 else f"{name} ({iterations} iterations, settings {settings})"
        for cid, (name, iterations, settings) in keys.items()
    }


def _verdict(stats: Sequence[Plateau]) -> str:
    """``no`` when any trend is significant, else ``not assessable`` when any window is too
    short (or nothing was logged), else ``yes``."""
    verdicts = [st.plateaued for st in stats]
    if False in verdicts:
        return "no"
    return "not assessable" if None in verdicts or not verdicts else "yes"


def training_table(training: pd.DataFrame, meta: dict[str, Any]) -> pd.DataFrame:
    """One row per cell: the ``plateau`` statistics of its own training log joint and ESS/L
    and their verdict (``own``); the ``pooled_plateau`` statistics of its configuration
    (``configurations``; over the seeds whose own window is assessable, where there are two or
    more) and their verdict (``pooled``, '' where there is no pooled test); the cell's verdict
    (``plateaued``: ``no`` when any of these trends is significant, ``not assessable`` when its
    own window is too short, ``yes``; ``not trained`` for cells with nothing to learn, e.g.
    exact Gibbs at 0 iterations); its iterations and mean iterations/s."""
    curves = {}
    if not training.empty:
        logged = training[training["metric"].isin(PLATEAU_METRICS)]
        for (cell_id, metric), curve in logged.groupby(["cell_id", "metric"], sort=False):
            curves[cell_id, metric] = (curve["iteration"].to_numpy(), curve["value"].to_numpy())
    own = {
        c["cell_id"]: {
            m: plateau(*curves[c["cell_id"], m]) for m in PLATEAU_METRICS if (c["cell_id"], m) in curves
        }
        for c in meta["cells"]
    }
    configuration = configurations(meta["cells"])
    groups: dict[str, list[str]] = {}
    for c in meta["cells"]:
        groups.setdefault(configuration[c["cell_id"]], []).append(c["cell_id"])
    pooled: dict[str, tuple[int, dict[str, Plateau]]] = {}
    for ids in groups.values():
        stats, seeds = {}, 0
        for metric in PLATEAU_METRICS:
            assessable = [
                curves[cid, metric] for cid in ids if own[cid].get(metric, _NONE).plateaued is not None
            ]
            if len(assessable) >= 2:
                stats[metric] = pooled_plateau(assessable)
                seeds = max(seeds, len(assessable))
        pooled.update({cid: (seeds, stats) for cid in ids})
    rows = []
    for cell in meta["cells"]:
        mine = own[cell["cell_id"]]
        seeds, theirs = pooled[cell["cell_id"]]
        if not cell["iterations"] or not mine:
            verdict = "not trained" if not cell["iterations"] else "not assessable"
        else:
            verdict = _verdict([*mine.values(), *theirs.values()])
        lj, ess = mine.get("log_joint", _NONE), mine.get("ess", _NONE)
        plj, pess = theirs.get("log_joint", _NONE), theirs.get("ess", _NONE)
        rows.append(
            {
                "cell": cell["name"],
                "cell_id": cell["cell_id"],
                "configuration": configuration[cell["cell_id"]],
                "method": cell["method"],
                "K": cell["K"],
                "L": cell["L"],
                "seed": cell["seed"],
                "iterations": cell["iterations"],
                "it_per_s": cell.get("mean_it_per_s"),
                "points": lj.points,
                "window_start": lj.start,
                "final_log_joint": lj.final,
                "delta": lj.delta,
                "se": lj.se,
                "z": lj.z,
                "final_ess": ess.final,
                "ess_delta": ess.delta,
                "ess_z": ess.z,
                "own": _verdict(list(mine.values())) if mine else "",
                "seeds_pooled": seeds,
                "pooled_delta": plj.delta,
                "pooled_se": plj.se,
                "pooled_z": plj.z,
                "pooled_ess_delta": pess.delta,
                "pooled_ess_z": pess.z,
                "pooled": _verdict(list(theirs.values())) if theirs else "",
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
                + {"no": f" {NOT_PLATEAUED}", "not assessable": f" {NOT_ASSESSABLE}"}.get(r.plateaued, "")
                + (" (seeds pooled)" if r.plateaued == "no" and r.own != "no" else ""),
            ]
        )
    return markdown_table(header, rows) + pooled_markdown(table)


def pooled_markdown(table: pd.DataFrame) -> str:
    """The pooled test of every configuration trained with several seeds, one line each,
    under the training table ('' when there is none)."""
    pooled = table[table["pooled"] != ""].drop_duplicates("configuration") if len(table) else table
    if pooled.empty:
        return ""
    header = [
        "configuration",
        "seeds",
        "iterations",
        "Δ last fifth",
        "se(Δ)",
        "z",
        "Δ ESS/L",
        "z (ESS/L)",
        "plateaued",
    ]
    rows = [
        [
            f"`{r.configuration}`",
            str(r.seeds_pooled),
            str(r.iterations),
            number(r.pooled_delta),
            number(r.pooled_se),
            "" if not np.isfinite(r.pooled_z) else f"{r.pooled_z:.1f}",
            number(r.pooled_ess_delta) if np.isfinite(r.pooled_ess_delta) else "",
            "" if not np.isfinite(r.pooled_ess_z) else f"{r.pooled_ess_z:.1f}",
            r.pooled + (f" {NOT_PLATEAUED}" if r.pooled == "no" else ""),
        ]
        for r in pooled.itertuples(index=False)
    ]
    return (
        "\n\nPooled over seeds: one line per configuration (cells that differ only by seed), one "
        "least-squares slope common to its seeds with an intercept per seed, over every seed's last "
        "fifth; se from the pooled residuals. A configuration whose pooled trend is significant marks "
        f"every seed's cell {NOT_PLATEAUED}.\n\n" + markdown_table(header, rows)
    )


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
