"""Continuous-latent views of a model, for the gradient-based baselines (HMC, reparam).

HMC and stochastic backpropagation need a density over *unconstrained, continuous*
latents. Where the model's discrete latents can be summed out of the likelihood (the
GMM's and the rings' assignments: a log-sum-exp over clusters per point), the view is the
marginal ``log p(x, z_cont)``, and the discrete latents are drawn afterwards from their
exact conditional, so that every method reports the same ``log p(x, z)``.

Unconstrained latents come in two kinds: per dataset (``event_shapes``, e.g. the
cluster parameters, ``(L, B, *event)``) and per point (``point_shapes``, e.g. the rings'
angles, ``(L, B, N, *point)``, whose number follows the dataset's N).

A view is looked up by the model's type (``continuous_target``); a task gains the
gradient-based baselines by registering one (``register_target``).

Legend: L particles, B datasets, N points, I clusters, D data dimensions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from apg.blocks import Latents, Model
from apg.distributions import CategoricalBlock
from apg.tasks.dgmm import DGMM, TWO_PI
from apg.tasks.gmm import GMM, assignment_logits


class ContinuousTarget(Protocol):
    """The interface HMC-RWS and the reparameterized recognition model use.

    ``event_shapes``: unconstrained per-dataset variable -> shape of one dataset's value,
    held as ``(L, B, *event)``.
    ``point_shapes``: unconstrained per-point variable -> shape of one point's value, held
    as ``(L, B, N, *point)`` with the N of the data (empty when there are none).
    ``point_dim``: features per point of ``points(x)``.
    """

    event_shapes: dict[str, tuple[int, ...]]
    point_shapes: dict[str, tuple[int, ...]]
    point_dim: int

    def points(self, x: Tensor) -> Tensor:
        """The data as a set of points ``(B, N, point_dim)`` (the recognition model's input)."""
        ...

    def to_unconstrained(self, z: Mapping[str, Tensor]) -> Latents:
        """Unconstrained values (``(L, B, *event)``, ``(L, B, N, *point)``) of the model's
        continuous latents."""
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
        self.event_shapes: dict[str, tuple[int, ...]] = {
            "mu": (cfg.num_clusters, cfg.data_dim),
            "log_tau": (cfg.num_clusters, cfg.data_dim),
        }
        self.point_shapes: dict[str, tuple[int, ...]] = {}
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


class DGMMTarget:
    """The rings (DGMM) with assignments summed out: ``u = {mu (L, B, I, 2), logit_alpha (L, B, N)}``.

    Angles are mapped onto the prior's support by ``alpha = 2 pi sigmoid(logit_alpha)``, a
    smooth bijection from the real line onto ``(0, 2 pi)`` (the support up to the null
    point 0) with ``log |d alpha / d logit_alpha| = log 2 pi + log sigmoid(a) + log
    sigmoid(-a)``. It puts a seam at angle 0 = 2 pi: an angle whose posterior straddles it
    is two far-apart modes in ``logit_alpha``, which HMC cannot cross and a Gaussian
    recognition model covers with one of them. No bijection from the real line onto the
    circle avoids a seam; moving on the circle itself (``alpha = a mod 2 pi``) would, but
    then the reparameterized density ``q(alpha)`` is a wrapped normal, an infinite sum.

    The marginal likelihood of a point, with ``c_n ~ Cat(1 / I)``:

        log p(x_n | mu, alpha_n) = logsumexp_i [log(1/I) + log N(x_n; g_theta(alpha_n) + mu_i, sigma_eps^2 I)]

    ``g_theta`` and both priors are the model's own (``DGMM.g``, ``log_prior_mu``,
    ``log_prior_local``); the density is differentiable in ``u`` and in theta.
    """

    def __init__(self, model: DGMM):
        self.model = model
        cfg = model.cfg
        self.event_shapes: dict[str, tuple[int, ...]] = {"mu": (cfg.num_clusters, 2)}
        self.point_shapes: dict[str, tuple[int, ...]] = {"logit_alpha": ()}
        self.point_dim = 2

    def points(self, x: Tensor) -> Tensor:
        return x / self.model.cfg.sigma0  # O(1) inputs for the recognition model's tanh units

    def angle(self, logit_alpha: Tensor) -> Tensor:
        """``2 pi sigmoid(logit_alpha)`` in ``[0, 2 pi)``, any shape."""
        alpha = TWO_PI * torch.sigmoid(logit_alpha)
        # sigmoid rounds to 1 for large arguments (float32: above ~17), giving 2 pi itself,
        # where the prior density is zero; that point of the circle is angle 0, and g_theta
        # (periodic) and its gradient are the same there.
        return torch.where(alpha >= TWO_PI, alpha - TWO_PI, alpha)

    def to_unconstrained(self, z: Mapping[str, Tensor]) -> Latents:
        frac = z["alpha"] / TWO_PI
        # Angle 0 (and a rounded 2 pi) would map to -inf (+inf): keep it one ulp inside.
        eps = torch.finfo(frac.dtype).eps
        return {"mu": z["mu"], "logit_alpha": torch.logit(frac.clamp(eps, 1.0 - eps))}

    def log_det_jacobian(self, u: Mapping[str, Tensor]) -> Tensor:
        a = u["logit_alpha"]
        return (math.log(TWO_PI) + F.logsigmoid(a) + F.logsigmoid(-a)).sum(-1)

    def cluster_log_likelihood(self, x: Tensor, mu: Tensor, alpha: Tensor) -> Tensor:
        """``log N(x_n; g_theta(alpha_n) + mu_i, sigma_eps^2 I)`` for every point and
        cluster, ``(L, B, N, I)``."""
        if x.dim() != 3 or x.shape[-1] != 2:
            raise ValueError(f"x must be shaped (B, N, 2), got {tuple(x.shape)}")
        s = self.model.cfg.noise
        resid = (x - self.model.g(alpha)).unsqueeze(-2) - mu.unsqueeze(-3)  # (L, B, N, I, 2)
        return -0.5 * (resid**2).sum(-1) / s**2 - 2 * (math.log(s) + 0.5 * math.log(TWO_PI))

    def log_density(self, x: Tensor, u: Mapping[str, Tensor]) -> Tensor:
        mu, alpha = u["mu"], self.angle(u["logit_alpha"])
        # sum_n log p(alpha_n) + log(1/I): the model's local prior at any c (c is uniform).
        log_prior = self.model.log_prior_mu(mu) + self.model.log_prior_local(x, {"alpha": alpha})
        log_lik = torch.logsumexp(self.cluster_log_likelihood(x, mu, alpha), -1).sum(-1)
        return log_prior + log_lik + self.log_det_jacobian(u)

    def complete(self, x: Tensor, u: Mapping[str, Tensor]) -> tuple[Latents, Tensor]:
        mu, alpha = u["mu"], self.angle(u["logit_alpha"])
        # p(c_n = i | x_n, mu, alpha_n) is proportional to the cluster's likelihood (uniform prior).
        assign = CategoricalBlock("c", self.cluster_log_likelihood(x, mu, alpha))
        c = assign.sample()
        return {"mu": mu, "alpha": alpha, **c}, assign.log_prob(c)


# A factory takes a model of its key's type (``Callable[[Model], ...]`` would refuse GMMTarget,
# whose argument is a GMM).
TARGETS: dict[type, Callable[[Any], ContinuousTarget]] = {GMM: GMMTarget, DGMM: DGMMTarget}


def register_target(model_type: type, factory: Callable[[Any], ContinuousTarget]) -> None:
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
