"""Held-out imputation for the GMM (``IMPUTATION``, the task's ``ImputationSpec``): in each
dataset a fraction of the points has one coordinate hidden; the chain's imputations are
scored against the true values and against the Bayes predictor at the simulator's true
parameters.

Legend: M datasets, N points, I clusters, D data dimensions, E hidden entries.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from apg.blocks import ImputationSpec
from apg.tasks.scoring import rmse_per_dataset


def hidden_coordinates(x: torch.Tensor, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """``(M, N, 2)`` bool: in every dataset, ``round(fraction * N)`` points (at least one)
    with one of their two coordinates hidden, both drawn uniformly."""
    num_datasets, num_points, dims = x.shape
    hidden = max(1, round(fraction * num_points))
    mask = torch.zeros(x.shape, dtype=torch.bool)
    for m in range(num_datasets):
        points = torch.randperm(num_points, generator=generator)[:hidden]
        coords = torch.randint(dims, (hidden,), generator=generator)
        mask[m, points, coords] = True
    return mask


def oracle_imputation(
    x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, tau: torch.Tensor
) -> torch.Tensor:
    """E[hidden coordinate | the point's observed coordinates, true mu and tau] for every
    hidden entry (in ``x[mask]`` order; ``x (M, N, D)``, ``mu`` and ``tau (M, I, D)``):
    clusters weighed by the likelihood of the point's observed coordinates (the simulator's
    assignments are uniform)."""
    m, n, d = mask.nonzero().unbind(1)
    point, seen = x[m, n].unsqueeze(1), (~mask[m, n]).unsqueeze(1)  # (E, 1, D)
    mean, prec = mu[m], tau[m]  # (E, I, D)
    log_lik = 0.5 * torch.log(prec) - 0.5 * prec * (point - mean) ** 2
    log_w = torch.where(seen, log_lik, 0).sum(-1)  # (E, I)
    hidden_means = mean.gather(-1, d[:, None, None].expand(-1, mean.shape[1], 1)).squeeze(-1)
    return (torch.softmax(log_w, -1) * hidden_means).sum(-1).to(x.dtype)


def masks(settings: Mapping[str, Any], x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One setting: ``fraction`` (default 0.25) of the points with a coordinate hidden,
    drawn from ``seed``."""
    fraction = float(settings.get("fraction", 0.25))
    mask = hidden_coordinates(x, fraction, torch.Generator().manual_seed(int(settings.get("seed", 0))))
    return [(f"one coordinate of {fraction:.0%} of the points", mask)]


def scores(
    settings: Mapping[str, Any],
    x: torch.Tensor,
    mask: torch.Tensor,
    arrays: Mapping[str, np.ndarray],
    model,
    result,
) -> list[tuple[str, np.ndarray, int]]:
    """``rmse_oracle`` (the Bayes predictor at the true ``mu, tau``), then per iteration
    ``rmse`` (the mean of the draws kept after ``burn_in``: the chain's estimate of
    E[x_missing | x_observed]) and ``rmse_draw`` (that iteration's draw alone)."""
    count, truth = len(x), x[mask]
    owner = mask.nonzero()[:, 0]  # each hidden entry's dataset
    burn_in = int(settings.get("burn_in", 0))
    mu, tau = (torch.from_numpy(arrays[k][:count]).to(x.dtype) for k in ("mu", "tau"))
    oracle = oracle_imputation(x, mask, mu, tau)
    iterations = len(result.history)
    out = [("rmse_oracle", rmse_per_dataset(oracle - truth, owner, count), iterations)]
    for i in range(iterations):
        draws = result.history[: i + 1]
        kept = draws[min(burn_in, i) :]
        out.append(("rmse", rmse_per_dataset(kept.mean(0) - truth, owner, count), i + 1))
        out.append(("rmse_draw", rmse_per_dataset(draws[-1] - truth, owner, count), i + 1))
    return out


IMPUTATION = ImputationSpec(
    masks,
    scores,
    description="RMSE of the hidden coordinates, for the mean of the chain's draws (after "
    "burn-in), for the last draw alone, and for the Bayes predictor at the simulator's true "
    "parameters (the best possible on average, which no method knows).",
    figure_description="RMSE against the truth of the mean of the draws kept so far (those "
    "after the burn-in; before it, the last draw alone), versus chain iteration; dashed: the "
    "Bayes predictor at the simulator's true parameters.",
)
