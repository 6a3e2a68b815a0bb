"""Deep generative mixture model of rings, "DGMM" (paper section 5.2, Appendix E).

Generative model ``p_theta`` for a dataset of N points in 2-D and I rings:

    mu_i    ~ Normal(0, sigma0^2 I_2)                    i = 1..I   (ring centres)
    c_n     ~ Cat(uniform over I)                        n = 1..N
    alpha_n ~ Uniform[0, 2 pi)                           (angle on the ring)
    x_n | c_n = i, alpha_n ~ Normal(mu_i + g_theta(alpha_n), sigma_eps^2 I_2)

``g_theta`` (the ring shape) is a small MLP of the angle, learned jointly with the
proposals (eq. 6). It reads ``(cos alpha, sin alpha)`` rather than alpha itself: the
shape is then periodic by construction, so the curve closes at alpha = 0 = 2 pi
instead of having to learn continuity across that seam. Its output layer is linear
(Appendix E ends in a tanh, which would cap the radius at 1; the authors' code worked
around this with a separately learned radius times a normalized direction, which fixes
the shape to a circle; ours can learn any closed curve).

Angle densities. The prior density of alpha is ``1 / (2 pi)`` on ``[0, 2 pi)``. Every
angle proposal is a **von Mises** distribution on the same circle, sampled into
``[0, 2 pi)``; its density is taken with respect to the same Lebesgue measure on one
period, so no Jacobian enters the weights. A von Mises (rather than a Beta on
``alpha / 2 pi``) is chosen because (a) its support has no seam: a point whose angle is
near 0 has a posterior with mass on both sides of 0 = 2 pi, which a Beta cannot put;
and (b) it is the exact conditional family: for a circular ``g(alpha) = r (cos, sin)``
the conditional ``p(alpha_n | x_n, c_n = i, mu)`` is von Mises with mean direction
``atan2(x_n - mu_i)`` and concentration ``r |x_n - mu_i| / sigma_eps^2``.

Blocks, updated in this order: ``mu`` = {mu} and ``local`` = {c, alpha}.

Proposals (``DGMMProposals``), with neural sufficient statistics (section 3, eq. 10):

- ``q(mu | x)`` (encoder) and ``q(mu | x, c, alpha)`` (APG kernel) are diagonal
  Gaussians of conjugate form. Each point contributes a learned location
  statistic ``s_n`` (2) and a learned precision ``lambda_n`` (2), pooled per cluster over
  the points assigned to it (soft assignments ``gamma_n`` in the encoder, the one-hot
  ``c_n`` in the kernel):

      prec_i = 1 / sigma0^2 + sum_n gamma_ni lambda_n,
      mean_i = sum_n gamma_ni lambda_n s_n / prec_i.

  The proposal therefore sharpens as a cluster collects points, for any N. With
  ``s_n = x_n - g_theta(alpha_n)`` and ``lambda_n = 1 / sigma_eps^2`` it *is* the exact
  conditional, which the kernel can represent (``s_n = x_n - h(alpha_n)``).
- ``q(c, alpha | x, mu) = prod_n q(c_n | x_n, mu) q(alpha_n | c_n, x_n, mu)``: per point
  and cluster, features of ``d_ni = x_n - mu_i`` give the assignment logit and the von
  Mises parameters of the angle under that cluster (``LocalProposal``).

Architectures: ``apg`` (MLP encoder plus both kernels), ``mlp`` and ``lstm`` (RWS
encoders with the same NSS parameterization whose point features come from an MLP or an
LSTM over the points; no kernels).

Legend: L particles, B datasets, N points, I clusters, H hidden units, F features.
Latents: ``mu (L, B, I, 2)``, ``c (L, B, N)`` (long), ``alpha (L, B, N)`` in [0, 2 pi).
Data ``x``: ``(B, N, 2)``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from apg.blocks import Latents, Model, Proposals, TaskSpec
from apg.distributions import categorical_log_prob, categorical_sample, softmax_short
from apg.host import values_on_host
from apg.kernels import call, native_function
from apg.nn import PointFeatures, pairwise_tanh_linear, tanh_mlp
from apg.random import new_key, uniform, uniform_pair

TWO_PI = 2.0 * math.pi
DATA_DIM = 2


@dataclass(frozen=True)
class DGMMConfig:
    """Hyperparameters of ``p_theta`` (paper section 5.2 defaults).

    ``noise`` is the likelihood's standard deviation sigma_eps (fixed, not learned);
    ``hidden`` the width of g_theta's tanh layer (Appendix E: 32).
    """

    num_clusters: int = 4
    sigma0: float = 3.5
    noise: float = 0.2
    hidden: int = 32

    def __post_init__(self):
        if self.num_clusters < 1:
            raise ValueError(f"num_clusters must be >= 1, got {self.num_clusters}")
        if not (self.sigma0 > 0 and self.noise > 0):
            raise ValueError(f"sigma0 and noise must be positive, got {self.sigma0}, {self.noise}")


def angle_features(alpha: Tensor) -> Tensor:
    """``(cos alpha, sin alpha)``, ``(...,) -> (..., 2)``."""
    return torch.stack([torch.cos(alpha), torch.sin(alpha)], -1)


class DGMM(Model):
    """``p_theta(x, mu, c, alpha)`` of the module docstring; theta = g_theta's weights."""

    blocks = {"mu": ("mu",), "local": ("c", "alpha")}

    def __init__(self, cfg: DGMMConfig = DGMMConfig()):
        super().__init__()
        self.cfg = cfg
        self.shape_net = nn.Sequential(nn.Linear(2, cfg.hidden), nn.Tanh(), nn.Linear(cfg.hidden, DATA_DIM))

    def g(self, alpha: Tensor) -> Tensor:
        """The learned ring shape ``g_theta(alpha)``, ``(...,) -> (..., 2)``."""
        first, _, last = self.shape_net
        return tanh_mlp(alpha, first.weight, first.bias, last.weight, last.bias, angles=True)

    def mean(self, z: Mapping[str, Tensor], shape: Tensor | None = None) -> Tensor:
        """Mean of ``p(x_n | ...)``: ``mu_{c_n} + g_theta(alpha_n)``, ``(L, B, N, 2)``;
        ``shape`` is ``g_theta(alpha)`` when the caller already has it."""
        return assigned_centres(z["mu"], z["c"]) + (self.g(z["alpha"]) if shape is None else shape)

    def log_likelihood(self, x: Tensor, z: Mapping[str, Tensor], shape: Tensor | None = None) -> Tensor:
        """``sum_n log N(x_n; mu_{c_n} + g(alpha_n), sigma_eps^2 I)``, ``(L, B)``."""
        if x.dim() != 3 or x.shape[-1] != DATA_DIM:
            raise ValueError(f"x must be shaped (B, N, 2), got {tuple(x.shape)}")
        sq = squared_residuals(x, z["mu"], z["c"], self.g(z["alpha"]) if shape is None else shape)
        size = x.shape[-2] * DATA_DIM
        s = self.cfg.noise
        return -0.5 * sq / s**2 - size * (math.log(s) + 0.5 * math.log(TWO_PI))

    def log_prior_mu(self, mu: Tensor) -> Tensor:
        """``sum_i log N(mu_i; 0, sigma0^2 I)``, ``(L, B)``."""
        s = self.cfg.sigma0
        return (-0.5 * (mu / s) ** 2 - math.log(s) - 0.5 * math.log(TWO_PI)).sum((-2, -1))

    def log_prior_local(self, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
        """``sum_n log p(c_n) + log p(alpha_n)``: a constant on the support, ``(L, B)``.

        Kept (not dropped as a constant) so that an angle outside ``[0, 2 pi)`` scores -inf.
        """
        alpha = z["alpha"]
        # The points' extremes, then (L, B)-sized arithmetic. amin and amax, not aminmax:
        # this build's aminmax along a dim takes ~10x as long as the two (110 vs 21 us on
        # (10, 20, 200)).
        lowest, highest = alpha.amin(-1), alpha.amax(-1)
        inside = (lowest >= 0) & (highest < TWO_PI)
        per_point = -math.log(TWO_PI) - math.log(self.cfg.num_clusters)
        total = torch.full(inside.shape, per_point * alpha.shape[-1], dtype=x.dtype, device=x.device)
        return total.masked_fill_(~inside, -math.inf)

    def log_joint(self, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
        return self.log_prior_mu(z["mu"]) + self.log_prior_local(x, z) + self.log_likelihood(x, z)

    def log_blanket(self, block: str, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
        # Every point's likelihood involves both mu and (c, alpha), so both blankets hold it.
        if block == "mu":
            return self.log_prior_mu(z["mu"]) + self.log_likelihood(x, z)
        if block == "local":
            return self.log_prior_local(x, z) + self.log_likelihood(x, z)
        raise ValueError(f"unknown block {block!r}; the model has {list(self.blocks)}")

    def log_joint_change(
        self, block: str, x: Tensor, z_old: Mapping[str, Tensor], z_new: Mapping[str, Tensor]
    ) -> Tensor:
        return self._change_and_shape(block, x, z_old, z_new)[0]

    def log_joint_step(
        self, block: str, x: Tensor, z_old: Mapping[str, Tensor], z_new: Mapping[str, Tensor]
    ) -> tuple[Tensor, Latents]:
        return self._change_and_shape(block, x, z_old, z_new)

    def _change_and_shape(
        self, block: str, x: Tensor, z_old: Mapping[str, Tensor], z_new: Mapping[str, Tensor]
    ) -> tuple[Tensor, Latents]:
        # The particles carry g_theta(alpha) as the cache "_shape" (Model.log_joint_step):
        # each angle's shape is computed once, when it is drawn, instead of again at every
        # later block update that scores it.
        shape_old = z_old["_shape"] if "_shape" in z_old else self.g(z_old["alpha"])
        if block == "mu":  # the angles stay: one shape serves both sides
            prior = self.log_prior_mu(z_new["mu"]) - self.log_prior_mu(z_old["mu"])
            return prior + self.log_likelihood_change(x, z_new, shape_old, z_old, shape_old), {
                "_shape": shape_old
            }
        if block == "local":
            shape_new = self.g(z_new["alpha"])
            prior = self.log_prior_local(x, z_new) - self.log_prior_local(x, z_old)
            return prior + self.log_likelihood_change(x, z_new, shape_new, z_old, shape_old), {
                "_shape": shape_new
            }
        raise ValueError(f"unknown block {block!r}; the model has {list(self.blocks)}")

    def log_likelihood_change(
        self,
        x: Tensor,
        z_new: Mapping[str, Tensor],
        shape_new: Tensor,
        z_old: Mapping[str, Tensor],
        shape_old: Tensor,
    ) -> Tensor:
        """``log_likelihood(x, z_new, shape_new) - log_likelihood(x, z_old, shape_old)``, ``(L, B)``:
        the constants cancel, and both residual sums are one autograd node on CPU (two
        likelihoods and their difference were ~8 nodes, at every block update)."""
        if x.dim() != 3 or x.shape[-1] != DATA_DIM:
            raise ValueError(f"x must be shaped (B, N, 2), got {tuple(x.shape)}")
        new, old = (z_new["mu"], z_new["c"], shape_new), (z_old["mu"], z_old["c"], shape_old)
        return squared_residuals_change(x, new, old) * (-0.5 / self.cfg.noise**2)


def assigned_centres(mu: Tensor, c: Tensor) -> Tensor:
    """Each point's centre ``mu_{c_n}``, ``(L, B, N, 2)``, from ``mu (L, B, I, 2)`` and ``c (L, B, N)``."""
    return mu.gather(-2, c.unsqueeze(-1).expand(*c.shape, DATA_DIM))


def squared_residuals(x: Tensor, mu: Tensor, c: Tensor, shape: Tensor) -> Tensor:
    """``sum_n |x_n - mu_{c_n} - shape_n|^2`` ``(L, B)``: the likelihood's residuals, with
    ``x (B, N, 2)``, ``mu (L, B, I, 2)``, ``c (L, B, N)`` and ``shape = g_theta(alpha)``
    ``(L, B, N, 2)``. On CPU one compiled pass (``rings.c``: ``ring_residuals``),
    differentiable in ``shape`` (theta's path); where the data or the centres need a
    gradient (HMC), the PyTorch formula.
    """
    native = native_function("ring_residuals", x, mu, shape)
    plain = native is None or x.dim() != 3 or mu.dim() != 4 or shape.shape != (*c.shape, DATA_DIM)
    if plain or (torch.is_grad_enabled() and (x.requires_grad or mu.requires_grad)):
        return ((x - assigned_centres(mu, c) - shape) ** 2).sum((-2, -1))
    return _RingResiduals.apply(x, mu, c, shape, native, native_function("ring_residuals_backward", x))


def squared_residuals_change(
    x: Tensor, new: tuple[Tensor, Tensor, Tensor], old: tuple[Tensor, Tensor, Tensor]
) -> Tensor:
    """``squared_residuals(x, *new) - squared_residuals(x, *old)`` for two ``(mu, c, shape)``
    triples, ``(L, B)``; on CPU one autograd node (``_RingResidualsChange``) over the compiled
    passes, differentiable in both shapes."""
    (mu_new, c_new, shape_new), (mu_old, c_old, shape_old) = new, old
    native = native_function("ring_residuals", x, mu_new, shape_new, mu_old, shape_old)
    plain = (
        native is None
        or x.dim() != 3
        or mu_new.dim() != 4
        or mu_old.shape != mu_new.shape
        or c_old.shape != c_new.shape
        or shape_new.shape != (*c_new.shape, DATA_DIM)
        or shape_old.shape != shape_new.shape
    )
    if plain or (
        torch.is_grad_enabled() and (x.requires_grad or mu_new.requires_grad or mu_old.requires_grad)
    ):
        return squared_residuals(x, *new) - squared_residuals(x, *old)
    backward = native_function("ring_residuals_backward", x)
    return _RingResidualsChange.apply(x, mu_new, c_new, shape_new, mu_old, c_old, shape_old, native, backward)


class _RingResidualsChange(torch.autograd.Function):
    """``squared_residuals_change`` compiled: the residual kernels of both triples, one node."""

    @staticmethod
    def forward(ctx, x, mu_new, c_new, shape_new, mu_old, c_old, shape_old, forward_fn, backward_fn):
        x = x.contiguous()
        triples = [
            tuple(t.contiguous() for t in triple)
            for triple in ((mu_new, c_new, shape_new), (mu_old, c_old, shape_old))
        ]
        ctx.sizes = (*c_new.shape, mu_new.shape[-2])
        out_new, out_old = (x.new_empty(c_new.shape[:2]) for _ in range(2))
        for (mu, c, shape), out in zip(triples, (out_new, out_old), strict=True):
            call(forward_fn, x, mu, c, shape, out, *ctx.sizes)
        ctx.save_for_backward(x, *triples[0], *triples[1])
        ctx.backward_fn = backward_fn
        return out_new.sub_(out_old)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, mu_new, c_new, shape_new, mu_old, c_old, shape_old = ctx.saved_tensors
        grad = grad.contiguous()
        grads = []
        for (mu, c, shape), sign, wanted in (
            ((mu_new, c_new, shape_new), grad, ctx.needs_input_grad[3]),
            ((mu_old, c_old, shape_old), -grad, ctx.needs_input_grad[6]),
        ):
            grad_shape = torch.empty_like(shape) if wanted else None
            if wanted:
                call(ctx.backward_fn, x, mu, c, shape, sign, grad_shape, *ctx.sizes)
            grads.append(grad_shape)
        return None, None, None, grads[0], None, None, grads[1], None, None


class _RingResiduals(torch.autograd.Function):
    """``squared_residuals`` compiled, forward and backward (in ``shape`` only)."""

    @staticmethod
    def forward(ctx, x: Tensor, mu: Tensor, c: Tensor, shape: Tensor, forward_fn, backward_fn) -> Tensor:
        x, mu, c, shape = (t.contiguous() for t in (x, mu, c, shape))
        out = x.new_empty(c.shape[:2])
        ctx.sizes = (*c.shape, mu.shape[-2])
        call(forward_fn, x, mu, c, shape, out, *ctx.sizes)
        ctx.save_for_backward(x, mu, c, shape)
        ctx.backward_fn = backward_fn
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, mu, c, shape = ctx.saved_tensors
        grad_shape = torch.empty_like(shape)
        call(ctx.backward_fn, x, mu, c, shape, grad.contiguous(), grad_shape, *ctx.sizes)
        return None, None, None, grad_shape, None, None


def simulate_rings(
    num_datasets: int,
    num_points: int,
    generator: torch.Generator,
    num_clusters: int = 4,
    sigma0: float = 3.5,
    radius: float = 2.0,
    noise: float = 0.2,
) -> dict[str, Tensor]:
    """The true data process: points on circles of ``radius`` with Gaussian ``noise``.

    Angles are uniform on ``[0, 2 pi)`` (``torch.rand`` never returns 1, so 0 and 2 pi are
    not both drawn, unlike the authors' angle grid). Returns float64 ``x (M, N, 2)``,
    ``mu (M, I, 2)``, ``alpha (M, N)`` and long ``c (M, N)``.
    """
    if num_datasets < 1 or num_points < 1:
        raise ValueError(f"need num_datasets, num_points >= 1, got {num_datasets}, {num_points}")
    f64 = torch.float64
    mu = sigma0 * torch.randn(num_datasets, num_clusters, DATA_DIM, generator=generator, dtype=f64)
    c = torch.randint(num_clusters, (num_datasets, num_points), generator=generator)
    alpha = TWO_PI * torch.rand(num_datasets, num_points, generator=generator, dtype=f64)
    centre = mu.gather(1, c.unsqueeze(-1).expand(-1, -1, DATA_DIM))
    eps = noise * torch.randn(num_datasets, num_points, DATA_DIM, generator=generator, dtype=f64)
    return {"x": centre + radius * angle_features(alpha) + eps, "mu": mu, "c": c, "alpha": alpha}


def true_ring_log_joint(
    x: Tensor, mu: Tensor, c: Tensor, num_clusters: int, sigma0: float, radius: float, noise: float
) -> Tensor:
    """``log p(x, mu, c)`` under the simulator's own model (circles of ``radius``), the
    angles integrated out, ``(..., N, 2), (..., I, 2), (..., N) -> (...)``.

    One model for every method: a learned ring shape ``g_theta`` differs per trained cell
    (and may be rotated or mirrored against the true angle), so only ``mu`` and ``c`` are
    scored. With ``d = x_n - mu_{c_n}``, ``rho = |d|``, ``s = noise``, ``r = radius``::

        p(x_n | mu, c_n) = (2 pi)^-1 int N(d; r (cos a, sin a), s^2 I) da
                         = exp(-(rho^2 + r^2) / (2 s^2)) I_0(r rho / s^2) / (2 pi s^2),

    and ``log I_0(z) = log i0e(z) + z`` stays finite for large ``z``.
    """
    centres = mu.gather(-2, c.unsqueeze(-1).expand(*c.shape, DATA_DIM))
    rho = (x - centres).norm(dim=-1)
    s2 = noise**2
    r_rho = radius * rho / s2
    bessel = torch.log(torch.special.i0e(r_rho)) + r_rho
    per_point = -(rho**2 + radius**2) / (2 * s2) + bessel - math.log(TWO_PI * s2) - math.log(num_clusters)
    prior_mu = (-0.5 * (mu / sigma0) ** 2 - math.log(sigma0) - 0.5 * math.log(TWO_PI)).sum((-2, -1))
    return prior_mu + per_point.sum(-1)


# --------------------------------------------------------------------------- distributions


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


def pool_per_cluster(weights: Tensor, stat: Tensor, precision: Tensor, prior_precision: float):
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


def pool_assigned(per_point: Tensor, x: Tensor, c: Tensor, num_clusters: int, prior_precision: float):
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


# --------------------------------------------------------------------------- networks


class CentreEncoder(nn.Module):
    """``q(mu | x)``: per-point features give soft assignments ``gamma_n`` (softmax over I),
    a location statistic ``s_n = x_n + offset_n`` and a precision ``lambda_n``, pooled per
    cluster by ``pool_per_cluster`` (Appendix E's encoder with a conjugate-form head)."""

    def __init__(self, cfg: DGMMConfig, features: str, hidden: int):
        super().__init__()
        self.cfg = cfg
        self.features = PointFeatures(features, DATA_DIM, hidden)
        self.resp = nn.Linear(hidden, cfg.num_clusters)
        self.stat = nn.Linear(hidden, 2 * DATA_DIM)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.features(x / self.cfg.sigma0)  # O(1) inputs for the tanh units
        offset, raw = self.stat(h).chunk(2, -1)
        gamma = softmax_short(self.resp(h))
        return pool_per_cluster(gamma, x + offset, torch.exp(raw), self.cfg.sigma0**-2)


class CentreKernel(nn.Module):
    """``q(mu | x, c, alpha)``: each point's statistic ``s_n = x_n - h(alpha_n)`` and
    precision ``lambda_n(alpha_n)`` pooled over the points assigned to each cluster. The
    precision starts at ``1 / sigma_eps^2``, the exact conditional's, so training starts
    from sensible scales instead of crawling to them.

    ``h`` and ``log lambda`` come from one tanh layer of the angle's ``(cos, sin)``: the
    same class of function as ``g_theta`` (``DGMM.g``), which is all the exact conditional
    needs (its statistic is ``x_n - g_theta(alpha_n)``). A second 32 x 32 layer made this
    kernel most of a training step's arithmetic: it runs on every point of every particle.
    """

    def __init__(self, cfg: DGMMConfig, hidden: int):
        super().__init__()
        self.cfg = cfg
        self.hidden = nn.Linear(2, hidden)
        self.out = nn.Linear(hidden, 2 * DATA_DIM)
        with torch.no_grad():
            self.out.bias[DATA_DIM:] = -2.0 * math.log(cfg.noise)

    def forward(self, x: Tensor, c: Tensor, alpha: Tensor) -> tuple[Tensor, Tensor]:
        h = self.hidden
        per_point = tanh_mlp(alpha, h.weight, h.bias, self.out.weight, self.out.bias, angles=True)
        return pool_assigned(per_point, x, c, self.cfg.num_clusters, self.cfg.sigma0**-2)


class LocalNet(nn.Module):
    """Per point and cluster, from ``d = x_n - mu_i``: the assignment logit and the von Mises
    parameters of the angle under that cluster (Appendix E: FC 32 tanh on ``x_n - mu_i``).

    Two paths reach the four outputs (logit, direction (2), raw concentration):

    - a tanh layer on ``d / sigma0``. Its first layer is linear in ``d = x_n - mu_i``, so
      it is split into a per-point and a per-cluster part that broadcast against each
      other (``apg.nn.pairwise_tanh_linear``, fused with the output layer);
    - a linear skip from ``(|d|^2 / 2 sigma^2, |d| / sigma^2, log |d|, d / |d|)``. For a
      circular ring of radius r the exact conditional is *linear* in these (logit =
      -(|d| - r)^2 / 2 sigma^2 - log |d| / 2 + const, concentration = r |d| / sigma^2,
      direction = a rotation of d / |d|), so the tanh layer only has to learn how the
      shape departs from a circle. The skip starts at the exact conditional of the
      untrained model, whose g_theta is near 0 (logit = -|d|^2 / 2 sigma^2, other weights
      0): Adam moves a weight by about lr per step, so starting a weight of size 1 at 0
      would cost ~1/lr steps before assignments become sensible.
    """

    def __init__(self, cfg: DGMMConfig, hidden: int):
        super().__init__()
        self.cfg = cfg
        self.point = nn.Linear(DATA_DIM, hidden)
        self.cluster = nn.Linear(DATA_DIM, hidden, bias=False)
        self.out = nn.Linear(hidden, 4)
        self.skip = nn.Linear(5, 4, bias=False)
        with torch.no_grad():
            self.skip.weight.zero_()
            self.skip.weight[0, 0] = -1.0

    def forward(self, x: Tensor, mu: Tensor) -> LocalProposal:
        s0, s = self.cfg.sigma0, self.cfg.noise
        # The split first layer: point(x) - cluster(mu), broadcast over (point, cluster) pairs.
        point, cluster = self.point(x / s0), -self.cluster(mu / s0)
        weights = (self.out.weight, self.out.bias, self.skip.weight)
        native = native_function("local_forward", x, mu, point, cluster, *weights)
        if (
            native is not None
            and x.dim() == 3
            and mu.dim() == 4
            and not (x.requires_grad or mu.requires_grad)
        ):
            consts = x.new_tensor([0.5 / s**2, 1.0 / s**2])
            out = _LocalNetNative.apply(x, mu, point, cluster, *weights, consts, native)
            return LocalProposal.from_params(out)
        d = x.unsqueeze(-2) - mu.unsqueeze(-3)  # (L, B, N, I, 2)
        sq = (d**2).sum(-1, keepdim=True)
        norm = sq.clamp_min(1e-12).sqrt()
        skip_in = torch.cat([sq / (2 * s**2), norm / s**2, torch.log(norm), d / norm], -1)
        hidden_out = pairwise_tanh_linear(point, cluster, self.out.weight.T)
        out = hidden_out + self.out.bias + self.skip(skip_in)  # (L, B, N, I, 4)
        return LocalProposal.from_params(out)


class _LocalNetNative(torch.autograd.Function):
    """``LocalNet``'s outputs ``(L, B, N, I, 4)`` in one compiled pass (``rings.c``:
    ``local_forward``), without the (L, B, N, I, H) hidden tensor or the skip features;
    the backward recomputes both. ``x`` and ``mu`` take no gradient."""

    @staticmethod
    def forward(ctx, x, mu, point, cluster, w_out, b_out, w_skip, consts, forward_fn) -> Tensor:
        args = [t.contiguous() for t in (x, mu, point, cluster, w_out, b_out, w_skip, consts)]
        (num_particles, batch, clusters, width), num_points = cluster.shape, x.shape[1]
        out = x.new_empty(num_particles, batch, num_points, clusters, w_out.shape[0])
        ctx.sizes = (num_particles, batch, num_points, clusters, width)
        call(forward_fn, *args, out, *ctx.sizes)
        ctx.save_for_backward(*args)
        ctx.backward_fn = native_function("local_backward", x)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, mu, point, cluster, w_out, b_out, w_skip, consts = ctx.saved_tensors
        grads = [torch.zeros_like(t) for t in (point, cluster, w_out, b_out, w_skip)]
        call(ctx.backward_fn, x, mu, point, cluster, w_out, consts, grad, *grads, *ctx.sizes)
        return None, None, *grads, None, None


class DGMMProposals(Proposals):
    """Inference networks for one architecture.

    ``apg``: MLP NSS encoder q(mu | x), NSS kernel q(mu | x, c, alpha) and the local kernel
    q(c, alpha | x, mu). ``mlp`` / ``lstm``: RWS encoders q(mu | x) whose NSS point features
    come from an MLP or an LSTM, followed by the same local proposal; no kernels.
    """

    def __init__(self, cfg: DGMMConfig, architecture: str = "apg", hidden: int = 32):
        super().__init__()
        features = {"apg": "mlp", "mlp": "mlp", "lstm": "lstm"}.get(architecture)
        if features is None:
            raise ValueError(f"unknown DGMM architecture {architecture!r}; choose apg, mlp or lstm")
        self.cfg = cfg
        self.architecture = architecture
        self.encoder = CentreEncoder(cfg, features, hidden)
        self.local = LocalNet(cfg, hidden)
        if architecture == "apg":
            self.centre_kernel = CentreKernel(cfg, hidden)

    def initial(self, x: Tensor, num_particles: int) -> tuple[Latents, Tensor]:
        mean, prec = self.encoder(x)
        shape = (num_particles, *mean.shape)
        q_mu = gaussian_mu(mean.expand(shape), prec.expand(shape))
        mu = q_mu.sample()
        q_local = self.local(x, mu["mu"])
        local = q_local.sample()
        return {**mu, **local}, q_mu.log_prob(mu) + q_local.log_prob(local)

    def kernel(self, block: str, x: Tensor, z: Mapping[str, Tensor]):
        if block == "local":
            return self.local(x, z["mu"])
        if block == "mu" and self.architecture == "apg":
            return gaussian_mu(*self.centre_kernel(x, z["c"], z["alpha"]))
        return super().kernel(block, x, z)


# --------------------------------------------------------------------------- task spec


def build_model(**hparams) -> DGMM:
    """``DGMM(DGMMConfig(**hparams))``: num_clusters, sigma0, noise, hidden."""
    return DGMM(DGMMConfig(**hparams))


def build_proposals(model: DGMM, architecture: str, hidden: int = 32) -> DGMMProposals:
    return DGMMProposals(model.cfg, architecture, hidden)


def simulate(
    model: DGMM,
    num_datasets: int,
    generator: torch.Generator,
    num_points: int = 200,
    radius: float = 2.0,
    noise: float | None = None,
) -> dict[str, Tensor]:
    """Datasets of rings with the model's I and sigma0; ``noise`` defaults to the model's
    sigma_eps. The simulator is the *true* process (fixed circles of ``radius``), not
    ``p_theta``, whose shape is learned."""
    cfg = model.cfg
    return simulate_rings(
        num_datasets,
        num_points,
        generator,
        cfg.num_clusters,
        cfg.sigma0,
        radius,
        cfg.noise if noise is None else noise,
    )


def reconstruct(model: DGMM, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
    """Mean of ``p_theta(x | z)``: ``g_theta(alpha_n) + mu_{c_n}``, ``(L, B, N, 2)``."""
    return model.mean(z)


def sample_data(model: DGMM, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
    """``TaskSpec.sample_data``: ``x_n ~ N(mu_{c_n} + g_theta(alpha_n), sigma_eps^2 I)``,
    ``(L, B, N, 2)``."""
    mean = model.mean(z)
    return mean + model.cfg.noise * torch.randn_like(mean)


def draw(ax, x: np.ndarray, z: Mapping[str, np.ndarray], model: DGMM | None = None) -> None:
    """Scatter one dataset ``x (N, 2)`` coloured by ``z["c"] (N,)`` and mark the centres
    ``z["mu"] (I, 2)``; draw the learned ring around each centre.

    The ring is ``mu_i + g_theta`` over a grid of angles when ``model`` is given; otherwise,
    when ``z`` carries ``"recon" (N, 2)`` (this particle's ``reconstruct`` output), each
    point's reconstruction is marked, a ring of dots on the learned shape (joining ~N/I
    dots into a polygon would draw a shape the model does not have). With neither, only
    points and centres are drawn (``TaskSpec.draw`` gets no model).
    """
    c, mu = np.asarray(z["c"]), np.asarray(z["mu"])
    colours = [f"C{i % 10}" for i in range(len(mu))]
    ax.scatter(x[:, 0], x[:, 1], s=6, c=[colours[i] for i in c], alpha=0.7, linewidths=0)
    shape = None
    if model is not None:
        with torch.no_grad():
            grid = torch.linspace(0.0, TWO_PI, 101, dtype=next(model.parameters()).dtype)
            shape = model.g(grid).numpy()
    for i, centre in enumerate(mu):
        if shape is not None:
            curve = centre + shape
            ax.plot(curve[:, 0], curve[:, 1], color=colours[i], lw=1.0)
        elif "recon" in z:
            recon = np.asarray(z["recon"])[c == i]
            ax.scatter(
                recon[:, 0], recon[:, 1], s=5, marker="o", facecolors="none", edgecolors=colours[i], lw=0.6
            )
        ax.scatter([centre[0]], [centre[1]], marker="x", color=colours[i], s=30)
    ax.set_aspect("equal")


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
)
