"""The checked claims in short and in full: ``reports/metrics.json`` (what ``dvc metrics
show``, ``dvc metrics diff`` and ``dvc exp show`` print: one verdict per claim and the
counts), its long form ``reports/data/metrics-full.json`` (every cell's headline numbers,
every claim's value and interval), and the count the README's results open with."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pipeline.report.claims import ClaimResult


def claims_json(results: list[ClaimResult]) -> dict[str, Any]:
    """``{task/id: {value, lo, hi, target, pass}}`` for metrics-full.json (NaN as null)."""

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


def verdict_tally(
    claims: list[ClaimResult], replication: dict[str, ClaimResult] | None = None
) -> dict[str, int]:
    """``held`` of the ``judged`` claims (those with a verdict) of ``total``; with a
    replication also ``held_both`` of the ``judged_both`` claims with a verdict in both runs,
    and on how many of those the two runs ``agree``."""
    judged = [c for c in claims if c.passed is not None]
    tally = {"held": sum(bool(c.passed) for c in judged), "judged": len(judged), "total": len(claims)}
    if replication is not None:
        pairs = [(c, replication.get(f"{c.task}/{c.id}")) for c in judged]
        both = [(c, o) for c, o in pairs if o is not None and o.passed is not None]
        tally["held_both"] = sum(bool(c.passed) and bool(o.passed) for c, o in both)
        tally["judged_both"] = len(both)
        tally["agree"] = sum(c.passed == o.passed for c, o in both)
    return tally


def verdict_count(claims: list[ClaimResult], replication: dict[str, ClaimResult] | None = None) -> str:
    """ "k of the n claims with a verdict hold", or with a replication the claims that hold in
    both runs, out of those with a verdict in both."""
    t = verdict_tally(claims, replication)
    if replication is None:
        return f"{t['held']} of the {t['judged']} claims with a verdict hold"
    return (
        f"{t['held_both']} of the {t['judged_both']} claims with a verdict in both runs hold in both "
        f"(the two runs' verdicts agree on {t['agree']} of them)"
    )


def headline_metrics(
    claims: list[ClaimResult],
    replication: dict[str, ClaimResult] | None = None,
    long_run: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``reports/metrics.json``: ``claims`` holds the counts (``verdict_tally``), and each task
    ``{claim id: 1 (holds), 0 (fails) or None (no verdict)}``. Kept to a few dozen numbers with
    the claim ids of ``paper_numbers.yaml`` as keys, so that ``dvc metrics diff`` between two
    commits lists the verdicts that flipped; DVC leaves null values out of its tables.
    ``long_run`` (the claims decided on the continuing runs' held-out grids,
    ``bmnist.long_run_claims``, and their reach verdicts: not counted in the tally) goes under
    its own key when given, as its count of claims holding and each target set's reach: its
    claims one by one, a set and a baseline each, are in ``metrics-full.json``.
    So ``dvc metrics show`` stays a table a terminal shows (at most ``HEADLINE_NUMBERS``)."""
    out: dict[str, Any] = {"claims": verdict_tally(claims, replication)}
    for c in claims:
        out.setdefault(c.task, {})[c.id] = None if c.passed is None else int(bool(c.passed))
    if long_run:
        judged = [v for v in long_run.get("claims", {}).values() if v is not None]
        out["long_run"] = {
            "claims_held": sum(judged),
            "claims_judged": len(judged),
            "reach": long_run.get("reach", {}),
        }
    return out


HEADLINE_NUMBERS = 60


def count_numbers(metrics: dict[str, Any]) -> int:
    """The values ``dvc metrics show`` prints for ``metrics`` (nested keys flattened)."""
    return sum(count_numbers(v) if isinstance(v, dict) else 1 for v in metrics.values())
