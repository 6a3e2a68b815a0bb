"""The rings' simulator: the true data process (fixed circles), not ``p_theta``, whose
ring shape is learned.

Legend: M datasets, N points, I clusters.
"""

from __future__ import annotations

import torch
from torch import Tensor

from apg.tasks.dgmm.model import DATA_DIM, DGMM, TWO_PI, angle_features


def simulate_rings(
    num_datasets: int,
    num_points: int,
    generator: torch.Generator,
    num_clusters: int = 4,
    sigma0: float = 3.5,
    radius: float = 2.0,
    noise: float = 0.2,
) -> dict[str, Tensor]:
    """The true data process: points on circles of ``radius`` with Gaussian ``noise``.

    Angles are uniform on ``[0, 2 pi)`` (``torch.rand`` never returns 1, so 0 and 2 pi are
    not both drawn, unlike the authors' angle grid). Returns float64 ``x (M, N, 2)``,
    ``mu (M, I, 2)``, ``alpha (M, N)`` and long ``c (M, N)``.
    """
    if num_datasets < 1 or num_points < 1:
        raise ValueError(f"need num_datasets, num_points >= 1, got {num_datasets}, {num_points}")
    f64 = torch.float64
    mu = sigma0 * torch.randn(num_datasets, num_clusters, DATA_DIM, generator=generator, dtype=f64)
    c = torch.randint(num_clusters, (num_datasets, num_points), generator=generator)
    alpha = TWO_PI * torch.rand(num_datasets, num_points, generator=generator, dtype=f64)
    centre = mu.gather(1, c.unsqueeze(-1).expand(-1, -1, DATA_DIM))
    eps = noise * torch.randn(num_datasets, num_points, DATA_DIM, generator=generator, dtype=f64)
    return {"x": centre + radius * angle_features(alpha) + eps, "mu": mu, "c": c, "alpha": alpha}


def simulate(
    model: DGMM,
    num_datasets: int,
    generator: torch.Generator,
    num_points: int = 200,
    radius: float = 2.0,
    noise: float | None = None,
) -> dict[str, Tensor]:
    """Datasets of rings with the model's I and sigma0; ``noise`` defaults to the model's
    sigma_eps. The simulator is the *true* process (fixed circles of ``radius``), not
    ``p_theta``, whose shape is learned."""
    cfg = model.cfg
    return simulate_rings(
        num_datasets,
        num_points,
        generator,
        cfg.num_clusters,
        cfg.sigma0,
        radius,
        cfg.noise if noise is None else noise,
    )
