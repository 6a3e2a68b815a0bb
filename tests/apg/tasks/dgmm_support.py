"""Shared set-up of the rings task's tests: simulated data, random latents, the prior's local kernel."""

from __future__ import annotations

import torch
from torch.distributions import Categorical, Uniform

from apg.blocks import Factorized
from apg.tasks.dgmm import (
    DGMM,
    TWO_PI,
    build_model,
    simulate,
)


def simulated_rings(num_datasets=3, num_points=40, seed=0, **kw):
    model = build_model(**kw)
    return model, simulate(model, num_datasets, torch.Generator().manual_seed(seed), num_points=num_points)


def random_latents(model: DGMM, x: torch.Tensor, num_particles: int) -> dict[str, torch.Tensor]:
    batch, num_points = x.shape[:2]
    i = model.cfg.num_clusters
    return {
        "mu": model.cfg.sigma0 * torch.randn(num_particles, batch, i, 2),
        "c": torch.randint(i, (num_particles, batch, num_points)),
        "alpha": TWO_PI * torch.rand(num_particles, batch, num_points),
    }


def prior_local(model):
    def kernel(x, z):
        shape = z["c"].shape
        i = model.cfg.num_clusters
        return Factorized(
            {
                "c": (Categorical(logits=torch.zeros(*shape, i)), 1),
                "alpha": (Uniform(torch.zeros(shape), torch.full(shape, TWO_PI)), 1),
            }
        )

    return kernel
