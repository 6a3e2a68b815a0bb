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

Legend: L particles, B datasets, N points, I clusters, H hidden units, F features.
Latents: ``mu (L, B, I, 2)``, ``c (L, B, N)`` (long), ``alpha (L, B, N)`` in [0, 2 pi).
Data ``x``: ``(B, N, 2)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from apg.blocks import Latents, Model
from apg.kernels import call
from apg.kernels.ops import KernelOp
from apg.nn import linear, tanh_mlp

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
        first, last = linear(self.shape_net[0]), linear(self.shape_net[2])
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
    gradient (HMC), the PyTorch formula. The op ``apg::ring_residuals``.
    """
    return ring_residuals_op(x, mu, c, shape)


def squared_residuals_change(
    x: Tensor, new: tuple[Tensor, Tensor, Tensor], old: tuple[Tensor, Tensor, Tensor]
) -> Tensor:
    """``squared_residuals(x, *new) - squared_residuals(x, *old)`` for two ``(mu, c, shape)``
    triples, ``(L, B)``; on CPU one autograd node over the compiled passes, differentiable in
    both shapes. The op ``apg::ring_residuals_change``."""
    return ring_residuals_change_op(x, *new, *old)


def _no_grad_in(*tensors: Tensor) -> bool:
    """Whether none of ``tensors`` (the data, the centres) asks for a gradient: the compiled
    passes differentiate in the shapes only."""
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def _residuals_applies(x: Tensor, mu: Tensor, c: Tensor, shape: Tensor, *_: Tensor) -> bool:
    return x.dim() == 3 and mu.dim() == 4 and shape.shape == (*c.shape, DATA_DIM) and _no_grad_in(x, mu)


def _residuals_twin(x: Tensor, mu: Tensor, c: Tensor, shape: Tensor) -> Tensor:
    return ((x - assigned_centres(mu, c) - shape) ** 2).sum((-2, -1))


def _residuals_native(fn, x: Tensor, mu: Tensor, c: Tensor, shape: Tensor) -> Tensor:
    x, mu, c, shape = (t.contiguous() for t in (x, mu, c, shape))
    out = x.new_empty(c.shape[:2])
    call(fn, x, mu, c, shape, out, *c.shape, mu.shape[-2])
    return out


def _residuals_backward_twin(x: Tensor, mu: Tensor, c: Tensor, shape: Tensor, grad: Tensor) -> Tensor:
    return -2 * (x - assigned_centres(mu, c) - shape) * grad.unsqueeze(-1).unsqueeze(-1)


def _residuals_backward_native(fn, x: Tensor, mu: Tensor, c: Tensor, shape: Tensor, grad: Tensor) -> Tensor:
    x, mu, c, shape = (t.contiguous() for t in (x, mu, c, shape))
    grad_shape = torch.empty_like(shape)
    call(fn, x, mu, c, shape, grad.contiguous(), grad_shape, *c.shape, mu.shape[-2])
    return grad_shape


def _save_inputs(ctx, inputs: tuple, output) -> None:
    ctx.save_for_backward(*inputs)


# ``squared_residuals``; differentiable in ``shape`` only.
ring_residuals_op = KernelOp(
    "ring_residuals",
    _residuals_twin,
    kernel="ring_residuals",
    native=_residuals_native,
    applies=_residuals_applies,
    checked=lambda x, mu, c, shape: (x, mu, shape),
    fake=lambda x, mu, c, shape: x.new_empty(c.shape[:2]),
    backward=KernelOp(
        "ring_residuals_backward",
        _residuals_backward_twin,
        kernel="ring_residuals_backward",
        native=_residuals_backward_native,
        applies=lambda x, mu, c, shape, grad: x.dim() == 3 and mu.dim() == 4,
        checked=lambda x, mu, c, shape, grad: (x,),
        fake=lambda x, mu, c, shape, grad: shape.new_empty(shape.shape),
    ),
    setup_context=_save_inputs,
    gradients=lambda ctx, grads, run, wants: (None, None, None, run(*ctx.saved_tensors, grads[0])),
)


def _change_applies(
    x: Tensor,
    mu_new: Tensor,
    c_new: Tensor,
    shape_new: Tensor,
    mu_old: Tensor,
    c_old: Tensor,
    shape_old: Tensor,
) -> bool:
    if x.dim() != 3 or mu_new.dim() != 4 or mu_old.shape != mu_new.shape or c_old.shape != c_new.shape:
        return False
    if shape_new.shape != (*c_new.shape, DATA_DIM) or shape_old.shape != shape_new.shape:
        return False
    return _no_grad_in(x, mu_new, mu_old)


def _change_twin(
    x: Tensor,
    mu_new: Tensor,
    c_new: Tensor,
    shape_new: Tensor,
    mu_old: Tensor,
    c_old: Tensor,
    shape_old: Tensor,
) -> Tensor:
    return _residuals_twin(x, mu_new, c_new, shape_new) - _residuals_twin(x, mu_old, c_old, shape_old)


def _change_eager(
    x: Tensor,
    mu_new: Tensor,
    c_new: Tensor,
    shape_new: Tensor,
    mu_old: Tensor,
    c_old: Tensor,
    shape_old: Tensor,
) -> Tensor:
    return squared_residuals(x, mu_new, c_new, shape_new) - squared_residuals(x, mu_old, c_old, shape_old)


def _change_native(
    fn,
    x: Tensor,
    mu_new: Tensor,
    c_new: Tensor,
    shape_new: Tensor,
    mu_old: Tensor,
    c_old: Tensor,
    shape_old: Tensor,
) -> Tensor:
    """The residual kernels of both triples."""
    x = x.contiguous()
    triples = [
        tuple(t.contiguous() for t in triple)
        for triple in ((mu_new, c_new, shape_new), (mu_old, c_old, shape_old))
    ]
    sizes = (*c_new.shape, mu_new.shape[-2])
    out_new, out_old = (x.new_empty(c_new.shape[:2]) for _ in range(2))
    for (mu, c, shape), out in zip(triples, (out_new, out_old), strict=True):
        call(fn, x, mu, c, shape, out, *sizes)
    return out_new.sub_(out_old)


def _change_gradients(ctx, grads, run, wants):
    x, mu_new, c_new, shape_new, mu_old, c_old, shape_old = ctx.saved_tensors
    grad = grads[0].contiguous()
    grad_new = run(x, mu_new, c_new, shape_new, grad) if wants[3] else None
    grad_old = run(x, mu_old, c_old, shape_old, -grad) if wants[6] else None
    return None, None, None, grad_new, None, None, grad_old


# ``squared_residuals_change`` of triples ``(mu, c, shape)`` new and old; differentiable in
# both shapes.
ring_residuals_change_op = KernelOp(
    "ring_residuals_change",
    _change_twin,
    kernel="ring_residuals",
    native=_change_native,
    applies=_change_applies,
    checked=lambda x, mu_new, c_new, shape_new, mu_old, c_old, shape_old: (
        x,
        mu_new,
        shape_new,
        mu_old,
        shape_old,
    ),
    fake=lambda x, mu_new, c_new, *_: x.new_empty(c_new.shape[:2]),
    eager_twin=_change_eager,
    backward=ring_residuals_op.backward,
    setup_context=_save_inputs,
    gradients=_change_gradients,
)


def build_model(**hparams: Any) -> DGMM:
    """``DGMM(DGMMConfig(**hparams))``: num_clusters, sigma0, noise, hidden."""
    return DGMM(DGMMConfig(**hparams))


def reconstruct(model: DGMM, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
    """Mean of ``p_theta(x | z)``: ``g_theta(alpha_n) + mu_{c_n}``, ``(L, B, N, 2)``."""
    return model.mean(z)


def sample_data(model: DGMM, x: Tensor, z: Mapping[str, Tensor]) -> Tensor:
    """``TaskSpec.sample_data``: ``x_n ~ N(mu_{c_n} + g_theta(alpha_n), sigma_eps^2 I)``,
    ``(L, B, N, 2)``."""
    mean = model.mean(z)
    return mean + model.cfg.noise * torch.randn_like(mean)
