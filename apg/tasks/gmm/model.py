"""Gaussian mixture model (paper section 5.1) with neural-sufficient-statistics proposals.

Generative model, per cluster i and data dimension d (diagonal NormalGamma prior):

    tau_id ~ Gamma(alpha0, rate=beta0),  mu_id | tau_id ~ Normal(mu0, 1 / (nu0 tau_id))
    c_n ~ Cat(uniform),                  x_nd | c_n = i ~ Normal(mu_id, 1 / tau_id)

Blocks: ``globals`` = {mu, tau} and ``c`` = {c}. Both exact Gibbs conditionals are
conjugate and implemented here (``normal_gamma_posterior``, ``assignment_posterior``).

Legend: L particles, B datasets, N points, I clusters, D data dimensions, H hidden units.
Latents: ``mu``, ``tau`` shaped ``(L, B, I, D)``; ``c`` shaped ``(L, B, N)`` (long).
Data ``x``: ``(B, N, D)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from apg.blocks import BlockDistribution, Latents, Model, Proposals
from apg.kernels import call
from apg.kernels.ops import KernelOp
from apg.tasks.gmm.conjugate import (
    _HALF_LOG_2PI,
    NormalGamma,
    _consts_of,
    assignment_logits,
    assignment_posterior,
    cluster_moments,
    normal_gamma_posterior,
)


@dataclass(frozen=True)
class GMMConfig:
    """Hyperparameters of the model (paper defaults; the authors' code used nu0 = 0.1)."""

    num_clusters: int = 3
    data_dim: int = 2
    mu0: float = 0.0
    nu0: float = 0.3
    alpha0: float = 2.0
    beta0: float = 2.0


def one_hot_points_last(c: Tensor, num_clusters: int, dtype: torch.dtype) -> Tensor:
    """One-hot assignments ``c (..., N)`` laid out ``(..., I, N)`` (see ``assignment_logits``)."""
    clusters = torch.arange(num_clusters, device=c.device).unsqueeze(-1)
    return (c.unsqueeze(-2) == clusters).to(dtype)


class GMM(Model):
    """``p(x, mu, tau, c)`` of the module docstring; it has no learnable parameters."""

    blocks = {"globals": ("mu", "tau"), "c": ("c",)}

    def __init__(self, cfg: GMMConfig = GMMConfig()):
        super().__init__()
        self.cfg = cfg

    def prior_globals(self, batch_shape: tuple[int, ...], like: Tensor) -> NormalGamma:
        shape = (*batch_shape, self.cfg.num_clusters, self.cfg.data_dim)
        c = self.cfg
        return NormalGamma(*(like.new_full(shape, v) for v in (c.mu0, c.nu0, c.alpha0, c.beta0)))

    def log_likelihood(self, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
        """``sum_n log N(x_n; mu_{c_n}, 1/tau_{c_n})``, ``(L, B)``."""
        moments = self.assignment_moments(x, z["c"])
        return self._log_globals(z["mu"], z["tau"], moments, prior=False) - self._log_const(x)

    def log_joint(self, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
        log_pi = -math.log(self.cfg.num_clusters) * x.shape[-2]
        (log_globals,) = self._log_globals_under(x, z["c"], (z["mu"], z["tau"]))
        return log_globals + log_pi - self._log_const(x)

    def log_blanket(self, block: str, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
        if block == "c":  # the uniform prior on c is constant
            return self.log_likelihood(x, z)
        return self.log_joint(x, z)

    def log_joint_change(
        self, block: str, x: Tensor, z_old: Mapping[str, Tensor], z_new: Mapping[str, Tensor]
    ) -> Tensor:
        if block == "c":
            # Same globals on both sides: one table of every point's log-density under
            # every cluster, read at the new and the old assignments.
            return assignment_change_op(x, z_new["mu"], z_new["tau"], z_new["c"], z_old["c"])
        if block == "globals":
            # Same assignments on both sides: the data enter only through each cluster's
            # count, mean and scatter, computed once.
            new, old = self._log_globals_under(
                x, z_new["c"], (z_new["mu"], z_new["tau"]), (z_old["mu"], z_old["tau"])
            )
            return new - old
        return super().log_joint_change(block, x, z_old, z_new)

    def _log_globals_under(self, x: Tensor, c: Tensor, *globals_: tuple[Tensor, Tensor]) -> list[Tensor]:
        """``_log_globals`` (prior included) of one or two ``(mu, tau)`` pairs under the same
        assignments ``c``; the assignments' moments are computed once."""
        (mu, tau), (mu2, tau2) = globals_[0], globals_[-1]
        if len(globals_) > 2 or any(t.shape != mu.shape for pair in globals_ for t in pair):
            moments = self.assignment_moments(x, c)
            return [self._log_globals(m, t, moments) for m, t in globals_]
        cfg = self.cfg
        return log_globals_op(
            x, c, mu, tau, mu2, tau2, len(globals_) == 2, cfg.mu0, cfg.nu0, cfg.alpha0, cfg.beta0
        )

    def assignment_moments(self, x: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``cluster_moments`` of the data ``x (B, N, D)`` under hard assignments ``c (L, B, N)``."""
        # One-hot as (L, B, I, N), the layout the matrix product reads (``assignment_logits``).
        return cluster_moments(one_hot_points_last(c, self.cfg.num_clusters, x.dtype).transpose(-1, -2), x)

    def _log_globals(
        self, mu: Tensor, tau: Tensor, moments: tuple[Tensor, Tensor, Tensor], prior: bool = True
    ) -> Tensor:
        """``log p(mu, tau)`` (when ``prior``) plus ``sum_n log N(x_n; mu_{c_n}, 1/tau_{c_n})``
        without its ``-N D log(2 pi) / 2``, from the assignments' ``cluster_moments``, ``(L, B)``."""
        return _log_globals(self.cfg, mu, tau, moments, prior)

    def _log_const(self, x: Tensor) -> float:
        return _HALF_LOG_2PI * x.shape[-2] * x.shape[-1]

    def simulate(self, num_datasets: int, num_points: int, generator: torch.Generator) -> dict[str, Tensor]:
        """Draw ``num_datasets`` datasets of ``num_points`` points from the model.

        Returns ``x (M, N, D)``, ``c (M, N)``, ``mu (M, I, D)``, ``tau (M, I, D)`` (float64 / long).
        """
        c = self.cfg
        shape = (num_datasets, c.num_clusters, c.data_dim)
        tau = (
            torch._standard_gamma(torch.full(shape, c.alpha0, dtype=torch.float64), generator=generator)
            / c.beta0
        )
        mu = c.mu0 + torch.randn(shape, generator=generator, dtype=torch.float64) / torch.sqrt(c.nu0 * tau)
        assign = torch.randint(c.num_clusters, (num_datasets, num_points), generator=generator)
        index = assign.unsqueeze(-1).expand(-1, -1, c.data_dim)
        loc, prec = mu.gather(1, index), tau.gather(1, index)
        noise = torch.randn(loc.shape, generator=generator, dtype=torch.float64)
        return {"x": loc + noise / torch.sqrt(prec), "c": assign, "mu": mu, "tau": tau}


def _log_globals(
    cfg: GMMConfig, mu: Tensor, tau: Tensor, moments: tuple[Tensor, Tensor, Tensor], prior: bool = True
) -> Tensor:
    """``GMM._log_globals`` under the hyperparameters ``cfg``.

    Per cluster and dimension, ``sum_n (x_n - mu)^2 = scatter + count (mean - mu)^2``.
    """
    count, mean, scatter = moments
    squares = scatter + count * (mean - mu) ** 2
    if not prior:
        return 0.5 * (count * torch.log(tau) - tau * squares).sum((-2, -1))
    log_density = (cfg.alpha0 - 0.5 + 0.5 * count) * torch.log(tau) - tau * (
        cfg.beta0 + 0.5 * cfg.nu0 * (mu - cfg.mu0) ** 2 + 0.5 * squares
    )
    return log_density.sum((-2, -1)) + _prior_const(cfg, mu.shape[-2:])


def _prior_const(cfg: GMMConfig, cells: tuple[int, ...]) -> float:
    """The NormalGamma prior's constant, summed over ``cells = (I, D)``."""
    const = cfg.alpha0 * math.log(cfg.beta0) - math.lgamma(cfg.alpha0) + 0.5 * math.log(cfg.nu0)
    return (const - _HALF_LOG_2PI) * cells[0] * cells[1]


def _gmm_applies(x: Tensor, mu: Tensor, *rest: Any) -> bool:
    """Where the compiled kernels (``apg/kernels/gmm.c``) apply: unbatched data
    ``(B, N, D)``, latents ``(L, B, I, D)`` and at most 256 (cluster, dimension) cells."""
    return x.dim() == 3 and mu.dim() == 4 and mu.shape[-2] * x.shape[-1] <= 256


def _sizes(x: Tensor, mu: Tensor, out_shape: torch.Size) -> tuple[int, ...]:
    """``(L, B, N, I, D)`` for the compiled kernels, from data ``x``, latents ``mu`` and an
    ``(L, B)`` output."""
    return (*out_shape, x.shape[1], mu.shape[-2], x.shape[-1])


def _assignment_change_twin(x: Tensor, mu: Tensor, tau: Tensor, c_new: Tensor, c_old: Tensor) -> Tensor:
    table = assignment_logits(x, mu, tau).transpose(-1, -2)  # (L, B, I, N)
    # Two gathers from the contiguous layout; one gather with a stacked (..., 2)
    # index takes a path 5x slower.
    new, old = (table.gather(-2, c.unsqueeze(-2)).sum((-2, -1)) for c in (c_new, c_old))
    return new - old


def _assignment_change_native(fn, x: Tensor, mu: Tensor, tau: Tensor, c_new: Tensor, c_old: Tensor) -> Tensor:
    out = x.new_empty(c_new.shape[:2])
    call(fn, x, mu, tau, c_new, c_old, out, *_sizes(x, mu, out.shape))
    return out


# ``log p(x | c_new, mu, tau) - log p(x | c_old, mu, tau)``, ``(L, B)``: GMM.log_joint_change("c")
assignment_change_op = KernelOp(
    "gmm_assignment_change",
    _assignment_change_twin,
    kernel="gmm_assignment_change",
    native=_assignment_change_native,
    applies=_gmm_applies,
    checked=lambda x, mu, tau, c_new, c_old: (x, mu, tau),
    fake=lambda x, mu, tau, c_new, c_old: x.new_empty(c_new.shape[:2]),
)


def _log_globals_twin(
    x: Tensor,
    c: Tensor,
    mu: Tensor,
    tau: Tensor,
    mu2: Tensor,
    tau2: Tensor,
    two: bool,
    mu0: float,
    nu0: float,
    alpha0: float,
    beta0: float,
) -> list[Tensor]:
    cfg = GMMConfig(mu.shape[-2], x.shape[-1], mu0, nu0, alpha0, beta0)
    moments = cluster_moments(one_hot_points_last(c, cfg.num_clusters, x.dtype).transpose(-1, -2), x)
    return [_log_globals(cfg, m, t, moments) for m, t in ((mu, tau), (mu2, tau2))[: 2 if two else 1]]


def _log_globals_native(
    fn,
    x: Tensor,
    c: Tensor,
    mu: Tensor,
    tau: Tensor,
    mu2: Tensor,
    tau2: Tensor,
    two: bool,
    mu0: float,
    nu0: float,
    alpha0: float,
    beta0: float,
) -> list[Tensor]:
    outs = [x.new_empty(mu.shape[:2]) for _ in range(2 if two else 1)]
    consts = _consts_of(alpha0, beta0, nu0, mu0, x.dtype)
    call(fn, x, c, mu, tau, mu2, tau2, consts, outs[0], outs[-1], len(outs), *_sizes(x, mu, outs[0].shape))
    return outs


# ``GMM._log_globals`` (prior included) of ``(mu, tau)`` and, when ``two``, of ``(mu2, tau2)``
# under assignments ``c`` and the prior ``(mu0, nu0, alpha0, beta0)``: one or two ``(L, B)``.
log_globals_op = KernelOp(
    "gmm_log_globals",
    _log_globals_twin,
    kernel="gmm_log_globals",
    native=_log_globals_native,
    applies=lambda x, c, mu, tau, mu2, tau2, *_: _gmm_applies(x, mu) and mu2.dim() == 4,
    checked=lambda x, c, mu, tau, mu2, tau2, *_: (x, mu, tau, mu2, tau2),
    fake=lambda x, c, mu, tau, mu2, tau2, two, *_: [
        x.new_empty(mu.shape[:2]) for _ in range(2 if two else 1)
    ],
)


class ExactGibbs(Proposals):
    """The exact conditionals as kernels; the initial proposal is the prior on the
    globals followed by the exact assignment conditional."""

    def __init__(self, model: GMM):
        super().__init__()
        self.model = model

    def initial(self, x: Tensor, num_particles: int) -> tuple[Latents, Tensor]:
        prior = self.model.prior_globals((num_particles, x.shape[0]), x)
        globals_ = prior.sample()
        assign = self.kernel("c", x, globals_)
        c = assign.sample()
        return {**globals_, **c}, prior.log_prob(globals_) + assign.log_prob(c)

    def kernel(self, block: str, x: Tensor, z: Mapping[str, Tensor]) -> BlockDistribution:
        cfg = self.model.cfg
        if block == "globals":
            resp = F.one_hot(z["c"], cfg.num_clusters).to(x.dtype)
            return normal_gamma_posterior(cfg, resp, x.expand(resp.shape[0], *x.shape))
        if block == "c":
            return assignment_posterior(assignment_logits(x, z["mu"], z["tau"]))
        raise ValueError(f"unknown block {block!r}")


def build_model(**hparams: Any) -> GMM:
    return GMM(GMMConfig(**hparams))


def sample_data(model: GMM, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
    """``TaskSpec.sample_data``: ``x_n ~ N(mu_{c_n}, 1 / tau_{c_n})`` per coordinate,
    ``(L, B, N, D)`` (the likelihood of ``GMM.log_likelihood``)."""
    index = z["c"].unsqueeze(-1).expand(*z["c"].shape, z["mu"].shape[-1])
    loc, prec = z["mu"].gather(-2, index), z["tau"].gather(-2, index)
    return loc + torch.randn_like(loc) * prec.rsqrt()
