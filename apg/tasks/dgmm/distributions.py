"""The rings' proposal distributions: von Mises angles, the local block's
``q(c, alpha | x, mu)`` and the Gaussian over the centres with its per-cluster pooling.

Legend: L particles, B datasets, N points, I clusters.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from apg.blocks import Latents
from apg.distributions import categorical_log_prob, categorical_sample
from apg.host import values_on_host
from apg.kernels import call, native_function
from apg.random import new_key, uniform, uniform_pair
from apg.tasks.dgmm.model import DATA_DIM, TWO_PI


def sample_von_mises(loc: Tensor, concentration: Tensor, candidates: int = 2) -> Tensor:
    """Draw from von Mises(loc, concentration) into ``[0, 2 pi)``, any shape.

    Best & Fisher (1979) rejection sampler, vectorized: ``candidates`` proposals per element
    are drawn at once and the first accepted one is kept (acceptance is >= 0.65 for every
    concentration, so the rare leftovers take another round). ``torch.distributions.VonMises``
    draws one proposal per round and is ~20x slower here.

    The textbook form loses all precision in float32 for large concentrations: with
    ``r = (1 + rho^2) / (2 rho)`` near 1 it forms ``c = k (r - f)`` by cancellation. Here
    every quantity is rewritten as a ratio of positive terms (``rho = 2k / (tau +
    sqrt(2 tau))``, ``r - 1 = (1 - rho)^2 / (2 rho)``, ``c = k (r^2 - 1) / (r + z)`` with
    ``r + z = (r - 1) + 2 cos^2(pi u / 2)``, ``1 - f = (r - 1)(1 - z) / (r + z)``), so it runs
    in the parameters' own dtype: float32 here is several times cheaper than float64.
    """
    shape = loc.shape
    k = concentration.detach().reshape(-1).clamp_min(1e-6)
    # One sum per tensor: finite unless some element is NaN or infinite (or the sum
    # overflows, which only sends it to the elementwise check). isfinite(t).all() is
    # ~5 passes over the 40,000 elements of a rings step's draw.
    if (
        values_on_host(k)
        and not math.isfinite(float(k.sum() + loc.sum()))
        and not (torch.isfinite(k).all() and torch.isfinite(loc).all())
    ):
        raise ValueError("von Mises parameters must be finite (the rejection loop would not end)")
    loc = loc.detach().reshape(-1)
    # Philox uniforms on CPU in float32/64 (apg.random); torch.rand elsewhere.
    key = new_key() if values_on_host(loc) and k.dtype in (torch.float32, torch.float64) else None
    native = native_function("von_mises", loc, k)
    if native is None:
        return _von_mises_torch(loc, k, candidates, key).reshape(shape)
    assert key is not None  # a native kernel means CPU float32/64 outside torch.compile: key drawn
    # The compiled kernel runs every round, drawing the twin's Philox uniforms.
    n = k.numel()
    alpha, accepted = torch.empty_like(k), torch.empty(n, dtype=torch.bool)
    call(native, loc, k, key, alpha, accepted, torch.empty(n, dtype=torch.long), n, candidates)
    if not bool(accepted.all()):
        raise RuntimeError("von Mises sampler: an element accepted no candidate in 1000 rounds")
    return alpha.reshape(shape)


# On a device, one round of this many candidates per element and no host read (apg.host):
# each is accepted with probability >= 0.65, so an element accepts none with probability
# <= 0.35^32 ~ 3e-15 (it is then NaN, a zero-weight particle).
DEVICE_CANDIDATES = 32


def _von_mises_torch(loc: Tensor, k: Tensor, candidates: int, key: int | None) -> Tensor:
    """``sample_von_mises`` for flat ``loc`` and clamped ``k`` (the PyTorch twin of the
    compiled ``von_mises`` in ``apg/kernels/rings.c``). Candidate ``j`` of element ``e``'s
    round ``r`` takes the Philox block ``(key; e, r * candidates + j)`` (``apg.random``), or
    where ``key`` is None (other devices) ``torch.rand`` for one round of
    ``DEVICE_CANDIDATES``."""
    s = torch.hypot(torch.ones_like(k), 2.0 * k)  # sqrt(1 + 4 k^2) without overflow
    tau = 1.0 + s
    root = torch.sqrt(2.0 * tau)
    rho = 2.0 * k / (tau + root)
    one_minus_rho = (1.0 + 1.0 / (s + 2.0 * k) + root) / (tau + root)
    r_minus_1 = one_minus_rho**2 / (2.0 * rho)
    scale = k * r_minus_1 * (r_minus_1 + 2.0)  # k (r^2 - 1)
    if key is None:
        u = torch.rand((2, DEVICE_CANDIDATES, k.numel()), dtype=k.dtype, device=k.device)
        kept, accepted = _von_mises_round(r_minus_1, scale, u)
        theta = torch.where(accepted, kept, math.nan)
    else:
        theta = torch.empty_like(k)
        todo = None  # every element, without indexing copies in the first round
        elements = torch.arange(k.numel())
        for round_ in itertools.count():
            if todo is not None and not todo.numel():
                break
            rm1, sc = (r_minus_1, scale) if todo is None else (r_minus_1[todo], scale[todo])
            element = elements if todo is None else elements[todo]
            draws = [uniform_pair(key, element, round_ * candidates + j, k.dtype) for j in range(candidates)]
            u = torch.stack([torch.stack(side) for side in zip(*draws, strict=True)])
            kept, accepted = _von_mises_round(rm1, sc, u)
            if todo is None:
                theta = kept
                todo = (~accepted).nonzero().squeeze(-1)
            else:
                theta[todo[accepted]] = kept[accepted]
                todo = todo[~accepted]
    alpha = torch.remainder(theta.to(loc.dtype) + loc, TWO_PI)
    # In float32, remainder(-1e-8, 2 pi) rounds to 2 pi itself, outside [0, 2 pi), where
    # the prior density is zero; that point of the circle is angle 0.
    return torch.where(alpha >= TWO_PI, torch.zeros_like(alpha), alpha)


def _von_mises_round(rm1: Tensor, sc: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """One round of Best & Fisher's proposals, ``u (2, candidates, n)`` uniforms for ``n``
    elements: each element's first accepted angle (centred at 0) and whether it has one."""
    candidates = u.shape[1]
    # One uniform gives both the side (u < 1/2) and, rescaled, the angle's magnitude.
    left = u[0] < 0.5
    half = (0.5 * math.pi) * torch.where(left, 2.0 * u[0], 2.0 * u[0] - 1.0)
    one_plus_z, one_minus_z = 2.0 * torch.cos(half) ** 2, 2.0 * torch.sin(half) ** 2
    r_plus_z = rm1 + one_plus_z
    cc = sc / r_plus_z
    ok = (cc * (2.0 - cc) > u[1]) | (torch.log(cc / u[1]) + 1.0 >= cc)
    # acos(f) = 2 asin(sqrt((1 - f) / 2)), accurate where f is close to 1.
    half_gap = (0.5 * rm1 * one_minus_z / r_plus_z).clamp(0.0, 1.0)
    magnitude = 2.0 * torch.asin(torch.sqrt(half_gap))
    draw = torch.where(left, -magnitude, magnitude)
    rejected_before = (~ok).cumprod(0).sum(0, keepdim=True)  # index of the first accepted
    accepted = rejected_before[0] < candidates
    first = rejected_before.clamp_max(candidates - 1)
    return draw.gather(0, first).squeeze(0), accepted


def von_mises_log_prob(value: Tensor, loc: Tensor, concentration: Tensor) -> Tensor:
    """Log-density on one period (w.r.t. Lebesgue measure), differentiable in the parameters.

    ``log I0(k) = log i0e(k) + k`` is stable for large k.
    """
    k = concentration
    return k * (torch.cos(value - loc) - 1.0) - torch.log(torch.special.i0e(k)) - math.log(TWO_PI)


class LocalProposal:
    """``q(c, alpha | x, mu) = prod_n q(c_n) q(alpha_n | c_n)`` from per-cluster parameters.

    Parameters are shaped ``(L, B, N, I)``: assignment ``logits`` and, for every cluster,
    the von Mises parameters the angle would have if the point belonged to it: mean
    direction ``atan2(direction)`` (``direction (L, B, N, I, 2)``) and concentration
    ``softplus(raw) + 1e-3``, applied after picking the component (4x fewer elements).
    ``log_prob`` scores each angle under the component of *its own* assignment, so the
    reverse kernel of an old ``(c, alpha)`` uses the old ``c``.

    The four are held side by side in ``params (L, B, N, I, 4)`` (``from_params``: the
    local network's output as it is): on CPU, draws and log-densities run one pass per
    point in ``apg/kernels/rings.c``; the PyTorch formulas below are their twins.
    """

    def __init__(self, logits: Tensor, direction: Tensor, raw_concentration: Tensor):
        self.params = torch.cat([logits.unsqueeze(-1), direction, raw_concentration.unsqueeze(-1)], -1)

    @classmethod
    def from_params(cls, params: Tensor) -> LocalProposal:
        """From ``(logit, direction (2), raw concentration)`` along the last axis of ``params``."""
        proposal = cls.__new__(cls)
        proposal.params = params
        return proposal

    def sample(self) -> Latents:
        q = self.params.detach()
        native = native_function("local_sample", q)
        if native is None:
            c = categorical_sample(q[..., 0])
            loc, k = _component(q, c)
        else:
            q = q.contiguous()
            rows = q.shape[:-2]
            u = uniform(rows, q.dtype)
            c, loc, k = torch.empty(rows, dtype=torch.long), torch.empty_like(u), torch.empty_like(u)
            call(native, q, u, c, loc, k, u.numel(), q.shape[-2])
        return {"c": c, "alpha": sample_von_mises(loc, k)}

    def log_prob(self, value: Mapping[str, Tensor]) -> Tensor:
        c, alpha = value["c"], value["alpha"]
        native = native_function("local_log_prob", self.params, alpha)
        if native is None or alpha.requires_grad:
            loc, k = _component(self.params, c)
            lp_c = categorical_log_prob(self.params[..., 0], c)
            per_point = lp_c + von_mises_log_prob(alpha, loc, k)
        else:
            backward = native_function("local_log_prob_backward", self.params)
            per_point = _LocalLogProb.apply(self.params, c, alpha, native, backward)
        return per_point.sum(-1)


def _component(params: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """Mean direction and concentration of each point's von Mises under cluster ``c``."""
    picked = params.gather(-2, c.unsqueeze(-1).unsqueeze(-1).expand(*c.shape, 1, 4)).squeeze(-2)
    return torch.atan2(picked[..., 2], picked[..., 1]), F.softplus(picked[..., 3]) + 1e-3


class _LocalLogProb(torch.autograd.Function):
    """Per-point ``log q(c_n, alpha_n)`` from ``params (..., I, 4)``, compiled forward and
    backward; differentiable in ``params`` only (``c`` and ``alpha`` are draws)."""

    @staticmethod
    def forward(ctx, params: Tensor, c: Tensor, alpha: Tensor, forward_fn, backward_fn) -> Tensor:
        params, c, alpha = params.contiguous(), c.contiguous(), alpha.contiguous()
        out = alpha.new_empty(c.shape)
        call(forward_fn, params, c, alpha, out, c.numel(), params.shape[-2])
        ctx.save_for_backward(params, c, alpha)
        ctx.backward_fn = backward_fn
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        params, c, alpha = ctx.saved_tensors
        grad_params = torch.empty_like(params)
        call(ctx.backward_fn, params, c, alpha, grad, grad_params, c.numel(), params.shape[-2])
        return grad_params, None, None, None, None


class GaussianMu:
    """Diagonal Gaussian block distribution over ``mu`` from ``(L, B, I, 2)`` means and
    precisions; ``log_prob`` is ``(L, B)``.

    Written from the precision directly (``log N = (log prec - prec d^2 - log 2 pi) / 2``):
    ``torch.distributions.Normal`` takes a scale, and its log-density is ~10 ops (and as many
    autograd nodes) per call, at every centre update.
    """

    def __init__(self, mean: Tensor, precision: Tensor):
        self.mean, self.precision = mean, precision

    def sample(self) -> Latents:
        with torch.no_grad():
            noise = torch.randn(self.mean.shape, dtype=self.mean.dtype, device=self.mean.device)
            return {"mu": torch.addcmul(self.mean, noise, torch.rsqrt(self.precision))}

    def log_prob(self, value: Mapping[str, Tensor]) -> Tensor:
        d = value["mu"] - self.mean
        log_density = torch.log(self.precision) - self.precision * (d * d)
        return 0.5 * log_density.sum((-2, -1)) - 0.5 * math.log(TWO_PI) * d.shape[-2] * d.shape[-1]


def gaussian_mu(mean: Tensor, precision: Tensor) -> GaussianMu:
    return GaussianMu(mean, precision)


def pool_per_cluster(
    weights: Tensor, stat: Tensor, precision: Tensor, prior_precision: float
) -> tuple[Tensor, Tensor]:
    """Neural sufficient statistics pooled per cluster (section 3, eq. 10).

    ``weights (..., N, I)`` (soft or one-hot assignments), ``stat`` and ``precision``
    ``(..., N, 2)``. Returns the conjugate-form Gaussian ``(mean, precision)`` of
    ``mu (..., I, 2)`` under the prior ``Normal(0, 1 / prior_precision)``: an empty cluster
    gets exactly the prior.
    """
    w_t = weights.transpose(-1, -2)  # (..., I, N)
    prec = prior_precision + w_t @ precision
    mean = (w_t @ (precision * stat)) / prec
    return mean, prec


def pool_assigned(
    per_point: Tensor, x: Tensor, c: Tensor, num_clusters: int, prior_precision: float
) -> tuple[Tensor, Tensor]:
    """``pool_per_cluster`` of the hard assignments ``c (L, B, N)`` with statistics
    ``x_n - offset_n`` and precisions ``exp(raw_n)``, where ``per_point (L, B, N, 4)`` holds
    ``(offset (2), raw (2))`` and ``x`` is ``(B, N, 2)``; returns ``(mean, precision)``
    ``(L, B, I, 2)``. On CPU one compiled pass (``rings.c``: ``centre_pool``) replaces the
    one-hot products and the elementwise ops on strided halves of ``per_point``.
    """
    native = native_function("centre_pool", per_point, x)
    if native is None or per_point.dim() != 4 or x.dim() != 3 or x.requires_grad:
        offset, raw = per_point.chunk(2, -1)
        # == against the cluster numbers: F.one_hot checks c's range, a host read on a device
        weights = (c.unsqueeze(-1) == torch.arange(num_clusters, device=c.device)).to(per_point.dtype)
        return pool_per_cluster(weights, x - offset, torch.exp(raw), prior_precision)
    backward = native_function("centre_pool_backward", per_point)
    sums = _CentrePool.apply(per_point, x, c, num_clusters, native, backward)
    precision = prior_precision + sums[..., :DATA_DIM]
    return sums[..., DATA_DIM:] / precision, precision


class _CentrePool(torch.autograd.Function):
    """Per-cluster sums ``(sum lambda_n, sum lambda_n (x_n - offset_n))`` ``(L, B, I, 4)``,
    compiled forward and backward; differentiable in ``per_point`` only."""

    @staticmethod
    def forward(ctx, per_point: Tensor, x: Tensor, c: Tensor, num_clusters: int, forward_fn, backward_fn):
        per_point, x, c = per_point.contiguous(), x.contiguous(), c.contiguous()
        (num_particles, batch, num_points, _) = per_point.shape
        sums = per_point.new_zeros(num_particles, batch, num_clusters, 4)
        ctx.sizes = (num_particles, batch, num_points, num_clusters)
        call(forward_fn, per_point, x, c, sums, *ctx.sizes)
        ctx.save_for_backward(per_point, x, c)
        ctx.backward_fn = backward_fn
        return sums

    @staticmethod
    def backward(ctx, grad: Tensor):
        per_point, x, c = ctx.saved_tensors
        grad_per_point = torch.empty_like(per_point)
        call(ctx.backward_fn, per_point, x, c, grad.contiguous(), grad_per_point, *ctx.sizes)
        return grad_per_point, None, None, None, None, None
