"""Deep generative mixture model of rings, "DGMM" (paper section 5.2): the task's ``TASK``
and its public names.

Modules: ``model`` (``p_theta`` with its learned ring shape, the likelihood's compiled
pieces), ``simulator`` (the true data process), ``distributions`` (von Mises angles and
the proposals' distributions), ``proposals`` (the networks), ``metrics`` (scores under
the true model), ``plots`` (sample pictures).

Legend: L particles, B datasets, N points, I clusters.
Data ``x``: ``(B, N, 2)``.
"""

from __future__ import annotations

from apg.blocks import TaskSpec
from apg.tasks.dgmm.distributions import (
    DEVICE_CANDIDATES,
    GaussianMu,
    LocalProposal,
    gaussian_mu,
    pool_assigned,
    pool_per_cluster,
    sample_von_mises,
    von_mises_log_prob,
)
from apg.tasks.dgmm.metrics import common_log_joint, true_ring_log_joint
from apg.tasks.dgmm.model import (
    DATA_DIM,
    DGMM,
    TWO_PI,
    DGMMConfig,
    angle_features,
    assigned_centres,
    build_model,
    reconstruct,
    sample_data,
    squared_residuals,
    squared_residuals_change,
)
from apg.tasks.dgmm.plots import draw
from apg.tasks.dgmm.proposals import CentreEncoder, CentreKernel, DGMMProposals, LocalNet, build_proposals
from apg.tasks.dgmm.simulator import simulate, simulate_rings

TASK = TaskSpec(
    "dgmm",
    build_model,
    build_proposals,
    simulate,
    ("apg", "mlp", "lstm"),
    ("N", "2"),
    reconstruct=reconstruct,
    sample_data=sample_data,
    draw=draw,
    common_log_joint=common_log_joint,
)

__all__ = [
    "DATA_DIM",
    "DEVICE_CANDIDATES",
    "DGMM",
    "TASK",
    "TWO_PI",
    "CentreEncoder",
    "CentreKernel",
    "DGMMConfig",
    "DGMMProposals",
    "GaussianMu",
    "LocalNet",
    "LocalProposal",
    "angle_features",
    "assigned_centres",
    "build_model",
    "build_proposals",
    "common_log_joint",
    "draw",
    "gaussian_mu",
    "pool_assigned",
    "pool_per_cluster",
    "reconstruct",
    "sample_data",
    "sample_von_mises",
    "simulate",
    "simulate_rings",
    "squared_residuals",
    "squared_residuals_change",
    "true_ring_log_joint",
    "von_mises_log_prob",
]
