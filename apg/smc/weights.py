"""All log-weight arithmetic of the package lives here.

Log-weights are tensors shaped ``(L, B)``: L particles for each of B independent
datasets. Nothing here ever exponentiates an unnormalized log-weight.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from apg.host import values_on_host


class DegenerateWeightsError(RuntimeError):
    """Every particle of some dataset has weight zero (all log-weights are -inf or NaN)."""


def sanitize(log_w: Tensor) -> Tensor:
    """Turn NaN log-weights into -inf and raise if a dataset has no finite weight.

    This is the one place where NaN becomes -inf. On a device (``apg.host``) nothing is
    checked: a dataset without a finite weight gives NaN normalized weights, hence a
    non-finite loss, which the training loop reports when it logs.
    """
    if not values_on_host(log_w):
        return torch.nan_to_num(log_w, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    # Fast path, taken at every block update: the per-dataset maximum is NaN if any
    # weight is NaN, +inf if any is +inf and -inf only if all are, so the sum of the
    # maxima is finite exactly when there is nothing to repair (an overflow of that sum
    # only sends it down the full check).
    if math.isfinite(log_w.amax(dim=0).sum()):
        return log_w
    log_w = torch.nan_to_num(log_w, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    if torch.isposinf(log_w).any():
        raise DegenerateWeightsError("a log-weight is +inf: the target density is unbounded here")
    dead = torch.isneginf(log_w).all(dim=0)
    if dead.any():
        idx = dead.nonzero().flatten().tolist()
        raise DegenerateWeightsError(
            f"all {log_w.shape[0]} particles have zero weight for dataset(s) {idx[:10]}"
        )
    return log_w


def log_mean_exp(log_w: Tensor, dim: int = 0) -> Tensor:
    """``log(mean(exp(log_w)))`` along ``dim``, computed stably."""
    return torch.logsumexp(log_w, dim=dim) - math.log(log_w.shape[dim])


def normalize(log_w: Tensor) -> Tensor:
    """Normalized log-weights: ``log_w - logsumexp(log_w)`` over particles (dim 0)."""
    return log_w - torch.logsumexp(log_w, dim=0, keepdim=True)


def normalized_weights(log_w: Tensor) -> Tensor:
    """Self-normalized weights ``w / sum(w)`` over particles, ``(L, B)``."""
    return torch.softmax(log_w, dim=0)


def ess(log_w: Tensor) -> Tensor:
    """Effective sample size ``(sum w)^2 / sum w^2`` per dataset, ``(B,)`` (eq. 11 times L)."""
    # stable: the largest normalized weight is at least 1 / L
    return ess_fraction_of(normalized_weights(log_w)) * log_w.shape[0]


def ess_fraction(log_w: Tensor) -> Tensor:
    """ESS/L per dataset, ``(B,)`` (eq. 11)."""
    return ess_fraction_of(normalized_weights(log_w))


def ess_fraction_of(weights: Tensor) -> Tensor:
    """ESS/L per dataset from self-normalized weights ``(L, B)``: ``1 / (L sum w^2)``."""
    return 1.0 / (weights.shape[0] * (weights * weights).sum(0))


def log_evidence(log_w: Tensor) -> Tensor:
    """Estimate of ``log p(x)`` per dataset from the current log-weights, ``(B,)``.

    Valid at any point of an SMC run because resampling (``apg.smc.resampling``) sets
    every outgoing log-weight to the log-mean-exp of the incoming ones.
    """
    return log_mean_exp(log_w, dim=0)
