"""Missing-data imputation by a Markov chain that alternates inference and generation
(Rezende, Mohamed and Wierstra 2014, Appendix F), for any method and task.

One iteration of the chain, given data ``x`` whose entries marked ``missing`` hold the
current imputation:

1. infer: run the method on the filled-in data (APG: its sweeps; RWS: its encoder; exact
   Gibbs: the exact conditionals) and pick one particle per dataset by its normalized
   weight, ``z ~ p_hat(z | x_filled)``;
2. generate: redraw the missing entries from ``p_theta(x | z)`` (``TaskSpec.sample_data``;
   every task here has entries independent given ``z``, so this is their conditional given
   ``z`` and the observed entries), or set them to its mean (``fill="mean"``,
   ``TaskSpec.reconstruct``).

With exact inference the sampled chain is a Gibbs sampler of ``p(z, x_missing |
x_observed)``, so its imputations are draws from the predictive distribution of the
missing entries; with a learned method it is as good as that method's posterior.

Legend: B datasets, I chain iterations, L particles; ``x`` is ``(B, ...)`` (one dataset's
dims after B, as in the task's files).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from apg.baselines import Method
from apg.blocks import Latents, Model, Proposals, TaskSpec
from apg.smc.weights import normalized_weights

FILLS = ("sample", "mean")


class MaskError(ValueError):
    """A mask of missing entries that does not fit the data, or leaves nothing to do."""


class Imputation(NamedTuple):
    """The chain's output.

    Attributes
    ----------
    x: ``(B, ...)`` the data with the missing entries at the chain's last state.
    history: ``(I, n)`` the missing entries (in ``x[missing]`` order) after each iteration.
    z: the latents picked at the last iteration, each ``(1, B, ...)``: what explains the
        last imputation (e.g. the tracked digits through an occlusion).
    """

    x: Tensor
    history: Tensor
    z: Latents


def check_mask(x: Tensor, missing: Tensor) -> Tensor:
    """``missing`` as a bool tensor shaped like ``x``; ``MaskError`` with a one-line reason
    for a wrong shape, a mask with nothing missing, or a dataset with nothing observed."""
    if tuple(missing.shape) != tuple(x.shape):
        raise MaskError(f"the mask must be shaped like the data {tuple(x.shape)}, got {tuple(missing.shape)}")
    if missing.dtype != torch.bool:
        if not ((missing == 0) | (missing == 1)).all():
            raise MaskError("the mask must hold only 0 (observed) and 1 (missing)")
        missing = missing.bool()
    if not missing.any():
        raise MaskError("the mask marks nothing missing: there is nothing to impute")
    full = missing.flatten(1).all(1)
    if full.any():
        which = full.nonzero().flatten().tolist()
        raise MaskError(f"every entry of dataset(s) {which[:10]} is missing: nothing to condition on")
    return missing


def initial_fill(x: Tensor, missing: Tensor) -> Tensor:
    """The chain's start: each missing entry at the mean of its dataset's observed entries."""
    observed = (~missing).flatten(1)
    flat = x.flatten(1)
    # where, not a product: a hidden entry may hold anything, NaN included
    mean = torch.where(observed, flat, 0).sum(1) / observed.sum(1)
    start = mean.view(-1, *([1] * (x.dim() - 1))).expand_as(x)
    return torch.where(missing, start.to(x.dtype), x)


def pick_particle(z: Latents, log_weights: Tensor) -> Latents:
    """One particle per dataset, drawn by its normalized weight: each latent ``(1, B, ...)``."""
    index = torch.multinomial(normalized_weights(log_weights).T, 1).squeeze(-1)  # (B,)
    datasets = torch.arange(log_weights.shape[1], device=log_weights.device)
    return {name: value[index, datasets].unsqueeze(0) for name, value in z.items()}


def impute(
    method: Method,
    model: Model,
    proposals: Proposals,
    task: TaskSpec,
    x: Tensor,
    missing: Tensor,
    iterations: int,
    sweeps: int,
    particles: int,
    fill: str = "sample",
    resample_mode: str = "block",
    resampler: str = "systematic",
) -> Imputation:
    """Run the chain for ``iterations`` iterations from :func:`initial_fill`.

    ``x (B, ...)``: the data (its missing entries' values are ignored); ``missing``: bool
    (or 0/1) shaped like ``x``, True where an entry is missing. ``sweeps`` and
    ``particles``: the method's budget at each inference step. Raises ``MaskError`` for a
    bad mask and ``ValueError`` for a bad ``fill`` or ``iterations``, or a task that cannot
    generate data.
    """
    if fill not in FILLS:
        raise ValueError(f"fill must be one of {FILLS}, got {fill!r}")
    generate = task.sample_data if fill == "sample" else task.reconstruct
    if generate is None:
        raise ValueError(f"task {task.name!r} cannot {'draw' if fill == 'sample' else 'reconstruct'} data")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an integer >= 1, got {iterations!r}")
    missing = check_mask(x, missing)
    filled = initial_fill(x, missing)
    history = []
    z: Latents = {}
    for _ in range(iterations):
        with torch.no_grad():
            result = method.run(model, proposals, filled, sweeps, particles, resample_mode, resampler)
            z = pick_particle(result.z, result.log_weights)
            draw = generate(model, filled, z)[0]
        filled = torch.where(missing, draw.to(x.dtype), x)
        history.append(filled[missing])
    return Imputation(filled, torch.stack(history), z)
