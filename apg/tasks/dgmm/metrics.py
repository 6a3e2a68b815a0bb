"""Scores of the rings' inferred latents under the simulator's true model.

Legend: M datasets, N points, I clusters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from apg.tasks.dgmm.model import DATA_DIM, TWO_PI, DGMMConfig


def true_ring_log_joint(
    x: Tensor, mu: Tensor, c: Tensor, num_clusters: int, sigma0: float, radius: float, noise: float
) -> Tensor:
    """``log p(x, mu, c)`` under the simulator's own model (circles of ``radius``), the
    angles integrated out, ``(..., N, 2), (..., I, 2), (..., N) -> (...)``.

    One model for every method: a learned ring shape ``g_theta`` differs per trained cell
    (and may be rotated or mirrored against the true angle), so only ``mu`` and ``c`` are
    scored. With ``d = x_n - mu_{c_n}``, ``rho = |d|``, ``s = noise``, ``r = radius``::

        p(x_n | mu, c_n) = (2 pi)^-1 int N(d; r (cos a, sin a), s^2 I) da
                         = exp(-(rho^2 + r^2) / (2 s^2)) I_0(r rho / s^2) / (2 pi s^2),

    and ``log I_0(z) = log i0e(z) + z`` stays finite for large ``z``.
    """
    centres = mu.gather(-2, c.unsqueeze(-1).expand(*c.shape, DATA_DIM))
    rho = (x - centres).norm(dim=-1)
    s2 = noise**2
    r_rho = radius * rho / s2
    bessel = torch.log(torch.special.i0e(r_rho)) + r_rho
    per_point = -(rho**2 + radius**2) / (2 * s2) + bessel - math.log(TWO_PI * s2) - math.log(num_clusters)
    prior_mu = (-0.5 * (mu / sigma0) ** 2 - math.log(sigma0) - 0.5 * math.log(TWO_PI)).sum((-2, -1))
    return prior_mu + per_point.sum(-1)


def common_log_joint(
    arrays: Mapping[str, np.ndarray],
    particle: Mapping[str, np.ndarray],
    model_hparams: Mapping[str, Any],
    sizes: Mapping[str, Any],
) -> np.ndarray:
    """``TaskSpec.common_log_joint``: per-dataset ``log p(x, mu, c)`` ``(M,)`` of a particle's
    centres and assignments under the rings' true generative model (the simulator's circles
    of the set's ``radius``, the model's noise and prior; angles integrated out:
    ``true_ring_log_joint``), the same model for every method, whatever ring shape each
    learned."""
    cfg = DGMMConfig(**model_hparams)
    x, mu = (torch.from_numpy(np.asarray(a, dtype=np.float64)) for a in (arrays["x"], particle["mu"]))
    c = torch.from_numpy(particle["c"].astype(np.int64))
    radius = float(sizes.get("radius", 2.0))
    return true_ring_log_joint(x, mu, c, cfg.num_clusters, cfg.sigma0, radius, cfg.noise).numpy()
