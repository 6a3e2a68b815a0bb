"""The GMM's conjugate pieces: the NormalGamma family over the globals ``{mu, tau}``
(prior, exact conditional, and the neural proposals' conjugate form), the clusters' moments
and the exact assignment logits.

Legend: L particles, B datasets, N points, I clusters, D data dimensions.
Latents: ``mu``, ``tau`` shaped ``(L, B, I, D)``; ``c`` shaped ``(L, B, N)`` (long).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from apg.blocks import Latents, propose_separately
from apg.distributions import CategoricalBlock
from apg.kernels import call, native_function
from apg.random import new_key, standard_gamma

if TYPE_CHECKING:
    from apg.tasks.gmm.model import GMMConfig

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


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
        if native is None or sizes is None:  # sizes is None only where native is
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
        if native is None or sizes is None or mu_old.shape != sizes[:4] or tau_old.shape != sizes[:4]:
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
        if native is None or sizes is None or mu.shape != tau.shape or mu.shape != sizes[:4]:
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


def assignment_posterior(logits: Tensor) -> CategoricalBlock:
    """A categorical block distribution over ``c`` from logits ``(L, B, N, I)``."""
    return CategoricalBlock("c", logits)
