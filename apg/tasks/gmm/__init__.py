"""Gaussian mixture model (paper section 5.1): the task's ``TASK`` and its public names.

Modules: ``model`` (the generative model, its simulator and the exact Gibbs kernels),
``conjugate`` (the NormalGamma family and the exact assignment logits), ``proposals`` (the
neural-sufficient-statistics networks), ``metrics`` (the best-possible assignments),
``imputation`` (held-out coordinates hidden and scored), ``plots`` (sample pictures).

Legend: L particles, B datasets, N points, I clusters, D data dimensions.
Data ``x``: ``(B, N, D)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from apg.blocks import TaskSpec
from apg.tasks.gmm.conjugate import (
    NormalGamma,
    NormalGammaFromSums,
    assignment_logits,
    assignment_posterior,
    cluster_moments,
    cluster_sums,
    moments_from_sums,
    normal_gamma_from_moments,
    normal_gamma_from_sums,
    normal_gamma_posterior,
)
from apg.tasks.gmm.imputation import IMPUTATION, hidden_coordinates, oracle_imputation
from apg.tasks.gmm.metrics import bayes_assignments
from apg.tasks.gmm.model import GMM, ExactGibbs, GMMConfig, build_model, one_hot_points_last, sample_data
from apg.tasks.gmm.plots import draw
from apg.tasks.gmm.proposals import (
    C_INPUTS,
    GLOBALS_INITS,
    AssignmentProposal,
    GlobalsProposal,
    GMMProposals,
    build_proposals,
)


def simulate(
    model: GMM, num_datasets: int, generator: torch.Generator, num_points: int = 60
) -> dict[str, Tensor]:
    return model.simulate(num_datasets, num_points, generator)


TASK = TaskSpec(
    "gmm",
    build_model,
    build_proposals,
    simulate,
    ("apg", "mlp", "lstm"),
    ("N", "D"),
    exact_gibbs=ExactGibbs,
    sample_data=sample_data,
    draw=draw,
    assignment_ceiling=bayes_assignments,
    imputation=IMPUTATION,
)

__all__ = [
    "C_INPUTS",
    "GLOBALS_INITS",
    "GMM",
    "IMPUTATION",
    "TASK",
    "AssignmentProposal",
    "ExactGibbs",
    "GMMConfig",
    "GMMProposals",
    "GlobalsProposal",
    "NormalGamma",
    "NormalGammaFromSums",
    "assignment_logits",
    "assignment_posterior",
    "bayes_assignments",
    "build_model",
    "build_proposals",
    "cluster_moments",
    "cluster_sums",
    "draw",
    "hidden_coordinates",
    "moments_from_sums",
    "normal_gamma_from_moments",
    "normal_gamma_from_sums",
    "normal_gamma_posterior",
    "one_hot_points_last",
    "oracle_imputation",
    "sample_data",
    "simulate",
]
