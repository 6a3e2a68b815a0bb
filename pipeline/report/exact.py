"""Arithmetic whose last bit does not depend on the CPU, for the numbers the report
tabulates and the lines it draws.

A rebuild of an unchanged report must leave its files as they were on any machine (git
keeps every version of a figure). NumPy picks its float64 ``exp`` and ``geomspace`` by the
CPU's vector unit, and its dot products go through OpenBLAS, whose kernel (so its order of
summation) is picked per CPU too: between an AMD EPYC (AVX2) and an Intel Xeon (AVX-512)
the training tables' standard errors and a fitted power law's line differed in the last
bit, and a line that moves by one unit in the last place shifts a few anti-aliased pixels
of a figure by one colour level. Here sums are correctly rounded (``math.fsum``, whatever
the order) and ``exp``/``log`` are the C library's, element by element, which take no path
by vector width (glibc's differ at most between CPUs with and without FMA; every x86-64
machine this project has run on has it); products, differences, quotients and square roots
are IEEE-exact on every CPU. Matplotlib's own log axes still go through NumPy: the figures'
last colour level is left to ``figures.same_picture``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np


def dot(a: Any, b: Any) -> float:
    """``sum(a * b)``, correctly rounded."""
    return math.fsum(np.multiply(np.asarray(a, dtype=float), np.asarray(b, dtype=float)).ravel().tolist())


def _each(fn: Callable[[float], float], x: Any) -> np.ndarray:
    values = np.asarray(x, dtype=float)
    return np.array([fn(v) for v in values.ravel().tolist()], dtype=float).reshape(values.shape)


def _exp(v: float) -> float:
    try:
        return math.exp(v)
    except OverflowError:
        return math.inf


def _log(v: float) -> float:
    if v > 0:
        return math.log(v)
    return -math.inf if v == 0 else math.nan


def exp(x: Any) -> np.ndarray:
    """``np.exp``'s values (``inf`` past the largest float) from the C library's ``exp``."""
    return _each(_exp, x)


def log(x: Any) -> np.ndarray:
    """``np.log``'s values (``-inf`` at 0, ``nan`` below) from the C library's ``log``."""
    return _each(_log, x)


def geomspace(start: float, stop: float, num: int) -> np.ndarray:
    """``num`` points from ``start`` to ``stop`` (both kept exactly), evenly spaced in log."""
    if num == 1:
        return np.array([float(start)])
    lo, hi = _log(start), _log(stop)
    points = exp([lo + (hi - lo) * i / (num - 1) for i in range(num)])
    points[0], points[-1] = start, stop
    return points


def line_fit(x: Any, y: Any) -> tuple[float, float]:
    """``(intercept, slope)`` of ``y ~ a + b x`` by ordinary least squares."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    x_mean, y_mean = math.fsum(x.tolist()) / len(x), math.fsum(y.tolist()) / len(y)
    dx = x - x_mean
    slope = dot(dx, y - y_mean) / dot(dx, dx)
    return y_mean - slope * x_mean, slope
