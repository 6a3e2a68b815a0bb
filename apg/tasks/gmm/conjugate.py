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
from apg.host import values_on_host
from apg.kernels import call
from apg.kernels.ops import KernelOp
from apg.random import new_key, philox_standard_gamma_op, standard_gamma

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
        return ng_log_prob_op(self.mu, self.nu, self.alpha, self.beta, value["mu"], value["tau"])

    def expand(self, num_particles: int) -> NormalGamma:
        """Add a leading particle dim to parameters shaped ``(B, I, D)``."""
        shape = (num_particles, *self.mu.shape)
        return NormalGamma(*(p.expand(shape) for p in (self.mu, self.nu, self.alpha, self.beta)))


def _ng_log_density(m: Tensor, nu: Tensor, alpha: Tensor, beta: Tensor, mu: Tensor, tau: Tensor) -> Tensor:
    """``NormalGamma.log_prob``: Gamma(tau; alpha, beta) Normal(mu; m, 1 / (nu tau)), with the
    log tau terms merged, summed over the ``(I, D)`` event dims."""
    log_density = (
        alpha * torch.log(beta)
        - torch.lgamma(alpha)
        + 0.5 * torch.log(nu)
        + (alpha - 0.5) * torch.log(tau)
        - tau * (beta + 0.5 * nu * (mu - m) ** 2)
    )
    return log_density.sum(dim=(-2, -1)) - _HALF_LOG_2PI * mu.shape[-2] * mu.shape[-1]


def _ng_partials(
    m: Tensor, nu: Tensor, alpha: Tensor, beta: Tensor, mu: Tensor, tau: Tensor, grad: Tensor
) -> list[Tensor]:
    """The gradients of ``_ng_log_density`` in its six inputs, at their broadcast shape."""
    g = grad.unsqueeze(-1).unsqueeze(-1)
    diff = mu - m
    return [
        g * tau * nu * diff,
        g * (0.5 / nu - 0.5 * tau * diff * diff),
        g * (torch.log(beta) - torch.digamma(alpha) + torch.log(tau)),
        g * (alpha / beta - tau),
        -g * tau * nu * diff,
        g * ((alpha - 0.5) / tau - (beta + 0.5 * nu * diff * diff)),
    ]


def _expanded(*tensors: Tensor) -> list[Tensor]:
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    return [(t if t.shape == shape else t.expand(shape)).contiguous() for t in tensors]


def _ng_log_prob_native(fn, *tensors: Tensor) -> Tensor:
    inputs = _expanded(*tensors)
    out = inputs[4].new_empty(inputs[4].shape[:-2])
    call(fn, *inputs, out, out.numel(), inputs[4].shape[-2] * inputs[4].shape[-1])
    return out


def _ng_log_prob_backward_twin(
    m: Tensor, nu: Tensor, alpha: Tensor, beta: Tensor, mu: Tensor, tau: Tensor, grad: Tensor
) -> list[Tensor]:
    shape = torch.broadcast_shapes(*(t.shape for t in (m, nu, alpha, beta, mu, tau)))
    return [g.expand(shape).contiguous() for g in _ng_partials(m, nu, alpha, beta, mu, tau, grad)]


def _ng_log_prob_backward_native(
    fn, m: Tensor, nu: Tensor, alpha: Tensor, beta: Tensor, mu: Tensor, tau: Tensor, grad: Tensor
) -> list[Tensor]:
    inputs = _expanded(m, nu, alpha, beta, mu, tau)
    grads = [torch.empty_like(t) for t in inputs]
    call(fn, *inputs, grad.contiguous(), *grads, grad.numel(), inputs[4].shape[-2] * inputs[4].shape[-1])
    return grads


def _ng_fake(*tensors: Tensor) -> Tensor:
    return tensors[4].new_empty(torch.broadcast_shapes(*(t.shape for t in tensors[:6]))[:-2])


def _ng_gradients(ctx, grads, run, wants):
    inputs = ctx.saved_tensors
    return tuple(g.sum_to_size(t.shape) for g, t in zip(run(*inputs, grads[0]), inputs, strict=True))


# ``NormalGamma.log_prob`` ``(...)`` of values ``(mu, tau)`` under parameters ``(m, nu, alpha,
# beta)``, all broadcasting to ``(..., I, D)``; differentiable in all six.
ng_log_prob_op = KernelOp(
    "gmm_ng_log_prob",
    _ng_log_density,
    kernel="gmm_ng_log_prob",
    native=_ng_log_prob_native,
    applies=lambda *tensors: all(t.dim() >= 2 for t in tensors),
    fake=_ng_fake,
    backward=KernelOp(
        "gmm_ng_log_prob_backward",
        _ng_log_prob_backward_twin,
        kernel="gmm_ng_log_prob_backward",
        native=_ng_log_prob_backward_native,
        applies=lambda *tensors: all(t.dim() >= 2 for t in tensors),
        fake=lambda *tensors: [
            tensors[4].new_empty(torch.broadcast_shapes(*(t.shape for t in tensors[:6]))) for _ in range(6)
        ],
    ),
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs),
    gradients=_ng_gradients,
)


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

    def _prior(self) -> tuple[float, float, float, float]:
        cfg = self.cfg
        return cfg.alpha0, cfg.beta0, cfg.nu0, cfg.mu0

    def sample(self) -> Latents:
        sizes, sums = self._sizes(), self.sums.detach()
        if sizes is None or not _philox_draws(sums):
            return self.twin().sample()
        # the draws NormalGamma.sample makes, in the same order and shapes: the Gamma draws'
        # key (apg.random.standard_gamma), then torch's standard normals
        key = new_key()
        noise = torch.randn(sizes[:4], dtype=sums.dtype)
        mu, tau = ng_sums_sample_op(sums, noise, key, *self._prior())
        return {"mu": mu, "tau": tau}

    def propose(self, old: Mapping[str, Tensor]) -> tuple[Latents, Tensor, Tensor]:
        """``apg.blocks.propose``: on CPU the draw and both log-densities are one call."""
        mu_old, tau_old = old["mu"], old["tau"]
        sizes, sums = self._sizes(), self.sums
        if (
            sizes is None
            or not _philox_draws(sums)
            or mu_old.shape != sizes[:4]
            or tau_old.shape != sizes[:4]
        ):
            return propose_separately(self, old)
        key = new_key()  # the Gamma draws' key, first, as in sample()
        noise = torch.randn(sizes[:4], dtype=sums.dtype)
        lp_new, mu, tau, lp_old = ng_sums_propose_op(sums, mu_old, tau_old, noise, key, *self._prior())
        return {"mu": mu, "tau": tau}, lp_new, lp_old

    def log_prob(self, value: Mapping[str, Tensor]) -> Tensor:
        mu, tau = value["mu"], value["tau"]
        sizes = self._sizes()
        if sizes is None or mu.shape != tau.shape or mu.shape != sizes[:4]:
            return self.twin().log_prob(value)
        return ng_sums_log_prob_op(self.sums, mu, tau, *self._prior())


def _philox_draws(sums: Tensor) -> bool:
    """Whether ``apg.random.standard_gamma`` draws from a Philox key for these sums."""
    return values_on_host(sums) and sums.dtype in (torch.float32, torch.float64)


def _from_sums(sums: Tensor, num_particles: int, prior: tuple[float, ...]) -> NormalGamma:
    """``NormalGammaFromSums.twin()`` for ``num_particles`` particles, from the prior's
    ``(alpha0, beta0, nu0, mu0)``."""
    from apg.tasks.gmm.model import GMMConfig

    alpha0, beta0, nu0, mu0 = prior
    cfg = GMMConfig(sums.shape[-2], (sums.shape[-1] - 1) // 2, mu0, nu0, alpha0, beta0)
    q = normal_gamma_from_moments(cfg, *moments_from_sums(sums))
    return q if sums.dim() == 4 else q.expand(num_particles)


def _sums_sizes(sums: Tensor, num_particles: int) -> tuple[int, ...]:
    """``(L, B, I, D, per_particle)`` for the compiled passes."""
    *_, batch, clusters, width = sums.shape
    return num_particles, batch, clusters, (width - 1) // 2, int(sums.dim() == 4)


def _sums_sample_twin(
    sums: Tensor, noise: Tensor, key: int, alpha0: float, beta0: float, nu0: float, mu0: float
) -> tuple[Tensor, Tensor]:
    """``NormalGamma.sample`` of the twin from the Gamma draws' ``key`` and the normals ``noise``."""
    q = _from_sums(sums, noise.shape[0], (alpha0, beta0, nu0, mu0))
    tiny = torch.finfo(q.beta.dtype).tiny
    tau = (philox_standard_gamma_op(key, q.alpha.expand(noise.shape)) / q.beta).clamp_min(tiny)
    mu = q.mu + noise * torch.rsqrt(q.nu * tau)
    return mu, tau


def _sums_sample_native(
    fn, sums: Tensor, noise: Tensor, key: int, alpha0: float, beta0: float, nu0: float, mu0: float
) -> tuple[Tensor, Tensor]:
    mu = noise.clone(memory_format=torch.contiguous_format)  # the kernel turns the normals into mu
    tau = torch.empty_like(mu)
    consts = _consts_of(alpha0, beta0, nu0, mu0, sums.dtype)
    call(fn, sums, consts, key, mu, tau, *_sums_sizes(sums, noise.shape[0]))
    return mu, tau


def _sums_applies(sums: Tensor, *_: object) -> bool:
    return sums.dim() in (3, 4)


# ``NormalGammaFromSums.sample``: ``(mu, tau)`` ``(L, B, I, D)`` from the sums, the Gamma draws'
# Philox key and the standard normals ``noise (L, B, I, D)``.
ng_sums_sample_op = KernelOp(
    "gmm_ng_sums_sample",
    _sums_sample_twin,
    kernel="gmm_ng_sums_sample",
    native=_sums_sample_native,
    applies=_sums_applies,
    checked=lambda sums, *_: (sums,),
    fake=lambda sums, noise, *_: (noise.new_empty(noise.shape), noise.new_empty(noise.shape)),
)


def _sums_log_prob_twin(
    sums: Tensor, mu: Tensor, tau: Tensor, alpha0: float, beta0: float, nu0: float, mu0: float
) -> Tensor:
    q = _from_sums(sums, mu.shape[0], (alpha0, beta0, nu0, mu0))
    return _ng_log_density(q.mu, q.nu, q.alpha, q.beta, mu, tau)


def _sums_log_prob_eager(
    sums: Tensor, mu: Tensor, tau: Tensor, alpha0: float, beta0: float, nu0: float, mu0: float
) -> Tensor:
    """``NormalGammaFromSums.twin().log_prob``, as the module computed it before it had ops."""
    return _from_sums(sums, mu.shape[0], (alpha0, beta0, nu0, mu0)).log_prob({"mu": mu, "tau": tau})


def _sums_log_prob_native(
    fn, sums: Tensor, mu: Tensor, tau: Tensor, alpha0: float, beta0: float, nu0: float, mu0: float
) -> Tensor:
    sums, mu, tau = (t.contiguous() for t in (sums, mu, tau))
    out = mu.new_empty(mu.shape[:2])
    consts = _consts_of(alpha0, beta0, nu0, mu0, mu.dtype)
    call(fn, sums, consts, mu, tau, out, *_sums_sizes(sums, mu.shape[0]))
    return out


def _sums_log_prob_backward_twin(
    sums: Tensor, mu: Tensor, tau: Tensor, grad: Tensor, alpha0: float, beta0: float, nu0: float, mu0: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of ``_sums_log_prob_twin``: ``_ng_partials`` taken back through the
    conjugate update (``normal_gamma_from_moments``) and ``moments_from_sums``."""
    dim = (sums.shape[-1] - 1) // 2
    count, s1, s2 = sums[..., :1], sums[..., 1 : 1 + dim], sums[..., 1 + dim :]
    if sums.dim() == 3:  # shared by the particles
        count, s1, s2 = (t.expand(mu.shape[0], *t.shape) for t in (count, s1, s2))
    safe = count.clamp_min(1e-12)
    mean = s1 / safe
    raw = s2 - s1 * mean
    scatter = raw.clamp_min(0.0)
    nu = nu0 + count
    m = (nu0 * mu0 + count * mean) / nu
    alpha = alpha0 + 0.5 * count
    dm = mean - mu0
    beta = beta0 + 0.5 * scatter + 0.5 * nu0 * count * dm**2 / nu
    g_m, g_nu, g_alpha, g_beta, g_mu, g_tau = _ng_partials(
        m, nu.expand_as(mu), alpha.expand_as(mu), beta, mu, tau, grad
    )
    g_mean = g_m * count / nu + g_beta * nu0 * count * dm / nu
    g_raw = 0.5 * g_beta * (raw >= 0)
    g_mean = g_mean - g_raw * s1
    g_count = (
        0.5 * g_alpha + g_nu + g_m * (mean - m) / nu + g_beta * 0.5 * nu0 * nu0 * dm**2 / (nu * nu)
    ).sum(-1, keepdim=True)
    g_count = g_count - (g_mean * s1 / (safe * safe)).sum(-1, keepdim=True) * (count >= 1e-12)
    g_s1 = g_mean / safe - g_raw * mean
    grad_sums = torch.cat([g_count, g_s1, g_raw], -1)
    if sums.dim() == 3:
        grad_sums = grad_sums.sum(0)
    return grad_sums, g_mu.contiguous(), g_tau.contiguous()


def _sums_log_prob_backward_native(
    fn,
    sums: Tensor,
    mu: Tensor,
    tau: Tensor,
    grad: Tensor,
    alpha0: float,
    beta0: float,
    nu0: float,
    mu0: float,
) -> tuple[Tensor, Tensor, Tensor]:
    sums, mu, tau = (t.contiguous() for t in (sums, mu, tau))
    grad_sums = torch.zeros_like(sums)
    grad_mu, grad_tau = torch.empty_like(mu), torch.empty_like(tau)
    consts = _consts_of(alpha0, beta0, nu0, mu0, mu.dtype)
    inputs = (sums, consts, mu, tau, grad.contiguous())
    call(fn, *inputs, grad_sums, grad_mu, grad_tau, *_sums_sizes(sums, mu.shape[0]))
    return grad_sums, grad_mu, grad_tau


def _sums_log_prob_applies(sums: Tensor, mu: Tensor, tau: Tensor, *_: object) -> bool:
    return sums.dim() in (3, 4) and mu.dim() == 4 and tau.shape == mu.shape


def _save_sums_values(ctx, inputs: tuple, output) -> None:
    ctx.save_for_backward(*inputs[:3])
    ctx.prior = inputs[3:]


_sums_log_prob_backward_op = KernelOp(
    "gmm_ng_sums_log_prob_backward",
    _sums_log_prob_backward_twin,
    kernel="gmm_ng_sums_log_prob_backward",
    native=_sums_log_prob_backward_native,
    applies=_sums_log_prob_applies,
    checked=lambda sums, mu, tau, grad, *_: (mu,),
    fake=lambda sums, mu, tau, *_: (
        sums.new_empty(sums.shape),
        mu.new_empty(mu.shape),
        tau.new_empty(tau.shape),
    ),
)

# ``NormalGammaFromSums.log_prob`` ``(L, B)`` of values ``(mu, tau)`` ``(L, B, I, D)`` under
# the conjugate update of the sums (per particle, or shared); differentiable in the sums
# and the values.
ng_sums_log_prob_op = KernelOp(
    "gmm_ng_sums_log_prob",
    _sums_log_prob_twin,
    kernel="gmm_ng_sums_log_prob",
    native=_sums_log_prob_native,
    applies=_sums_log_prob_applies,
    checked=lambda sums, mu, tau, *_: (sums, mu, tau),
    fake=lambda sums, mu, tau, *_: mu.new_empty(mu.shape[:2]),
    eager_twin=_sums_log_prob_eager,
    backward=_sums_log_prob_backward_op,
    setup_context=_save_sums_values,
    gradients=lambda ctx, grads, run, wants: (
        *run(*ctx.saved_tensors, grads[0], *ctx.prior),
        None,
        None,
        None,
        None,
    ),
)


def _propose_twin(
    sums: Tensor,
    mu_old: Tensor,
    tau_old: Tensor,
    noise: Tensor,
    key: int,
    alpha0: float,
    beta0: float,
    nu0: float,
    mu0: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    prior = (alpha0, beta0, nu0, mu0)
    mu, tau = _sums_sample_twin(sums.detach(), noise, key, *prior)  # draws, not reparameterized
    return (
        _sums_log_prob_twin(sums, mu, tau, *prior),
        mu,
        tau,
        _sums_log_prob_twin(sums, mu_old, tau_old, *prior),
    )


def _propose_eager(
    sums: Tensor,
    mu_old: Tensor,
    tau_old: Tensor,
    noise: Tensor,
    key: int,
    alpha0: float,
    beta0: float,
    nu0: float,
    mu0: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``propose_separately`` with the draws from ``key`` and ``noise``."""
    prior = (alpha0, beta0, nu0, mu0)
    mu, tau = ng_sums_sample_op(sums.detach(), noise, key, *prior)
    lp_new = ng_sums_log_prob_op(sums, mu, tau, *prior)
    with torch.no_grad():
        lp_old = ng_sums_log_prob_op(sums, mu_old, tau_old, *prior)
    return lp_new, mu, tau, lp_old


def _propose_native(
    fn,
    sums: Tensor,
    mu_old: Tensor,
    tau_old: Tensor,
    noise: Tensor,
    key: int,
    alpha0: float,
    beta0: float,
    nu0: float,
    mu0: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    sums, mu_old, tau_old = (t.contiguous() for t in (sums, mu_old, tau_old))
    mu = noise.clone(memory_format=torch.contiguous_format)  # the kernel turns the normals into mu
    tau = torch.empty_like(mu)
    lp_new, lp_old = (mu.new_empty(mu.shape[:2]) for _ in range(2))
    consts = _consts_of(alpha0, beta0, nu0, mu0, sums.dtype)
    call(fn, sums, consts, key, mu, tau, mu_old, tau_old, lp_new, lp_old, *_sums_sizes(sums, mu.shape[0]))
    return lp_new, mu, tau, lp_old


def _propose_save(ctx, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(inputs[0], output[1], output[2])
    ctx.prior = inputs[5:]
    ctx.mark_non_differentiable(output[1], output[2], output[3])


def _propose_fake(sums: Tensor, mu_old: Tensor, tau_old: Tensor, noise: Tensor, *_: object):
    lp = (noise.new_empty(noise.shape[:2]) for _ in range(2))
    return next(lp), noise.new_empty(noise.shape), noise.new_empty(noise.shape), next(lp)


# ``NormalGammaFromSums.propose``: the draw (from the Gamma draws' key and the normals
# ``noise``) and the log-densities of the new and the old values, ``(lp_new, mu, tau,
# lp_old)``, in one call; differentiable in the sums through the new values' log-density.
ng_sums_propose_op = KernelOp(
    "gmm_ng_sums_propose",
    _propose_twin,
    kernel="gmm_ng_sums_propose",
    native=_propose_native,
    applies=lambda sums, mu_old, tau_old, noise, *_: sums.dim() in (3, 4) and mu_old.shape == noise.shape,
    checked=lambda sums, mu_old, tau_old, *_: (sums, mu_old, tau_old),
    fake=_propose_fake,
    eager_twin=_propose_eager,
    backward=_sums_log_prob_backward_op,
    setup_context=_propose_save,
    gradients=lambda ctx, grads, run, wants: (run(*ctx.saved_tensors, grads[0], *ctx.prior)[0], *[None] * 8),
)


@functools.cache
def _consts_of(alpha0: float, beta0: float, nu0: float, mu0: float, dtype: torch.dtype) -> Tensor:
    """The prior's ``(alpha0, beta0, nu0, mu0)`` for the compiled kernels (CPU, read-only)."""
    return torch.tensor([alpha0, beta0, nu0, mu0], dtype=dtype)


def _consts(cfg: GMMConfig, dtype: torch.dtype) -> Tensor:
    """The prior's ``(alpha0, beta0, nu0, mu0)`` for the compiled kernels (CPU, read-only)."""
    return _consts_of(cfg.alpha0, cfg.beta0, cfg.nu0, cfg.mu0, dtype)


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
    if sums.dim() in (3, 4) and values_on_host(sums):
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
