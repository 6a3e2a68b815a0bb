"""Monte Carlo bookkeeping shared by the statistical tests."""

from __future__ import annotations

import numpy as np


def mean_se(values) -> tuple[float, float]:
    """The mean of ``values`` (one per dataset, video or seed: independent draws) and its
    standard error. For a paired comparison, pass the per-item differences."""
    values = np.asarray(values, dtype=np.float64)
    return float(values.mean()), float(values.std(ddof=1) / np.sqrt(len(values)))
