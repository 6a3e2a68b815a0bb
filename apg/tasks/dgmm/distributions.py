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
from apg.distributions import categorical_log_prob, categorical_sample_op
from apg.host import values_on_host
from apg.kernels import call
from apg.kernels.ops import KernelOp
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
    if key is None:
        return _von_mises_torch(loc, k, candidates, None).reshape(shape)
    return von_mises_op(loc, k, key, candidates).reshape(shape)


def _von_mises_twin(loc: Tensor, k: Tensor, key: int, candidates: int) -> Tensor:
    return _von_mises_torch(loc, k, candidates, key)


def _von_mises_native(fn, loc: Tensor, k: Tensor, key: int, candidates: int) -> Tensor:
    """Every round in the compiled kernel, drawing the twin's Philox uniforms."""
    n = k.numel()
    alpha, accepted = torch.empty_like(k), torch.empty(n, dtype=torch.bool)
    call(fn, loc, k, key, alpha, accepted, torch.empty(n, dtype=torch.long), n, candidates)
    if not bool(accepted.all()):
        raise RuntimeError("von Mises sampler: an element accepted no candidate in 1000 rounds")
    return alpha


# Von Mises draws for flat ``loc`` and clamped concentrations ``k`` from the Philox ``key``,
# ``candidates`` proposals per element and round (``sample_von_mises``).
von_mises_op = KernelOp(
    "von_mises",
    _von_mises_twin,
    kernel="von_mises",
    native=_von_mises_native,
    checked=lambda loc, k, key, candidates: (loc, k),
    fake=lambda loc, k, key, candidates: torch.empty_like(k),
)


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
        c, loc, k = local_sample_op(q, uniform(q.shape[:-2], q.dtype, q.device))
        return {"c": c, "alpha": sample_von_mises(loc, k)}

    def log_prob(self, value: Mapping[str, Tensor]) -> Tensor:
        return local_log_prob_op(self.params, value["c"], value["alpha"]).sum(-1)


def _local_sample_twin(q: Tensor, u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    c = categorical_sample_op(q[..., 0], u)
    loc, k = _component(q, c)
    return c, loc, k


def _local_sample_native(fn, q: Tensor, u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    q = q.contiguous()
    c, loc, k = torch.empty(u.shape, dtype=torch.long), torch.empty_like(u), torch.empty_like(u)
    call(fn, q, u, c, loc, k, u.numel(), q.shape[-2])
    return c, loc, k


# ``LocalProposal.sample``'s assignments and their components' ``(loc, k)`` from ``params``
# and the uniforms ``u (L, B, N)`` of the assignments' draw.
local_sample_op = KernelOp(
    "local_sample",
    _local_sample_twin,
    kernel="local_sample",
    native=_local_sample_native,
    checked=lambda q, u: (q,),
    fake=lambda q, u: (
        torch.empty(u.shape, dtype=torch.long, device=u.device),
        u.new_empty(u.shape),
        u.new_empty(u.shape),
    ),
)


def _local_log_prob_twin(params: Tensor, c: Tensor, alpha: Tensor) -> Tensor:
    loc, k = _component(params, c)
    return categorical_log_prob(params[..., 0], c) + von_mises_log_prob(alpha, loc, k)


def _local_log_prob_native(fn, params: Tensor, c: Tensor, alpha: Tensor) -> Tensor:
    params, c, alpha = params.contiguous(), c.contiguous(), alpha.contiguous()
    out = alpha.new_empty(c.shape)
    call(fn, params, c, alpha, out, c.numel(), params.shape[-2])
    return out


def _local_log_prob_backward_twin(params: Tensor, c: Tensor, alpha: Tensor, grad: Tensor) -> Tensor:
    one_hot = F.one_hot(c, params.shape[-2]).to(params.dtype)  # (..., I)
    grad_logits = grad.unsqueeze(-1) * (one_hot - torch.softmax(params[..., 0], -1))
    picked = params.gather(-2, c.unsqueeze(-1).unsqueeze(-1).expand(*c.shape, 1, 4)).squeeze(-2)
    x, y, raw = picked[..., 1], picked[..., 2], picked[..., 3]
    loc, k = torch.atan2(y, x), F.softplus(raw) + 1e-3
    d_loc = grad * k * torch.sin(alpha - loc)
    d_k = grad * (torch.cos(alpha - loc) - torch.special.i1e(k) / torch.special.i0e(k))
    norm = x * x + y * y
    per_point = torch.stack(
        [torch.zeros_like(x), -d_loc * y / norm, d_loc * x / norm, d_k * torch.sigmoid(raw)], -1
    )
    grad_params = one_hot.unsqueeze(-1) * per_point.unsqueeze(-2)
    grad_params[..., 0] += grad_logits
    return grad_params


def _local_log_prob_backward_native(fn, params: Tensor, c: Tensor, alpha: Tensor, grad: Tensor) -> Tensor:
    params, c, alpha = params.contiguous(), c.contiguous(), alpha.contiguous()
    grad_params = torch.empty_like(params)
    call(fn, params, c, alpha, grad, grad_params, c.numel(), params.shape[-2])
    return grad_params


# Per-point ``log q(c_n, alpha_n)`` ``(L, B, N)`` from ``params (L, B, N, I, 4)``;
# differentiable in ``params`` only (``c`` and ``alpha`` are draws: a differentiable
# ``alpha`` runs the twin here).
local_log_prob_op = KernelOp(
    "local_log_prob",
    _local_log_prob_twin,
    kernel="local_log_prob",
    native=_local_log_prob_native,
    applies=lambda params, c, alpha: not alpha.requires_grad,
    checked=lambda params, c, alpha: (params, alpha),
    fake=lambda params, c, alpha: alpha.new_empty(c.shape),
    backward=KernelOp(
        "local_log_prob_backward",
        _local_log_prob_backward_twin,
        kernel="local_log_prob_backward",
        native=_local_log_prob_backward_native,
        checked=lambda params, c, alpha, grad: (params,),
        fake=lambda params, c, alpha, grad: params.new_empty(params.shape),
    ),
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs),
    gradients=lambda ctx, grads, run, wants: (run(*ctx.saved_tensors, grads[0]), None, None),
)


def _component(params: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """Mean direction and concentration of each point's von Mises under cluster ``c``."""
    picked = params.gather(-2, c.unsqueeze(-1).unsqueeze(-1).expand(*c.shape, 1, 4)).squeeze(-2)
    return torch.atan2(picked[..., 2], picked[..., 1]), F.softplus(picked[..., 3]) + 1e-3


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
    sums = centre_pool_op(per_point, x, c, num_clusters)
    precision = prior_precision + sums[..., :DATA_DIM]
    return sums[..., DATA_DIM:] / precision, precision


def _centre_pool_twin(per_point: Tensor, x: Tensor, c: Tensor, num_clusters: int) -> Tensor:
    offset, raw = per_point.chunk(2, -1)
    # == against the cluster numbers: F.one_hot checks c's range, a host read on a device
    weights = (c.unsqueeze(-1) == torch.arange(num_clusters, device=c.device)).to(per_point.dtype)
    w_t = weights.transpose(-1, -2)  # (..., I, N)
    precision = torch.exp(raw)
    return torch.cat([w_t @ precision, w_t @ (precision * (x - offset))], -1)


def _centre_pool_native(fn, per_point: Tensor, x: Tensor, c: Tensor, num_clusters: int) -> Tensor:
    per_point, x, c = per_point.contiguous(), x.contiguous(), c.contiguous()
    (num_particles, batch, num_points, _) = per_point.shape
    sums = per_point.new_zeros(num_particles, batch, num_clusters, 4)
    call(fn, per_point, x, c, sums, num_particles, batch, num_points, num_clusters)
    return sums


def _centre_pool_backward_twin(per_point: Tensor, x: Tensor, c: Tensor, grad: Tensor) -> Tensor:
    offset, raw = per_point.chunk(2, -1)
    picked = grad.gather(-2, c.unsqueeze(-1).expand(*c.shape, 4))  # each point's cluster's
    g_prec, g_sum = picked[..., :DATA_DIM], picked[..., DATA_DIM:]
    precision = torch.exp(raw)
    return torch.cat([-precision * g_sum, precision * (g_prec + g_sum * (x - offset))], -1)


def _centre_pool_backward_native(fn, per_point: Tensor, x: Tensor, c: Tensor, grad: Tensor) -> Tensor:
    per_point, x, c = per_point.contiguous(), x.contiguous(), c.contiguous()
    grad_per_point = torch.empty_like(per_point)
    call(fn, per_point, x, c, grad.contiguous(), grad_per_point, *c.shape, grad.shape[-2])
    return grad_per_point


def _centre_pool_applies(per_point: Tensor, x: Tensor, *_: object) -> bool:
    return per_point.dim() == 4 and x.dim() == 3 and not x.requires_grad


# Per-cluster sums ``(sum lambda_n, sum lambda_n (x_n - offset_n))`` ``(L, B, I, 4)`` of the
# hard assignments ``c``, ``lambda_n = exp(raw_n)``; differentiable in ``per_point`` only.
centre_pool_op = KernelOp(
    "centre_pool",
    _centre_pool_twin,
    kernel="centre_pool",
    native=_centre_pool_native,
    applies=_centre_pool_applies,
    checked=lambda per_point, x, c, num_clusters: (per_point, x),
    fake=lambda per_point, x, c, num_clusters: per_point.new_empty(*per_point.shape[:-2], num_clusters, 4),
    backward=KernelOp(
        "centre_pool_backward",
        _centre_pool_backward_twin,
        kernel="centre_pool_backward",
        native=_centre_pool_backward_native,
        applies=_centre_pool_applies,
        checked=lambda per_point, x, c, grad: (per_point,),
        fake=lambda per_point, x, c, grad: per_point.new_empty(per_point.shape),
    ),
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs[:3]),
    gradients=lambda ctx, grads, run, wants: (run(*ctx.saved_tensors, grads[0]), None, None, None),
)
