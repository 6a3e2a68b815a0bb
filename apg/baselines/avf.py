"""Amortized variational filtering (Marino, Cvitkovic & Yue 2018) for Bouncing MNIST.

A filtering approximate posterior, every factor a diagonal Gaussian with parameters
``lambda = (m, log s)``:

    q(z_what, z_where_{1:T} | x) = prod_t q(z_where_t | x_t, z_where_{t-1}) * q(z_what | x, z_where_{1:T})

Positions (the state of the state-space model), frame by frame (the paper's Algorithm 1):

1. *predict*: ``lambda_t`` starts at the prior ``p(z_where_t | z_where_{t-1})``, i.e.
   ``m = z_where_{t-1}`` (the previous frame's sample), ``s = sigma0``; ``N(0, I)`` at t = 1;
2. *update* (eq. 13), ``iterations`` times:
   ``lambda_t <- f_phi(lambda_t, grad_lambda F_t)`` with the step free energy (eq. 8-9)
   ``F_t = -E_q[log p(x_t | z_what, z_where_t)] + KL(q(z_where_t) || p(z_where_t | z_where_{t-1}))``;
   the expectation is a reparameterized one-sample estimate, the KL is exact;
3. sample ``z_where_t ~ q(lambda_t)`` and move on to frame t + 1.

While filtering, the digits are drawn as the decoder's template at the prior mean of
the codes, ``mu_theta(0)``: ``z_what`` is not inferred yet, and the filter only needs ink
to follow. Then the digit codes, once per video, the same way: ``lambda_what`` starts at
the prior ``N(0, I)`` and is refined ``iterations`` times by ``g_phi(lambda_what,
grad F / T)`` with ``F = -E_q[sum_t log p(x_t | z_what, z_where_t)] + KL(q(z_what) || N(0, I))``
at the filtered positions (divided by T so that the network reads a per-frame gradient
whatever the video's length).

The update networks ``f_phi`` and ``g_phi`` act on each digit separately (D is a
property of the data, not of the weights). Each reads the estimate and its gradient,
the gradient squashed by ``sign(g) log(1 + |g|)`` (the paper layer-normalizes its
inputs; over a 2-d position that would keep only the signs), and returns a residual
update: a learned step along the squashed gradient plus a two-layer ELU network's
correction (zero at initialization, so an untrained model takes small gradient steps
from the prior prediction). The gradients it reads are inputs, detached, as in
iterative amortized inference: no second derivatives.

Training (the paper's variational EM, both steps on one objective): the negative ELBO,
``-E_q[log p(x, z) - log q(z | x)]`` (the filtering free energy, eq. 7), one
reparameterized sample per particle, minimized jointly in phi (the update networks)
and theta (the decoder), gradients through the whole filter.

Budget and compute: a cell of K sweeps x L particles draws ``K * L`` independent
filtering samples in one step (like RWS and reparam), each weighted by
``p(x, z) / q(z | x)`` for the ESS and evidence estimates. Per sample it evaluates the
likelihood of every frame ``4 * iterations + 1`` times, counting a gradient as two
(``Method.model_evaluations``).

Legend: L particles (independent filters), B videos, T frames, D digits, Z code dim,
S digit side, E a Gaussian's event shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from apg.baselines.method import Method
from apg.blocks import Latents, Model, Proposals, TaskSpec
from apg.nn import linear
from apg.objectives import negative_elbo
from apg.smc.sampler import APGResult, Collector, Step, sweep_stats
from apg.smc.weights import normalized_weights, sanitize
from apg.tasks.bmnist import TASK as BMNIST_TASK
from apg.tasks.bmnist import BouncingMNIST, where_key

# Bounds on log s, so that no refinement can collapse or explode a factor.
LOG_SCALE_MIN, LOG_SCALE_MAX = -6.0, 1.0


class Gaussian(NamedTuple):
    """Parameters ``lambda`` of a diagonal Gaussian factor, each ``(L, B, *E)``."""

    loc: Tensor
    log_scale: Tensor

    def rsample(self) -> Tensor:
        return self.loc + torch.exp(self.log_scale) * torch.randn_like(self.loc)

    def log_prob(self, value: Tensor) -> Tensor:
        """``log q(value)`` summed over the event dims, ``(L, B)``."""
        eps = (value - self.loc) * torch.exp(-self.log_scale)
        return (-0.5 * eps**2 - self.log_scale - 0.5 * math.log(2 * math.pi)).flatten(2).sum(-1)


def gaussian_kl(q: Gaussian, prior_loc: Tensor, prior_scale: Tensor | float) -> Tensor:
    """``KL(N(q.loc, s^2) || N(prior_loc, prior_scale^2))`` summed over event dims, ``(L, B)``."""
    prior_scale = torch.as_tensor(prior_scale, dtype=q.loc.dtype, device=q.loc.device)
    var_ratio = torch.exp(2.0 * q.log_scale) / prior_scale**2
    mahalanobis = (q.loc - prior_loc) ** 2 / prior_scale**2
    kl = 0.5 * (var_ratio + mahalanobis - 1.0) - q.log_scale + torch.log(prior_scale)
    return kl.flatten(2).sum(-1)


def free_energy_grad(
    q: Gaussian,
    log_lik: Callable[[Tensor], Tensor],
    prior_loc: Tensor,
    prior_scale: Tensor | float,
    samples: int = 1,
) -> tuple[Tensor, Gaussian]:
    """The step free energy and its gradient in ``lambda = (m, log s)`` (eq. 8-9).

    ``F(lambda) = -E_q[log_lik(z)] + KL(q || N(prior_loc, prior_scale^2))``: the expectation
    is a reparameterized Monte Carlo estimate over ``samples`` draws, the KL is exact.
    ``log_lik`` maps ``z (L, B, *E)`` to ``(L, B)``. Returns ``F (L, B)`` and
    ``grad_lambda F`` (both detached: the inference model reads them as inputs).
    Particles and datasets are independent, so the gradient of the sum is each one's own.
    """
    with torch.enable_grad():
        lam = Gaussian(q.loc.detach().requires_grad_(True), q.log_scale.detach().requires_grad_(True))
        expected = sum(log_lik(lam.rsample()) for _ in range(_check_samples(samples))) / samples
        value = -expected + gaussian_kl(lam, prior_loc.detach(), prior_scale)
        g_loc, g_log_scale = torch.autograd.grad(value.sum(), [lam.loc, lam.log_scale])
    return value.detach(), Gaussian(g_loc, g_log_scale)


def _check_samples(samples: int) -> int:
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be an integer >= 1, got {samples!r}")
    return samples


Update = Callable[[Gaussian, Gaussian], Gaussian]


def refine(
    q: Gaussian,
    log_lik: Callable[[Tensor], Tensor],
    prior_loc: Tensor,
    prior_scale: Tensor | float,
    update: Update,
    iterations: int,
    grad_scale: float = 1.0,
    samples: int = 1,
) -> Gaussian:
    """``iterations`` inference updates ``lambda <- update(lambda, grad_scale * grad F)`` (eq. 13).

    ``update(lambda, gradient)`` is the iterative inference model; the result keeps the
    update's graph (the gradients it reads are detached), so the free energy of the final
    estimate trains it.
    """
    for _ in range(iterations):
        _, grad = free_energy_grad(q, log_lik, prior_loc, prior_scale, samples)
        q = update(q, Gaussian(grad.loc * grad_scale, grad.log_scale * grad_scale))
    return q


def variational_filter(
    num_steps: int,
    predict: Callable[[int, Tensor | None], tuple[Tensor, Tensor | float]],
    step_log_lik: Callable[[int, Tensor], Tensor],
    update: Update,
    iterations: int,
    samples: int = 1,
) -> tuple[list[Tensor], Tensor, list[Gaussian]]:
    """Amortized variational filtering of a state-space model (the paper's Algorithm 1 with
    eq. 13 as its inference step).

    For t = 1..T: ``predict(t, z_{t-1})`` gives the prior ``p(z_t | z_{t-1})`` as a mean
    ``(L, B, *E)`` and a scale (``z_0 = None``); ``q_t`` starts there and is refined
    ``iterations`` times on the step free energy of ``step_log_lik(t, z_t) = log p(x_t | z_t)``
    ``(L, B)``; then ``z_t ~ q_t`` (reparameterized). Returns the samples ``[z_1 .. z_T]``,
    ``log q(z_{1:T}) = sum_t log q_t(z_t)`` ``(L, B)`` and the refined ``q_t``.
    """
    zs: list[Tensor] = []
    qs: list[Gaussian] = []
    log_q: Tensor | None = None
    prev: Tensor | None = None
    for t in range(1, num_steps + 1):
        prior_loc, prior_scale = predict(t, prev)
        log_s = torch.log(torch.as_tensor(prior_scale, dtype=prior_loc.dtype, device=prior_loc.device))
        q = Gaussian(prior_loc, log_s.expand_as(prior_loc))

        def log_lik(z: Tensor, t: int = t) -> Tensor:
            return step_log_lik(t, z)

        q = refine(q, log_lik, prior_loc, prior_scale, update, iterations, samples=samples)
        z = q.rsample()
        term = q.log_prob(z)
        log_q = term if log_q is None else log_q + term
        zs.append(z)
        qs.append(q)
        prev = z
    assert log_q is not None, "need at least one step"
    return zs, log_q, qs


def squash(g: Tensor) -> Tensor:
    """``sign(g) log(1 + |g|)``: gradients of image likelihoods span orders of magnitude."""
    return torch.sign(g) * torch.log1p(g.abs())


class IterativeUpdate(nn.Module):
    """``f_phi(lambda, grad)`` for one digit's Gaussian over ``dim`` variables (eq. 13).

    Input: ``m``, ``log s`` and the squashed gradients in both (``4 * dim`` features);
    output: ``lambda - a * squash(grad) + MLP(features)`` with a learned per-variable step
    ``a = softplus(.) > 0`` (0.05 at initialization) and an MLP (two ELU layers, as in the
    paper's appendix B) whose last layer starts at zero.
    """

    def __init__(self, dim: int, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(4 * dim, hidden),
            nn.ELU(),
            nn.Linear(hidden, hidden),
            nn.ELU(),
            nn.Linear(hidden, 2 * dim),
        )
        last = linear(self.net[-1])
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)
        self.step = nn.Parameter(torch.full((2 * dim,), math.log(math.expm1(0.05))))

    def forward(self, q: Gaussian, grad: Gaussian) -> Gaussian:
        g = squash(torch.cat([grad.loc, grad.log_scale], -1))
        lam = torch.cat([q.loc, q.log_scale], -1)
        new = lam - F.softplus(self.step) * g + self.net(torch.cat([lam, g], -1))
        loc, log_scale = new.chunk(2, dim=-1)
        return Gaussian(loc, log_scale.clamp(LOG_SCALE_MIN, LOG_SCALE_MAX))


class AVFProposals(Proposals):
    """The AVF filter for Bouncing MNIST (module docstring): ``where_update`` refines each
    frame's positions, ``what_update`` the digit codes.

    ``num_digits`` (D) is a property of the data (held-out sets override it); the weights
    do not depend on it. ``iterations`` is the number of inference updates per frame and
    for the codes.
    """

    def __init__(self, model: BouncingMNIST, num_digits: int = 3, iterations: int = 2, hidden: int = 64):
        super().__init__()
        if not isinstance(model, BouncingMNIST):
            raise ValueError(f"AVF is implemented for Bouncing MNIST; got a {type(model).__name__}")
        self.model = [model]  # a plain list: the decoder is theta's, not a submodule of phi
        self.num_digits = num_digits
        self.iterations = iterations
        self.where_update = IterativeUpdate(2, hidden)
        self.what_update = IterativeUpdate(model.cfg.z_what_dim, hidden)

    def rsample(self, x: Tensor, num_particles: int) -> tuple[Latents, Tensor]:
        """Reparameterized ``z ~ q(z | x)`` ``{name: (L, B, ...)}`` and ``log q(z | x)`` ``(L, B)``,
        both differentiable in phi and theta."""
        model = self.model[0]
        cfg = model.cfg
        batch, num_frames = x.shape[:2]
        shape = (num_particles, batch, self.num_digits)
        # The filter's digits: the decoder's template at the prior mean of the codes.
        blob = model.decoder(x.new_zeros(cfg.z_what_dim)).detach()
        templates = blob.expand(*shape, *blob.shape)

        def predict(t: int, prev: Tensor | None) -> tuple[Tensor, float]:
            # the prior p(z_where_t | z_where_{t-1}); N(0, I) at t = 1
            return (prev, cfg.sigma0) if prev is not None else (x.new_zeros(*shape, 2), 1.0)

        def frame_log_lik(t: int, where: Tensor) -> Tensor:
            return model.log_likelihood(x, templates, {where_key(t): where}, t, t)

        wheres, log_q, _ = variational_filter(
            num_frames, predict, frame_log_lik, self.where_update, self.iterations
        )
        z: Latents = {where_key(t): w for t, w in enumerate(wheres, start=1)}
        positions = {k: v.detach() for k, v in z.items()}
        q_what = Gaussian(x.new_zeros(*shape, cfg.z_what_dim), x.new_zeros(*shape, cfg.z_what_dim))

        def video_log_lik(z_what: Tensor) -> Tensor:
            return model.log_likelihood(x, model.decoder(z_what), positions, 1, num_frames)

        q_what = refine(
            q_what, video_log_lik, q_what.loc, 1.0, self.what_update, self.iterations, 1.0 / num_frames
        )
        z_what = q_what.rsample()
        z["z_what"] = z_what
        return z, log_q + q_what.log_prob(z_what)

    def initial(self, x: Tensor, num_particles: int) -> tuple[Latents, Tensor]:
        z, log_q = self.rsample(x, num_particles)
        return {k: v.detach() for k, v in z.items()}, log_q


class AVF(Method):
    """Amortized variational filtering (module docstring); option ``iterations`` (>= 0)."""

    name = "avf"
    architecture = "avf"
    kernels = False
    not_compiled_because = "its filter refines each update by gradient steps inside the step"
    defaults = {"iterations": 2}

    def check_options(self) -> None:
        n = self.options["iterations"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"method_options.iterations must be an integer >= 0, got {n!r}")

    def check_task(self, task: TaskSpec) -> None:
        if task.name != BMNIST_TASK.name:
            raise ValueError(
                f"method {self.name!r} is implemented for task {BMNIST_TASK.name!r} only, not {task.name!r}"
            )

    def build_proposals(self, task: TaskSpec, model: Model, **network: Any) -> Proposals:
        self.check_task(task)
        return AVFProposals(model, iterations=self.options["iterations"], **network)  # type: ignore[arg-type]

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
        if sweeps < 1 or particles < 1:
            raise ValueError(f"need K >= 1 and L >= 1, got K={sweeps}, L={particles}")
        assert isinstance(proposals, AVFProposals)  # what build_proposals makes
        z, log_q = proposals.rsample(x, sweeps * particles)
        log_p = model.log_joint(x, z)
        log_w = sanitize((log_p - log_q).detach())
        detached = {k: v.detach() for k, v in z.items()}
        stats = sweep_stats(log_w, log_p)
        for collect in collectors:
            collect(1, detached, log_w)
        # The step holds the ELBO integrand's terms, log q(z | x) and log p(x, z), both
        # differentiable through the reparameterized samples (phi) and the decoder (theta).
        return APGResult(detached, log_w, log_p, [stats], [Step(normalized_weights(log_w), log_q, log_p)])

    def loss(self, result: APGResult) -> Tensor:
        return negative_elbo(result)

    def model_evaluations(self, sweeps: int, particles: int) -> list[float]:
        # Per sample: every frame's likelihood gradient `iterations` times while filtering
        # and `iterations` times for the codes (2 each), then the log joint once.
        return [float(sweeps * particles * (1 + 4 * self.options["iterations"]))]
