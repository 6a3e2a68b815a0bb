"""The statistics behind the claims' verdicts: pure functions of per-seed values.

A claim is decided over seeds (each seed first averaged over the held-out datasets): a mean
with its Student-t interval, the difference of two independent sets of seeds by Welch, an
equivalence by two one-sided tests (TOST) against a stated margin, and the smallest effect
the seeds could detect. Quantiles come from ``scipy.stats``; tests/pipeline/test_statistics.py checks
each function against scipy's own tests.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
from scipy import stats

# An interval over seeds needs this many; a claim resting on fewer gets no verdict.
MIN_SEEDS = 3
CONFIDENCE = 0.95  # of every interval the report prints
POWER = 0.8  # of the detectable effect


def t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t with ``df`` (> 0, possibly fractional) degrees of freedom."""
    if not df > 0:
        raise ValueError(f"df must be > 0, got {df}")
    return float(stats.t.ppf(q, df))


def t975(df: float) -> float:
    """The two-sided 95% quantile of Student's t (``t_quantile(0.975, df)``)."""
    return t_quantile(0.5 + CONFIDENCE / 2, df)


class Estimate(NamedTuple):
    """A mean over seeds with its Student-t 95% interval ``[lo, hi]`` (NaN with fewer than
    ``MIN_SEEDS`` seeds); ``n``: seeds; ``cells``: the cell ids it averages; ``se``: the
    mean's standard error, ``df``: its degrees of freedom (NaN without an interval)."""

    mean: float
    lo: float
    hi: float
    n: int
    cells: tuple[str, ...] = ()
    se: float = math.nan
    df: float = math.nan


def seed_interval(values: Any, cells: tuple[str, ...] = ()) -> Estimate:
    """Mean and Student-t 95% interval of per-seed values (NaN ones dropped)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    n = len(v)
    if not n:
        return Estimate(math.nan, math.nan, math.nan, 0, cells)
    mean = float(v.mean())
    if n < MIN_SEEDS:
        return Estimate(mean, math.nan, math.nan, n, cells)
    se = float(v.std(ddof=1)) / math.sqrt(n)
    half = t975(n - 1) * se
    return Estimate(mean, mean - half, mean + half, n, cells, se, n - 1)


def difference(a: Estimate, b: Estimate) -> Estimate:
    """``a - b`` for two independent sets of seeds (two methods' cells, or two budgets'):
    Welch's 95% interval with the Welch-Satterthwaite degrees of freedom (as
    ``scipy.stats.ttest_ind(equal_var=False)``). ``n`` is the smaller seed count; no
    interval when either has none."""
    mean, n, cells = a.mean - b.mean, min(a.n, b.n), a.cells + b.cells
    if not (math.isfinite(a.se) and math.isfinite(b.se)):
        return Estimate(mean, math.nan, math.nan, n, cells)
    var = a.se**2 + b.se**2
    if var == 0:
        return Estimate(mean, mean, mean, n, cells, 0.0, a.df + b.df)
    df = var**2 / (a.se**4 / a.df + b.se**4 / b.df)
    half = t975(df) * math.sqrt(var)
    return Estimate(mean, mean - half, mean + half, n, cells, math.sqrt(var), df)


def equivalent(d: Estimate, margin: float, alpha: float = 0.05) -> bool | None:
    """Two one-sided tests (TOST) at level ``alpha`` each: is the difference ``d`` within
    ``(-margin, margin)``? True when its ``1 - 2 alpha`` interval lies inside the margin
    (both one-sided tests reject); None without an interval."""
    if not (math.isfinite(d.se) and math.isfinite(d.df)):
        return None
    half = t_quantile(1 - alpha, d.df) * d.se if d.se > 0 else 0.0
    return -margin < d.mean - half and d.mean + half < margin


def detectable(e: Estimate, power: float = POWER) -> float:
    """The smallest true effect (a difference, a change, or a distance from a threshold) that
    a two-sided test at 95% on these seeds finds with probability ``power``:
    ``(t_0.975 + t_power) * se`` at the estimate's degrees of freedom. NaN without an interval."""
    if not (math.isfinite(e.se) and math.isfinite(e.df)):
        return math.nan
    return (t975(e.df) + t_quantile(power, e.df)) * e.se
