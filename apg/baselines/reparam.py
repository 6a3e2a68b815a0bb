"""Stochastic backpropagation (Rezende, Mohamed & Wierstra 2014).

A Gaussian recognition model ``q_phi(u | x)`` (diagonal covariance) over the model's
unconstrained continuous latents, trained on the ELBO (exclusive KL) with gradients
through the samples ``u = m(x) + s(x) * eps``, ``eps ~ N(0, I)``. Discrete latents are
summed out of the likelihood by the model's continuous view
(``apg.baselines.continuous``), so only continuous latents are sampled (per dataset, and
per point where the model has per-point ones, e.g. the rings' angles); for reporting,
they are then drawn from their exact conditional, which leaves the importance weight
``p(x, u) / q(u | x)`` unchanged, so ``log_evidence`` is the paper's appendix-E estimate.

Budget: a cell of K sweeps x L particles draws ``K * L`` samples in one step (like RWS).

Legend: L samples, B datasets, N points, H hidden units, F flattened per-dataset latent
dims, G flattened per-point latent dims.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from apg.baselines.continuous import ContinuousTarget, continuous_target
from apg.baselines.method import Method
from apg.blocks import Latents, Model, Proposals, TaskSpec
from apg.nn import linear
from apg.objectives import negative_elbo
from apg.smc.sampler import APGResult, Collector, Step, sweep_stats
from apg.smc.weights import normalized_weights, sanitize


class GaussianRecognition(Proposals):
    """``q_phi(u | x) = N(u; m(x), diag s(x)^2)`` from a permutation-invariant set encoder.

    Each point ``(B, N, P)`` goes through a tanh MLP to features ``h_n``, averaged over the
    points to ``h``. A head on ``h`` gives ``m`` and ``log s`` for every per-dataset latent
    (``target.event_shapes``); a point head on ``[h_n, h]`` gives each point's own ``m`` and
    ``log s`` for every per-point latent (``target.point_shapes``), so the same weights
    serve any N. Output layers start at zero (``q = N(0, I)``, the breadth of the priors).
    """

    def __init__(self, target: ContinuousTarget, hidden: int = 32):
        super().__init__()
        self.target = target
        self.shapes = dict(target.event_shapes)
        self.sizes = {k: math.prod(s) for k, s in self.shapes.items()}
        self.point_shapes = dict(target.point_shapes)
        self.point_sizes = {k: math.prod(s) for k, s in self.point_shapes.items()}
        total, point_total = sum(self.sizes.values()), sum(self.point_sizes.values())
        self.points = nn.Sequential(
            nn.Linear(target.point_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh()
        )
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 2 * total))
        outputs = [linear(self.head[-1])]
        # Only models with per-point latents get the point head (the GMM's parameters, and
        # so its checkpoints, are unchanged).
        self.point_head: nn.Sequential | None = None
        if point_total:
            self.point_head = nn.Sequential(
                nn.Linear(2 * hidden, hidden), nn.Tanh(), nn.Linear(hidden, 2 * point_total)
            )
            outputs.append(linear(self.point_head[-1]))
        for layer in outputs:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def _features(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Point features ``(B, N, H)`` and their mean over the points ``(B, H)``."""
        h = self.points(self.target.points(x))
        return h, h.mean(-2)

    def gaussian(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Mean and standard deviation of the per-dataset latents, each ``(B, F)``."""
        return self._dataset_gaussian(self._features(x)[1])

    def point_gaussian(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Mean and standard deviation of each point's latents, each ``(B, N, G)``
        (``G = 0`` without per-point latents)."""
        return self._point_gaussian(*self._features(x))

    def _dataset_gaussian(self, pooled: Tensor) -> tuple[Tensor, Tensor]:
        loc, log_scale = self.head(pooled).chunk(2, dim=-1)
        return loc, torch.exp(log_scale)

    def _point_gaussian(self, h: Tensor, pooled: Tensor) -> tuple[Tensor, Tensor]:
        if self.point_head is None:
            empty = h.new_zeros((*h.shape[:-1], 0))
            return empty, empty
        both = torch.cat([h, pooled.unsqueeze(-2).expand_as(h)], -1)  # (B, N, 2H)
        loc, log_scale = self.point_head(both).chunk(2, dim=-1)
        return loc, torch.exp(log_scale)

    def rsample(self, x: Tensor, num_samples: int) -> tuple[Latents, Tensor]:
        """Reparameterized ``u ~ q(u | x)`` (``{name: (L, B, *event)}`` and
        ``{name: (L, B, N, *point)}``) and ``log q(u | x)`` ``(L, B)``."""
        h, pooled = self._features(x)
        u: Latents = {}
        log_q: list[Tensor] = []
        parts = (
            (self._dataset_gaussian(pooled), self.sizes, self.shapes),
            (self._point_gaussian(h, pooled), self.point_sizes, self.point_shapes),
        )
        for (loc, scale), sizes, shapes in parts:
            if not sizes:
                continue
            eps = torch.randn((num_samples, *loc.shape), dtype=loc.dtype, device=loc.device)
            flat = loc + scale * eps
            log_n = -0.5 * eps**2 - torch.log(scale) - 0.5 * math.log(2 * math.pi)
            log_q.append(log_n.flatten(2).sum(-1))
            start = 0
            for name, size in sizes.items():
                # (L, B, F) -> (L, B, *event); (L, B, N, G) -> (L, B, N, *point)
                lead = flat.shape[:-1]
                u[name] = flat[..., start : start + size].reshape(*lead, *shapes[name])
                start += size
        return u, torch.stack(log_q).sum(0)

    def initial(self, x: Tensor, num_particles: int) -> tuple[Latents, Tensor]:
        """All latents (discrete ones from their exact conditional) and their density
        ``q(z | x) = q(u | x) / |dz/du| * p(z_disc | x, z_cont)``, so that
        ``p(x, z) / q(z | x) = p(x, u) / q(u | x)``, the appendix-E weight."""
        u, log_q = self.rsample(x, num_particles)
        u = {k: v.detach() for k, v in u.items()}
        z, log_disc = self.target.complete(x, u)
        return z, log_q - self.target.log_det_jacobian(u) + log_disc


class Reparam(Method):
    """Stochastic backpropagation with a Gaussian recognition model (module docstring)."""

    name = "reparam"
    architecture = "reparam"
    kernels = False

    def check_task(self, task: TaskSpec) -> None:
        """Any task whose model has a continuous view; that is checked at build time,
        when the model exists (``continuous_target`` raises ``ValueError``)."""

    def build_proposals(self, task: TaskSpec, model: Model, **network: Any) -> Proposals:
        hidden = network.get("hidden", 32)
        return GaussianRecognition(continuous_target(model), hidden)

    def run(
        self,
        model: Model,
        proposals: Proposals,
        x: Tensor,
        sweeps: int,
        particles: int,
        resample_mode: str = "block",
        resampler: str = "systematic",
        collectors: Iterable[Collector] = (),
    ) -> APGResult:
        assert isinstance(proposals, GaussianRecognition)  # what build_proposals makes
        num = sweeps * particles
        target = proposals.target
        u, log_q = proposals.rsample(x, num)
        log_f = target.log_density(x, u)  # log p(x, u), discrete latents summed out
        with torch.no_grad():
            z, _ = target.complete(x, {k: v.detach() for k, v in u.items()})
        log_p = model.log_joint(x, z)
        log_w = sanitize((log_f - log_q).detach())
        stats = sweep_stats(log_w, log_p)
        for collect in collectors:
            collect(1, z, log_w)
        # The step's terms are the ELBO integrand's: log q(u | x) and log p(x, u), both
        # differentiable through the reparameterized samples.
        return APGResult(z, log_w, log_p, [stats], [Step(normalized_weights(log_w), log_q, log_f)])

    def model_evaluations(self, sweeps: int, particles: int) -> list[float]:
        return [float(2 * sweeps * particles)]  # the marginal log p(x, u), then log p(x, z)

    def loss(self, result: APGResult) -> Tensor:
        return negative_elbo(result)
