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

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from apg.blocks import Latents, Model, Proposals, TaskSpec, propose_separately
from apg.distributions import CategoricalBlock
from apg.kernels import call, native_function
from apg.nn import PointFeatures, pairwise_tanh_linear, scaled_pairwise_tanh_linear
from apg.random import new_key, standard_gamma

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


@dataclass(frozen=True)
class GMMConfig:
    """Hyperparameters of the model (paper defaults; the authors' code used nu0 = 0.1)."""

    num_clusters: int = 3
    data_dim: int = 2
    mu0: float = 0.0
    nu0: float = 0.3
    alpha0: float = 2.0
    beta0: float = 2.0


class NormalGamma:
    """Diagonal NormalGamma over ``{mu, tau}``; parameters broadcast to ``(L, B, I, D)``."""

    def __init__(self, mu: Tensor, nu: Tensor, alpha: Tensor, beta: Tensor):
        self.mu, self.nu, self.alpha, self.beta = mu, nu, alpha, beta

    def sample(self) -> Latents:
        # Draws, not reparameterized samples (BlockDistribution). A with-block, not the
        # decorator: torch.compile cannot call a decorated method of an object made in the graph.
        with torch.no_grad():
            shape = torch.broadcast_shapes(*(p.shape for p in (self.mu, self.nu, self.alpha, self.beta)))
            # clamped as torch's Gamma does: a tiny shape can round a draw to 0
            tiny = torch.finfo(self.beta.dtype).tiny
            tau = (standard_gamma(self.alpha.expand(shape)) / self.beta).clamp_min(tiny)
            mu = self.mu + torch.randn(shape, dtype=tau.dtype, device=tau.device) * torch.rsqrt(self.nu * tau)
        return {"mu": mu, "tau": tau}

    def log_prob(self, value: Mapping[str, Tensor]) -> Tensor:
        mu, tau = value["mu"], value["tau"]
        params = (self.mu, self.nu, self.alpha, self.beta)
        native = _native_log_prob(*params, mu, tau)
        if native is not None:
            shape = torch.broadcast_shapes(*(t.shape for t in (*params, mu, tau)))
            args = (t if t.shape == shape else t.expand(shape) for t in (*params, mu, tau))
            return _NormalGammaLogProb.apply(*args, *native)
        # Gamma(tau; alpha, beta) Normal(mu; m, 1 / (nu tau)), with the log tau terms merged
        log_density = (
            self.alpha * torch.log(self.beta)
            - torch.lgamma(self.alpha)
            + 0.5 * torch.log(self.nu)
            + (self.alpha - 0.5) * torch.log(tau)
            - tau * (self.beta + 0.5 * self.nu * (mu - self.mu) ** 2)
        )
        return log_density.sum(dim=(-2, -1)) - _HALF_LOG_2PI * mu.shape[-2] * mu.shape[-1]

    def expand(self, num_particles: int) -> NormalGamma:
        """Add a leading particle dim to parameters shaped ``(B, I, D)``."""
        shape = (num_particles, *self.mu.shape)
        return NormalGamma(*(p.expand(shape) for p in (self.mu, self.nu, self.alpha, self.beta)))


def _native_log_prob(*tensors: Tensor):
    """The compiled ``NormalGamma.log_prob`` ``(forward, backward)`` where it applies: CPU
    tensors of one floating dtype with at least the ``(I, D)`` event dims."""
    if any(t.dim() < 2 for t in tensors):
        return None
    forward = native_function("gmm_ng_log_prob", *tensors)
    return None if forward is None else (forward, native_function("gmm_ng_log_prob_backward", *tensors))


class _NormalGammaLogProb(torch.autograd.Function):
    """``NormalGamma.log_prob`` in one compiled pass, differentiable in the parameters
    ``(m, nu, alpha, beta)`` and the values ``(mu, tau)``, all shaped ``(..., I, D)``."""

    @staticmethod
    def forward(ctx, m, nu, alpha, beta, mu, tau, forward_fn, backward_fn):
        inputs = tuple(t.contiguous() for t in (m, nu, alpha, beta, mu, tau))
        cells = mu.shape[-2] * mu.shape[-1]
        out = mu.new_empty(mu.shape[:-2])
        ctx.sizes = (out.numel(), cells)
        call(forward_fn, *inputs, out, *ctx.sizes)
        ctx.save_for_backward(*inputs)
        ctx.backward_fn = backward_fn
        return out

    @staticmethod
    def backward(ctx, grad):
        inputs = ctx.saved_tensors
        grads = [torch.empty_like(t) for t in inputs]
        call(ctx.backward_fn, *inputs, grad.contiguous(), *grads, *ctx.sizes)
        return (*grads, None, None)


class NormalGammaFromSums:
    """``normal_gamma_from_moments(cfg, *moments_from_sums(sums))`` with the conjugate update,
    the draws and the log-density each one compiled pass (``apg/kernels/gmm.c``).

    ``sums``: per-cluster ``(sum r, sum r t, sum r t^2)``, ``(L, B, I, 1 + 2D)``, or
    ``(B, I, 1 + 2D)`` before ``expand``. In eager PyTorch the update and the log-density
    are ~40 small ops on ``(L, B, I, D)`` tensors, and as many in the backward, at every
    globals update; here the log-density's backward goes straight to the sums. Where the
    shapes do not fit, ``twin()`` (the PyTorch formulas) runs instead.
    """

    def __init__(self, cfg: GMMConfig, sums: Tensor, num_particles: int | None = None):
        self.cfg, self.sums, self.num_particles = cfg, sums, num_particles

    def twin(self) -> NormalGamma:
        """The same distribution as a ``NormalGamma`` of PyTorch-computed parameters."""
        q = normal_gamma_from_moments(self.cfg, *moments_from_sums(self.sums))
        return q if self.num_particles is None else q.expand(self.num_particles)

    mu = property(lambda self: self.twin().mu)
    nu = property(lambda self: self.twin().nu)
    alpha = property(lambda self: self.twin().alpha)
    beta = property(lambda self: self.twin().beta)

    def expand(self, num_particles: int) -> NormalGammaFromSums:
        """Add a leading particle dim to sums shaped ``(B, I, 1 + 2D)``."""
        if self.num_particles is not None:
            raise ValueError("already expanded")
        return NormalGammaFromSums(self.cfg, self.sums, num_particles)

    def _sizes(self) -> tuple[int, ...] | None:
        """``(L, B, I, D, per_particle)`` for the compiled passes, or ``None`` for the twin."""
        sums = self.sums
        per_particle = self.num_particles is None
        if sums.dim() != (4 if per_particle else 3):
            return None
        (*grid, clusters, width) = sums.shape if per_particle else (self.num_particles, *sums.shape)
        return (*grid, clusters, (width - 1) // 2, int(per_particle))

    def sample(self) -> Latents:
        sizes, sums = self._sizes(), self.sums.detach()
        native = None if sizes is None else native_function("gmm_ng_sums_sample", sums)
        if native is None:
            return self.twin().sample()
        # the draws NormalGamma.sample makes, in the same order and shapes: the Gamma draws'
        # key (apg.random.standard_gamma), then torch's standard normals
        key = new_key()
        mu = torch.randn(sizes[:4], dtype=sums.dtype)
        tau = torch.empty_like(mu)
        call(native, sums, _consts(self.cfg, sums.dtype), key, mu, tau, *sizes)
        return {"mu": mu, "tau": tau}

    def propose(self, old: Mapping[str, Tensor]) -> tuple[Latents, Tensor, Tensor]:
        """``apg.blocks.propose``: on CPU the draw and both log-densities are one call."""
        mu_old, tau_old = old["mu"], old["tau"]
        sizes, sums = self._sizes(), self.sums
        native = None if sizes is None else native_function("gmm_ng_sums_propose", sums, mu_old, tau_old)
        if native is None or mu_old.shape != sizes[:4] or tau_old.shape != sizes[:4]:
            return propose_separately(self, old)
        backward = native_function("gmm_ng_sums_log_prob_backward", sums)
        consts = _consts(self.cfg, sums.dtype)
        key = new_key()  # the Gamma draws' key, first, as in sample()
        parts = _NormalGammaSumsPropose.apply(sums, mu_old, tau_old, key, consts, sizes, native, backward)
        lp_new, mu, tau, lp_old = parts
        return {"mu": mu, "tau": tau}, lp_new, lp_old

    def log_prob(self, value: Mapping[str, Tensor]) -> Tensor:
        mu, tau = value["mu"], value["tau"]
        sizes = self._sizes()
        native = None if sizes is None else native_function("gmm_ng_sums_log_prob", self.sums, mu, tau)
        if native is None or mu.shape != tau.shape or mu.shape != sizes[:4]:
            return self.twin().log_prob(value)
        backward = native_function("gmm_ng_sums_log_prob_backward", mu)
        consts = _consts(self.cfg, mu.dtype)
        return _NormalGammaSumsLogProb.apply(self.sums, mu, tau, consts, sizes, native, backward)


class _NormalGammaSumsPropose(torch.autograd.Function):
    """``NormalGammaFromSums.propose``: the draw and the log-densities of the new and the old
    values, ``(L, B)`` each, in one compiled call (``gmm_ng_sums_propose``); differentiable in
    the sums through the new values' log-density only."""

    @staticmethod
    def forward(ctx, sums, mu_old, tau_old, key, consts, sizes, forward_fn, backward_fn):
        sums, mu_old, tau_old = (t.contiguous() for t in (sums, mu_old, tau_old))
        # drawn here, after the Gamma draws' key: the order NormalGamma.sample draws in
        mu = torch.randn(sizes[:4], dtype=sums.dtype)
        tau = torch.empty_like(mu)
        lp_new, lp_old = (mu.new_empty(sizes[:2]) for _ in range(2))
        call(forward_fn, sums, consts, key, mu, tau, mu_old, tau_old, lp_new, lp_old, *sizes)
        ctx.save_for_backward(sums, mu, tau, consts)
        ctx.mark_non_differentiable(mu, tau, lp_old)
        ctx.sizes, ctx.backward_fn = sizes, backward_fn
        return lp_new, mu, tau, lp_old

    @staticmethod
    def backward(ctx, grad, _grad_mu, _grad_tau, _grad_old):
        sums, mu, tau, consts = ctx.saved_tensors
        grad_sums = torch.zeros_like(sums)
        grad_mu, grad_tau = torch.empty_like(mu), torch.empty_like(tau)
        inputs = (sums, consts, mu, tau, grad.contiguous())
        call(ctx.backward_fn, *inputs, grad_sums, grad_mu, grad_tau, *ctx.sizes)
        return grad_sums, None, None, None, None, None, None, None


@functools.cache
def _consts(cfg: GMMConfig, dtype: torch.dtype) -> Tensor:
    """The prior's ``(alpha0, beta0, nu0, mu0)`` for the compiled kernels (CPU, read-only)."""
    return torch.tensor([cfg.alpha0, cfg.beta0, cfg.nu0, cfg.mu0], dtype=dtype)


class _NormalGammaSumsLogProb(torch.autograd.Function):
    """``NormalGammaFromSums.log_prob``: one compiled pass from the sums and values to
    ``(L, B)``, differentiable in the sums and the values."""

    @staticmethod
    def forward(ctx, sums, mu, tau, consts, sizes, forward_fn, backward_fn):
        sums, mu, tau = (t.contiguous() for t in (sums, mu, tau))
        out = mu.new_empty(sizes[:2])
        call(forward_fn, sums, consts, mu, tau, out, *sizes)
        ctx.save_for_backward(sums, mu, tau, consts)
        ctx.sizes, ctx.backward_fn = sizes, backward_fn
        return out

    @staticmethod
    def backward(ctx, grad):
        sums, mu, tau, consts = ctx.saved_tensors
        grad_sums = torch.zeros_like(sums)
        grad_mu, grad_tau = torch.empty_like(mu), torch.empty_like(tau)
        inputs = (sums, consts, mu, tau, grad.contiguous())
        call(ctx.backward_fn, *inputs, grad_sums, grad_mu, grad_tau, *ctx.sizes)
        return grad_sums, grad_mu, grad_tau, None, None, None, None


def cluster_moments(resp: Tensor, stats: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-cluster (soft) count ``(..., I, 1)``, mean and within-cluster scatter ``(..., I, D)``.

    ``resp``: ``(..., N, I)`` assignment weights (one-hot for hard assignments); ``stats``:
    ``(..., N, D)`` point statistics. The scatter ``sum_n r_ni (t_n - mean_i)^2`` comes from
    sums (one matrix product with ``[1, t, t^2]``, instead of an ``(..., N, I, D)`` tensor),
    clamped because round-off can make it slightly negative. An empty cluster has count,
    mean and scatter 0.

    Works point-axis-last (``(..., I, N)``, ``(..., D, N)``): callers that hold those
    layouts pass transposed views and nothing is copied (see ``assignment_logits``).
    """
    return moments_from_sums(cluster_sums(resp, stats))


def cluster_sums(resp: Tensor, stats: Tensor) -> Tensor:
    """Per-cluster ``(sum r, sum r t, sum r t^2)`` ``(..., I, 1 + 2D)`` (see ``cluster_moments``)."""
    stats_t = stats.transpose(-1, -2)  # (..., D, N)
    ones = stats_t.new_ones(()).expand(*stats_t.shape[:-2], 1, stats_t.shape[-1])
    moments_t = torch.cat([ones, stats_t, stats_t * stats_t], -2)  # (..., 1 + 2D, N)
    return resp.transpose(-1, -2) @ moments_t.transpose(-1, -2)


def moments_from_sums(sums: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``cluster_moments`` from the sums ``(sum r, sum r t, sum r t^2)`` ``(..., I, 1 + 2D)``."""
    dim = (sums.shape[-1] - 1) // 2
    count, s1, s2 = sums[..., :1], sums[..., 1 : 1 + dim], sums[..., 1 + dim :]
    mean = s1 / count.clamp_min(1e-12)
    return count, mean, (s2 - s1 * mean).clamp_min(0.0)


def normal_gamma_posterior(cfg: GMMConfig, resp: Tensor, stats: Tensor) -> NormalGamma | NormalGammaFromSums:
    """Conjugate NormalGamma update from (soft) assignments and point statistics.

    ``resp``: ``(..., N, I)`` assignment weights (one-hot for the exact conditional);
    ``stats``: ``(..., N, D)`` point statistics (``x`` itself for the exact conditional).
    Returns parameters ``(..., I, D)``. Written with centred sums (``cluster_moments``), so
    an empty cluster (zero weight) gets exactly the prior and ``beta`` never drops below
    ``beta0``. Written from the standard NormalGamma formulas (not the authors' code, whose
    mean term used the prior's nu in place of its mu).
    """
    return normal_gamma_from_sums(cfg, cluster_sums(resp, stats))


def normal_gamma_from_sums(cfg: GMMConfig, sums: Tensor) -> NormalGamma | NormalGammaFromSums:
    """``normal_gamma_posterior`` from the per-cluster sums ``(..., I, 1 + 2D)``: compiled
    (``NormalGammaFromSums``) where the kernels apply, else the PyTorch formulas."""
    if sums.dim() in (3, 4) and native_function("gmm_ng_sums_log_prob", sums) is not None:
        return NormalGammaFromSums(cfg, sums)
    return normal_gamma_from_moments(cfg, *moments_from_sums(sums))


def normal_gamma_from_moments(cfg: GMMConfig, count: Tensor, mean: Tensor, scatter: Tensor) -> NormalGamma:
    """``normal_gamma_posterior`` from the (soft) ``cluster_moments``."""
    nu = cfg.nu0 + count
    mu = (cfg.nu0 * cfg.mu0 + count * mean) / nu
    alpha = cfg.alpha0 + 0.5 * count
    beta = cfg.beta0 + 0.5 * scatter + 0.5 * cfg.nu0 * count * (mean - cfg.mu0) ** 2 / nu
    return NormalGamma(mu, nu.expand_as(mu), alpha.expand_as(mu), beta)


def assignment_logits(x: Tensor, mu: Tensor, tau: Tensor) -> Tensor:
    """Exact ``log p(c_n = i | x_n, mu, tau)`` up to a constant, ``(L, B, N, I)``.

    Computed as ``(L, B, I, N)`` and returned as a transposed view: with the point axis
    innermost, every broadcast op runs over contiguous rows of N; with the cluster axis
    innermost (rows of 3) this build runs the same ops ~2x slower. One pass per data
    dimension, because summing away a trailing D axis of 2 is slower still.
    """
    out = 0.5 * torch.log(tau).sum(-1).unsqueeze(-1)  # (L, B, I, 1)
    x_t = x.transpose(-1, -2)  # (B, D, N)
    for d in range(x.shape[-1]):
        diff = x_t[..., d, :].unsqueeze(-2) - mu[..., d].unsqueeze(-1)  # (L, B, I, N)
        out = torch.addcmul(out, -0.5 * tau[..., d].unsqueeze(-1), diff * diff)
    return out.transpose(-1, -2)


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
            native = self._native("gmm_assignment_change", x, z_new["mu"], z_new["tau"])
            if native is not None:
                out = x.new_empty(z_new["c"].shape[:2])
                call(native, x, z_new["mu"], z_new["tau"], z_new["c"], z_old["c"], out, *self._sizes(x, out))
                return out
            table = assignment_logits(x, z_new["mu"], z_new["tau"]).transpose(-1, -2)  # (L, B, I, N)
            # Two gathers from the contiguous layout; one gather with a stacked (..., 2)
            # index takes a path 5x slower.
            new, old = (table.gather(-2, z["c"].unsqueeze(-2)).sum((-2, -1)) for z in (z_new, z_old))
            return new - old
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
        fits = len(globals_) <= 2 and all(t.shape == mu.shape for pair in globals_ for t in pair)
        native = self._native("gmm_log_globals", x, mu, tau) if fits else None
        if native is None or (len(globals_) == 2 and self._native("gmm_log_globals", x, mu2, tau2) is None):
            moments = self.assignment_moments(x, c)
            return [self._log_globals(m, t, moments) for m, t in globals_]
        outs = [x.new_empty(mu.shape[:2]) for _ in globals_]
        consts = _consts(self.cfg, x.dtype)
        call(native, x, c, mu, tau, mu2, tau2, consts, outs[0], outs[-1], len(outs), *self._sizes(x, outs[0]))
        return outs

    def _native(self, name: str, x: Tensor, mu: Tensor, tau: Tensor):
        """The compiled kernel ``name`` (``apg/kernels/gmm.c``) where it applies: unbatched
        data ``(B, N, D)``, latents ``(L, B, I, D)`` and nothing asking for a gradient (the
        model has no parameters, but HMC differentiates in the latents)."""
        if x.dim() != 3 or mu.dim() != 4 or self.cfg.num_clusters * self.cfg.data_dim > 256:
            return None
        if torch.is_grad_enabled() and (x.requires_grad or mu.requires_grad or tau.requires_grad):
            return None
        return native_function(name, x, mu, tau)

    def _sizes(self, x: Tensor, out: Tensor) -> tuple[int, ...]:
        """``(L, B, N, I, D)`` for the compiled kernels, from data ``x`` and an ``(L, B)`` output."""
        return (*out.shape, x.shape[1], self.cfg.num_clusters, self.cfg.data_dim)

    def assignment_moments(self, x: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``cluster_moments`` of the data ``x (B, N, D)`` under hard assignments ``c (L, B, N)``."""
        # One-hot as (L, B, I, N), the layout the matrix product reads (``assignment_logits``).
        return cluster_moments(one_hot_points_last(c, self.cfg.num_clusters, x.dtype).transpose(-1, -2), x)

    def _log_globals(
        self, mu: Tensor, tau: Tensor, moments: tuple[Tensor, Tensor, Tensor], prior: bool = True
    ) -> Tensor:
        """``log p(mu, tau)`` (when ``prior``) plus ``sum_n log N(x_n; mu_{c_n}, 1/tau_{c_n})``
        without its ``-N D log(2 pi) / 2``, from the assignments' ``cluster_moments``, ``(L, B)``.

        Per cluster and dimension, ``sum_n (x_n - mu)^2 = scatter + count (mean - mu)^2``.
        """
        count, mean, scatter = moments
        cfg = self.cfg
        squares = scatter + count * (mean - mu) ** 2
        if not prior:
            return 0.5 * (count * torch.log(tau) - tau * squares).sum((-2, -1))
        log_density = (cfg.alpha0 - 0.5 + 0.5 * count) * torch.log(tau) - tau * (
            cfg.beta0 + 0.5 * cfg.nu0 * (mu - cfg.mu0) ** 2 + 0.5 * squares
        )
        return log_density.sum((-2, -1)) + self._prior_const(mu.shape[-2:])

    def _prior_const(self, cells: tuple[int, int]) -> float:
        """The NormalGamma prior's constant, summed over ``cells = (I, D)``."""
        cfg = self.cfg
        const = cfg.alpha0 * math.log(cfg.beta0) - math.lgamma(cfg.alpha0) + 0.5 * math.log(cfg.nu0)
        return (const - _HALF_LOG_2PI) * cells[0] * cells[1]

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


def assignment_posterior(logits: Tensor) -> CategoricalBlock:
    """A categorical block distribution over ``c`` from logits ``(L, B, N, I)``."""
    return CategoricalBlock("c", logits)


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

    def kernel(self, block: str, x: Tensor, z: Mapping[str, Tensor]):
        cfg = self.model.cfg
        if block == "globals":
            resp = F.one_hot(z["c"], cfg.num_clusters).to(x.dtype)
            return normal_gamma_posterior(cfg, resp, x.expand(resp.shape[0], *x.shape))
        if block == "c":
            return assignment_posterior(assignment_logits(x, z["mu"], z["tau"]))
        raise ValueError(f"unknown block {block!r}")


# --------------------------------------------------------------------------- networks


class GlobalsProposal(nn.Module):
    """Neural sufficient statistics for {mu, tau} (section 3, eq. 10).

    Each point contributes soft assignments ``gamma_n`` (softmax over I) and a learned
    statistic ``t_n`` (D dims); their sums enter the conjugate NormalGamma update in place
    of the counts and sums of the exact conditional. The posterior therefore sharpens as
    a cluster collects points, for any dataset size N.
    """

    def __init__(self, cfg: GMMConfig, in_dim: int, features: str, hidden: int = 32):
        super().__init__()
        self.cfg = cfg
        self.features = PointFeatures(features, in_dim, hidden)
        self.resp = nn.Linear(self.features.out_dim, cfg.num_clusters)
        self.stat = nn.Linear(self.features.out_dim, cfg.data_dim)
        if features == "linear":
            # Start from the conjugate update with uniform assignments and t_n = x_n: a broad
            # proposal around the data (section 3 suggests initializing the statistics so
            # that the first proposals are close to the prior's breadth), rather than one
            # centred wherever a random projection of the data happens to fall.
            nn.init.zeros_(self.resp.weight)
            nn.init.zeros_(self.resp.bias)
            nn.init.zeros_(self.stat.bias)
            with torch.no_grad():
                self.stat.weight.zero_()
                self.stat.weight[:, : cfg.data_dim].copy_(torch.eye(cfg.data_dim))
                if in_dim > cfg.data_dim:
                    # The kernel also reads one-hot assignments: lean (softly) on them, as
                    # the exact update does, so training starts near the conjugate form.
                    self.resp.weight[:, cfg.data_dim :].copy_(2.0 * torch.eye(cfg.num_clusters))

    def heads(self) -> tuple[Tensor, Tensor]:
        """Both heads as one layer: weight ``(I + D, F_in)`` and bias ``(I + D,)``."""
        weight = torch.cat([self.resp.weight, self.stat.weight])
        return weight, torch.cat([self.resp.bias, self.stat.bias])

    def forward(self, u: Tensor) -> NormalGamma | NormalGammaFromSums:
        """The proposal from point inputs ``u (..., N, F_in)`` (for speed, ideally a
        transposed view of a point-axis-last ``(..., F_in, N)`` tensor)."""
        h_t = self.features(u).transpose(-1, -2)  # (..., F, N)
        # Both heads in one product, point axis last: this build multiplies (F, N) blocks
        # several times faster than (N, F) rows of a handful of features, and the softmax
        # over clusters then runs along contiguous rows of N.
        weight, bias = self.heads()
        out = torch.matmul(weight, h_t) + bias.unsqueeze(-1)  # (..., I + D, N)
        num_clusters = self.cfg.num_clusters
        resp_t = torch.softmax(out[..., :num_clusters, :], dim=-2)
        return normal_gamma_posterior(
            self.cfg, resp_t.transpose(-1, -2), out[..., num_clusters:, :].transpose(-1, -2)
        )


C_INPUTS = ("offset", "standardized")


class AssignmentProposal(nn.Module):
    """q(c_n | x_n, mu, tau): an MLP on (x_n - mu_i, log tau_i) gives one logit per cluster.

    ``inputs="standardized"`` gives it (x_n - mu_i) sqrt(tau_i) in place of the offset, the
    point's distance from the centre in the cluster's own units, in which the exact logit,
    sum_d (log tau_id - tau_id (x_nd - mu_id)^2) / 2, is a quadratic of bounded inputs. On
    raw offsets the network must form tau (x - mu)^2 itself, and datasets with a wide cluster
    (small tau, large offsets) fall outside what it learnt, which is where most of its
    inclusive KL of {c} came from (docs/decisions.md, "GMM assignment network reads
    standardized offsets").
    Same layers and width either way (Appendix E's).

    Local neural sufficient statistics (section 3): the logits are the prior's (uniform,
    so a constant) plus ``T(x_n, z_global)``. The inputs are the point's offset from each
    centre and the log precision, on which the exact conditional depends smoothly (log
    because precisions span orders of magnitude). The first layer is split into a per-point
    and a per-cluster part that broadcast against each other, so the (L, B, N, I, H) hidden
    tensor is formed by one addition instead of by expanding and concatenating inputs
    (``apg.nn.pairwise_tanh_linear``, fused with the output layer and a faster backward).
    """

    def __init__(self, cfg: GMMConfig, hidden: int = 32, inputs: str = "offset"):
        super().__init__()
        if inputs not in C_INPUTS:
            raise ValueError(f"unknown assignment-network inputs {inputs!r}; choose {' or '.join(C_INPUTS)}")
        self.inputs = inputs
        self.offset = nn.Linear(cfg.data_dim, hidden)
        self.log_precision = nn.Linear(cfg.data_dim, hidden, bias=False)
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: Tensor, mu: Tensor, tau: Tensor) -> Tensor:
        if self.inputs == "standardized":
            return self._standardized(x, mu, tau)
        weights = (
            self.offset.weight,
            self.offset.bias,
            self.log_precision.weight,
            self.out.weight,
            self.out.bias,
        )
        native = _native_assignment(x, mu, tau, *weights)
        if native is not None:
            return _AssignmentLogits.apply(x, mu, tau, *weights, native)
        # W (x_n - mu_i) + V log tau_i + b = (W x_n + b) + (V log tau_i - W mu_i)
        per_point = self.offset(x)  # (B, N, H)
        per_cluster = self.log_precision(torch.log(tau)) - mu @ self.offset.weight.T  # (L, B, I, H)
        logits = pairwise_tanh_linear(per_point, per_cluster, self.out.weight.T) + self.out.bias
        return logits.squeeze(-1)  # (L, B, N, I)

    def _standardized(self, x: Tensor, mu: Tensor, tau: Tensor) -> Tensor:
        # W ((x_n - mu_i) s_i) + V log tau_i + b = (W s_i) x_n + (V log tau_i - W (mu_i s_i) + b),
        # s_i = sqrt(tau_i): a first layer scaled per cluster, plus a per-cluster part.
        s = tau.sqrt()
        scale = s.unsqueeze(-1) * self.offset.weight.T  # (L, B, I, D, H)
        per_cluster = self.log_precision(torch.log(tau)) - (mu * s) @ self.offset.weight.T + self.offset.bias
        return scaled_pairwise_tanh_linear(x, scale, per_cluster, self.out.weight[0]) + self.out.bias


def _native_assignment(x: Tensor, mu: Tensor, tau: Tensor, *weights: Tensor):
    """The compiled assignment network's functions where they apply: data ``(B, N, D)`` and
    latents ``(L, B, I, D)`` without gradients, one output unit."""
    if x.dim() != 3 or mu.dim() != 4 or tau.shape != mu.shape or weights[3].shape[0] != 1:
        return None
    if mu.shape[-1] > 256 or any(t.requires_grad for t in (x, mu, tau)):
        return None
    names = (
        "gmm_assignment_inputs",
        "pairwise_forward",
        "pairwise_backward",
        "gmm_assignment_inputs_backward",
    )
    fns = tuple(native_function(name, x, mu, tau, *weights) for name in names)
    return None if fns[0] is None else fns


class _AssignmentLogits(torch.autograd.Function):
    """``AssignmentProposal``'s logits ``(L, B, N, I)`` compiled: the first layer's two parts
    (``gmm.c``: ``gmm_assignment_inputs``), the fused pairwise tanh layer (``tanh_layers.c``)
    and the output bias, forward and backward, in a handful of ops instead of ~20 and a
    dozen autograd nodes per assignment update. Differentiable in the five weights."""

    @staticmethod
    def forward(ctx, x, mu, tau, w_off, b_off, w_prec, w_out, b_out, fns):
        x, mu, tau = x.contiguous(), mu.contiguous(), tau.contiguous()
        weights = tuple(t.contiguous() for t in (w_off, b_off, w_prec, w_out))
        (num_particles, batch, clusters, dim), num_points, width = mu.shape, x.shape[1], w_off.shape[0]
        point, cluster = (
            x.new_empty(1, batch, num_points, width),
            x.new_empty(num_particles, batch, clusters, width),
        )
        ctx.sizes = (num_particles, batch, num_points, clusters, dim, width)
        call(fns[0], x, mu, tau, *weights[:3], point, cluster, *ctx.sizes)
        logits = x.new_empty(num_particles, batch, num_points, clusters)
        ctx.pair_sizes = (num_particles, 1, batch, num_points, clusters, width, 1)
        call(fns[1], point, cluster, weights[3], logits, *ctx.pair_sizes)
        ctx.save_for_backward(x, mu, tau, point, cluster, weights[3])
        ctx.fns = fns
        return logits.add_(b_out)

    @staticmethod
    def backward(ctx, grad):
        x, mu, tau, point, cluster, w_out = ctx.saved_tensors
        grad = grad.contiguous()
        grad_point, grad_cluster, grad_w_out = (torch.zeros_like(t) for t in (point, cluster, w_out))
        call(ctx.fns[2], point, cluster, w_out, grad, grad_point, grad_cluster, grad_w_out, *ctx.pair_sizes)
        width, dim = point.shape[-1], mu.shape[-1]
        grad_w_off, grad_b_off, grad_w_prec = (
            x.new_zeros(width, dim),
            x.new_zeros(width),
            x.new_zeros(width, dim),
        )
        inputs = (x, mu, tau, grad_point, grad_cluster, grad_w_off, grad_b_off, grad_w_prec)
        call(ctx.fns[3], *inputs, *ctx.sizes)
        return None, None, None, grad_w_off, grad_b_off, grad_w_prec, grad_w_out, grad.sum().reshape(1), None


class GMMProposals(Proposals):
    """Inference networks for one architecture.

    ``apg``: linear NSS encoder q(mu, tau | x), NSS kernel q(mu, tau | x, c) and the
    assignment kernel q(c | x, mu, tau). ``mlp`` / ``lstm``: RWS encoders whose NSS
    point features come from an MLP or an LSTM; they have no kernels.
    """

    def __init__(self, cfg: GMMConfig, architecture: str = "apg", hidden: int = 32, c_inputs: str = "offset"):
        super().__init__()
        self.cfg = cfg
        self.architecture = architecture
        encoder_features = {"apg": "linear", "mlp": "mlp", "lstm": "lstm"}.get(architecture)
        if encoder_features is None:
            raise ValueError(f"unknown GMM architecture {architecture!r}; choose apg, mlp or lstm")
        self.encoder = GlobalsProposal(cfg, cfg.data_dim, encoder_features, hidden)
        self.assign = AssignmentProposal(cfg, hidden, c_inputs)
        if architecture == "apg":
            self.globals_kernel = GlobalsProposal(cfg, cfg.data_dim + cfg.num_clusters, "linear", hidden)

    def initial(self, x: Tensor, num_particles: int) -> tuple[Latents, Tensor]:
        q_globals = self.encoder(x).expand(num_particles)
        globals_ = q_globals.sample()
        q_c = self.kernel("c", x, globals_)
        c = q_c.sample()
        return {**globals_, **c}, q_globals.log_prob(globals_) + q_c.log_prob(c)

    def kernel(self, block: str, x: Tensor, z: Mapping[str, Tensor]):
        if block == "c":
            return assignment_posterior(self.assign(x, z["mu"], z["tau"]))
        if block == "globals" and self.architecture == "apg":
            c = z["c"]
            heads = self.globals_kernel.resp, self.globals_kernel.stat
            native = _native_soft_moments(x, c, *heads)
            if native is not None:
                weights = (heads[0].weight, heads[0].bias, heads[1].weight, heads[1].bias)
                sums = _SoftMoments.apply(x, c, *weights, *native)
                return normal_gamma_from_sums(self.cfg, sums)
            # Inputs [x_n, one-hot(c_n)], built point-axis-last (see GlobalsProposal.forward).
            one_hot_t = one_hot_points_last(c, self.cfg.num_clusters, x.dtype)
            x_t = x.transpose(-1, -2).expand(c.shape[0], *x.shape[:-2], x.shape[-1], x.shape[-2])
            return self.globals_kernel(torch.cat([x_t, one_hot_t], -2).transpose(-1, -2))
        return super().kernel(block, x, z)


def _native_soft_moments(x: Tensor, c: Tensor, resp: nn.Linear, stat: nn.Linear):
    """The compiled globals-kernel statistics ``(forward, backward)`` (``apg/kernels/gmm.c``)
    where they apply: data ``(B, N, D)`` without a gradient, assignments ``(L, B, N)``, the
    heads ``resp`` (I outputs) and ``stat`` (D outputs) on inputs ``[x_n, one-hot(c_n)]``."""
    num_clusters, dim = resp.out_features, x.shape[-1]
    # the kernel's bound: I + D outputs <= 16 (gmm.c: MAX_OUTPUTS)
    if x.dim() != 3 or c.dim() != 3 or num_clusters + dim > 16:
        return None
    if x.requires_grad or stat.out_features != dim or resp.in_features != dim + num_clusters:
        return None
    forward = native_function("gmm_soft_moments", x, resp.weight, stat.weight)
    return None if forward is None else (forward, native_function("gmm_soft_moments_backward", x))


class _SoftMoments(torch.autograd.Function):
    """The globals kernel's per-cluster sums ``(sum r, sum r t, sum r t^2)`` ``(L, B, I, 1 + 2D)``
    from inputs ``[x_n, one-hot(c_n)]`` (``GlobalsProposal`` with linear features), in one
    compiled pass: no one-hot, no (L, B, I + D, N) outputs. Differentiable in the two heads'
    weights and biases ``(w_resp, b_resp, w_stat, b_stat)``."""

    @staticmethod
    def forward(ctx, x, c, w_resp, b_resp, w_stat, b_stat, forward_fn, backward_fn):
        x, c = x.contiguous(), c.contiguous()
        heads = tuple(t.contiguous() for t in (w_resp, b_resp, w_stat, b_stat))
        (num_particles, batch, num_points), (num_clusters, dim) = c.shape, (w_resp.shape[0], x.shape[-1])
        sums = x.new_zeros(num_particles, batch, num_clusters, 1 + 2 * dim)
        ctx.sizes = (num_particles, batch, num_points, num_clusters, dim)
        call(forward_fn, x, c, *heads, sums, *ctx.sizes)
        ctx.save_for_backward(x, c, *heads)
        ctx.backward_fn = backward_fn
        return sums

    @staticmethod
    def backward(ctx, grad):
        x, c, *heads = ctx.saved_tensors
        grads = [torch.zeros_like(t) for t in heads]
        call(ctx.backward_fn, x, c, *heads, grad.contiguous(), *grads, *ctx.sizes)
        return None, None, *grads, None, None


# --------------------------------------------------------------------------- task spec


def build_model(**hparams) -> GMM:
    return GMM(GMMConfig(**hparams))


def build_proposals(
    model: GMM, architecture: str, hidden: int = 32, c_inputs: str = "offset"
) -> GMMProposals:
    return GMMProposals(model.cfg, architecture, hidden, c_inputs)


def simulate(
    model: GMM, num_datasets: int, generator: torch.Generator, num_points: int = 60
) -> dict[str, Tensor]:
    return model.simulate(num_datasets, num_points, generator)


def sample_data(model: GMM, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
    """``TaskSpec.sample_data``: ``x_n ~ N(mu_{c_n}, 1 / tau_{c_n})`` per coordinate,
    ``(L, B, N, D)`` (the likelihood of ``GMM.log_likelihood``)."""
    index = z["c"].unsqueeze(-1).expand(*z["c"].shape, z["mu"].shape[-1])
    loc, prec = z["mu"].gather(-2, index), z["tau"].gather(-2, index)
    return loc + torch.randn_like(loc) * prec.rsqrt()


def draw(ax, x, z) -> None:
    """``TaskSpec.draw``: points ``x (N, 2)`` coloured by ``z["c"] (N,)``, each cluster's
    mean ``z["mu"] (I, 2)`` and its 2-sd axis-aligned ellipse from ``z["tau"] (I, 2)``."""
    from matplotlib.patches import Ellipse

    c, mu, tau = z["c"], z["mu"], z["tau"]
    colours = [f"C{i % 10}" for i in range(len(mu))]
    ax.scatter(x[:, 0], x[:, 1], s=6, c=[colours[i] for i in c], alpha=0.7, linewidths=0)
    for i, (m, t) in enumerate(zip(mu, tau, strict=True)):
        sd = 1.0 / (t**0.5)
        ax.add_patch(Ellipse(m[:2], 4 * sd[0], 4 * sd[-1], fill=False, color=colours[i], lw=1.0))
        ax.scatter([m[0]], [m[1]], marker="x", color=colours[i], s=30)
    ax.set_aspect("equal")


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
)
