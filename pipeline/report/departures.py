"""Numbers far from the paper's, either way: the rule that flags them and the reasons recorded
for them.

A number of ours is flagged when it is more than ``FAR`` times the paper's value for the same
metric, method and test-time K, or less than ``1 / FAR`` times it: a result too good to be the
paper's needs an explanation as much as one that falls short. The reasons are one line each,
per task, in ``pipeline/paper_numbers.yaml`` (``departure_notes``), each pointing at the entry
of ``docs/decisions.md`` that measures it; a flagged number without one says so.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

# Flagged when ours / paper > FAR or < 1 / FAR.
FAR = 2.0

# The mark beside a flagged number, numbered per table (``⚑1``, ``⚑2``): one number per reason.
FLAG = "⚑"

NO_REASON = "no reason recorded"

# What the marks mean, once under every table (or claims table) that has one.
FLAG_RULE = (
    f"{FLAG}: our number is more than {FAR:g} times, or less than 1/{FAR:g} of, the paper's value for the "
    "same metric, method and K (ours / paper; for the signed Δ log p(x,z) and KL estimates the same quotient "
    "of the numbers as printed, so opposite signs count as far); each mark's reason points to "
    "its measurement."
)


def paper_ratio(ours: Any, paper: Any) -> float:
    """``ours / paper``, the quotient of the two numbers as the tables print them; NaN where
    either is missing or the paper's is 0 (the baseline row of a Δ column: no ratio to take).

    Signed quantities take the same quotient: a Δ log p(x,z) is the difference to the task's
    baseline row, the paper's to its first row, and our KL estimates can fall below 0 by
    Monte Carlo noise. A ratio of opposite signs is negative and ours at 0 gives 0: both below
    ``1 / FAR``, so both are flagged."""
    try:
        ours, paper = float(ours), float(paper)
    except (TypeError, ValueError):
        return math.nan
    if not (math.isfinite(ours) and math.isfinite(paper)) or paper == 0:
        return math.nan
    return ours / paper


def is_far(ratio: float) -> bool:
    """Whether ``ratio`` (``paper_ratio``) is more than ``FAR`` away from 1, either way."""
    return math.isfinite(ratio) and (ratio > FAR or ratio < 1 / FAR)


def departure_note(notes: dict[str, Any] | None, metric: str, method: str) -> str:
    """The recorded reason for a flagged ``metric`` of ``method`` (``reason (see)``), or
    ``NO_REASON``. ``notes``: a task's ``departure_notes``: per metric either one note
    ``{reason, see}`` for every method or ``{method: {reason, see}}`` (``"*"``: the rest); a
    swept variant ``apg [network.hidden=64]`` takes its base method's note."""
    entry = (notes or {}).get(metric)
    if not isinstance(entry, dict):
        return NO_REASON
    if "reason" not in entry:
        base = method.split(" [")[0]
        entry = entry.get(method) or entry.get(base) or entry.get("*")
        if not isinstance(entry, dict) or "reason" not in entry:
            return NO_REASON
    see = entry.get("see")
    return f"{entry['reason']} ({see})" if see else str(entry["reason"])


def note_pointers(notes: dict[str, Any] | None) -> list[str]:
    """Every ``see`` pointer of a task's ``departure_notes`` (for the test that they resolve)."""
    found = []
    for entry in (notes or {}).values():
        if not isinstance(entry, dict):
            continue
        for one in [entry] if "reason" in entry else entry.values():
            if isinstance(one, dict) and one.get("see"):
                found.append(str(one["see"]))
    return found


def with_paper_ratios(table: pd.DataFrame, paper: dict[str, Any] | None) -> pd.DataFrame:
    """``table`` (Table 1: ``metric`` and ``paper_<metric>`` columns) with, per metric the
    paper reports, ``paper_ratio_<metric>`` (``paper_ratio``) and ``paper_note_<metric>``:
    the reason where the ratio is far (``is_far``), "" elsewhere."""
    notes = (paper or {}).get("departure_notes") or {}
    out = table.copy()
    metrics = [
        c[len("paper_") :] for c in table.columns if c.startswith("paper_") and c[len("paper_") :] in table
    ]
    for metric in metrics:
        ratios = [paper_ratio(o, p) for o, p in zip(table[metric], table[f"paper_{metric}"], strict=True)]
        out[f"paper_ratio_{metric}"] = np.array(ratios, dtype=float)
        out[f"paper_note_{metric}"] = [
            departure_note(notes, metric, method) if is_far(r) else ""
            for r, method in zip(ratios, table["method"], strict=True)
        ]
    return out


def ratio_text(ratio: float) -> str:
    """A ratio as a footnote prints it: two significant digits, whole numbers from 10 up."""
    if abs(ratio) < 1e-3:
        return "≈0"
    return f"{ratio:,.0f}" if abs(ratio) >= 10 else f"{ratio:.2g}"


def flagged_cells(table: pd.DataFrame) -> list[tuple[int, str, float, str]]:
    """``(row position, metric, ratio, note)`` of every flagged number of a table made by
    ``with_paper_ratios``, in row order."""
    metrics = [c[len("paper_note_") :] for c in table.columns if c.startswith("paper_note_")]
    cells = []
    for pos, row in enumerate(table.to_dict("records")):
        for metric in metrics:
            note = row.get(f"paper_note_{metric}")
            if isinstance(note, str) and note:
                cells.append((pos, metric, float(row[f"paper_ratio_{metric}"]), note))
    return cells


def paper_value(paper: dict[str, Any] | None, method: str, k: int, metric: str) -> float:
    """The paper's ``metric`` for ``method`` at test-time ``k`` (its rows match by method and,
    where a row gives one, K; the same match as Table 1's ``paper`` columns); NaN if none."""
    rows = (paper or {}).get("rows") or []
    match = [r for r in rows if r["method"] == method and r.get("K", k) == k]
    value = match[0].get(metric) if match else None
    return math.nan if value is None else float(value)


def claim_departure(spec: dict[str, Any], value: Any, paper: dict[str, Any] | None) -> str:
    """For a threshold claim on the first held-out set whose number the paper reports (same
    metric, method and K): ``"ratio r to the paper's p: reason"`` when ``value`` (our mean) is
    far from it (``is_far``), else "". A target the paper's own number sets (``≥ 0.398``) can
    hold for a result no reproduction of the paper would give; this says so."""
    if spec.get("kind") != "threshold" or spec.get("sweep") is not None or "test_set" in spec:
        return ""
    if "pair" not in spec or "metric" not in spec:
        return ""
    theirs = paper_value(paper, spec["method"], int(spec["pair"][0]), spec["metric"])
    ratio = paper_ratio(value, theirs)
    if not is_far(ratio):
        return ""
    note = departure_note((paper or {}).get("departure_notes"), spec["metric"], spec["method"])
    return f"ratio {ratio_text(ratio)} to the paper's {theirs:g}: {note}"
