"""Continuous-latent views of a model, for the gradient-based baselines (HMC, reparam).

HMC and stochastic backpropagation need a density over *unconstrained, continuous*
latents. Where the model's discrete latents can be summed out of the likelihood (the GMM
assignments: a log-sum-exp over clusters), the view is the marginal
``log p(x, z_cont)``, and the discrete latents are drawn afterwards from their exact
conditional, so that every method reports the same ``log p(x, z)``.

A view is looked up by the model's type (``continuous_target``); a task gains the
gradient-based baselines by registering one (``register_target``).

Legend: L particles, B datasets, N points, I clusters, D data dimensions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Protocol

import torch
from torch import Tensor

from apg.blocks import Latents, Model
from apg.distributions import CategoricalBlock
from apg.tasks.gmm import GMM, assignment_logits


class ContinuousTarget(Protocol):
    """The interface HMC-RWS and the reparameterized recognition model use.

    ``event_shapes``: unconstrained variable -> shape of one dataset's value.
    ``point_dim``: features per point of ``points(x)``.
    """

    event_shapes: dict[str, tuple[int, ...]]
    point_dim: int

    def points(self, x: Tensor) -> Tensor:
        """The data as a set of points ``(B, N, point_dim)`` (the recognition model's input)."""
        ...

    def to_unconstrained(self, z: Mapping[str, Tensor]) -> Latents:
        """Unconstrained values ``(L, B, *event)`` of the model's continuous latents."""
        ...

    def log_density(self, x: Tensor, u: Mapping[str, Tensor]) -> Tensor:
        """``log p(x, z_cont(u)) + log |dz_cont / du|``, discrete latents summed out, ``(L, B)``;
        differentiable in ``u`` and in the model's parameters."""
        ...

    def log_det_jacobian(self, u: Mapping[str, Tensor]) -> Tensor:
        """``log |dz_cont / du|``, ``(L, B)``."""
        ...

    def complete(self, x: Tensor, u: Mapping[str, Tensor]) -> tuple[Latents, Tensor]:
        """All the model's latents at ``u``, with the discrete ones drawn from their exact
        conditional, and the log-probability of those draws ``(L, B)``. So
        ``log_density(u) - log_det_jacobian(u) + log_prob = log p(x, z)``."""
        ...


class GMMTarget:
    """The GMM with assignments summed out: ``u = {mu, log_tau}``, each ``(L, B, I, D)``."""

    def __init__(self, model: GMM):
        self.model = model
        cfg = model.cfg
        self.event_shapes = {
            "mu": (cfg.num_clusters, cfg.data_dim),
            "log_tau": (cfg.num_clusters, cfg.data_dim),
        }
        self.point_dim = cfg.data_dim

    def points(self, x: Tensor) -> Tensor:
        return x

    def to_unconstrained(self, z: Mapping[str, Tensor]) -> Latents:
        return {"mu": z["mu"], "log_tau": torch.log(z["tau"])}

    def log_det_jacobian(self, u: Mapping[str, Tensor]) -> Tensor:
        return u["log_tau"].sum((-2, -1))  # tau = exp(log_tau)

    def log_density(self, x: Tensor, u: Mapping[str, Tensor]) -> Tensor:
        mu, log_tau = u["mu"], u["log_tau"]
        tau = torch.exp(log_tau)
        prior = self.model.prior_globals(tuple(mu.shape[:2]), x).log_prob({"mu": mu, "tau": tau})
        # log p(x_n | mu, tau) = logsumexp_i [log(1/I) + log N(x_n; mu_i, 1/tau_i)]
        logits = assignment_logits(x, mu, tau)  # (L, B, N, I), without the constants below
        cfg = self.model.cfg
        const = -math.log(cfg.num_clusters) - 0.5 * math.log(2 * math.pi) * cfg.data_dim
        log_lik = (torch.logsumexp(logits, dim=-1) + const).sum(-1)
        return prior + log_lik + self.log_det_jacobian(u)

    def complete(self, x: Tensor, u: Mapping[str, Tensor]) -> tuple[Latents, Tensor]:
        tau = torch.exp(u["log_tau"])
        assign = CategoricalBlock("c", assignment_logits(x, u["mu"], tau))
        c = assign.sample()
        return {"mu": u["mu"], "tau": tau, **c}, assign.log_prob(c)


TARGETS: dict[type, Callable[[Model], ContinuousTarget]] = {GMM: GMMTarget}


def register_target(model_type: type, factory: Callable[[Model], ContinuousTarget]) -> None:
    """Give models of ``model_type`` a continuous view (and so HMC-RWS and reparam)."""
    TARGETS[model_type] = factory


def continuous_target(model: Model) -> ContinuousTarget:
    """The registered view of ``model``; ``ValueError`` when its type has none."""
    for model_type, factory in TARGETS.items():
        if isinstance(model, model_type):
            return factory(model)
    raise ValueError(
        f"{type(model).__name__} has no continuous view with its discrete latents summed out "
        f"(needed by HMC-RWS and reparam); registered: {sorted(t.__name__ for t in TARGETS)}"
    )
