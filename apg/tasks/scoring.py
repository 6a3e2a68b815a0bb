"""Per-dataset reductions that the tasks' held-out scores share (their ``ImputationSpec``).

Legend: n hidden entries over all datasets, M datasets.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def mse_per_dataset(err: Tensor, owner: Tensor, count: int) -> np.ndarray:
    """Mean square ``(count,)`` per dataset of the errors ``err (n,)`` of hidden entries;
    ``owner (n,)``: each entry's dataset (``mask.nonzero()[:, 0]``)."""
    total = torch.zeros(count, dtype=torch.float64).index_add_(0, owner, err.double() ** 2)
    n = torch.bincount(owner, minlength=count).double()
    return (total / n).numpy()


def rmse_per_dataset(err: Tensor, owner: Tensor, count: int) -> np.ndarray:
    """The root of :func:`mse_per_dataset`."""
    return np.sqrt(mse_per_dataset(err, owner, count))
