"""HMC-RWS: samples from the RWS encoder, improved by Hamiltonian Monte Carlo.

The encoder ``q_phi(z | x)`` (an RWS architecture) proposes L particles, weighted by
``p(x, z) / q(z | x)``; the encoder trains on these by RWS (eq. 5 at the initial step).
Then ``K - 1`` resample-move steps: resample, one HMC transition on the unconstrained
continuous latents of the model's continuous view (``apg.baselines.continuous``: GMM
``mu`` and ``log tau``, rings ``mu`` and every point's ``logit(alpha / 2 pi)``, with the
assignments summed out), and the discrete latents redrawn from their exact conditional.
Both moves leave ``p(z | x)`` invariant, so the weights do not change (after resampling
they are uniform, and ESS/L reports 1: an HMC move's quality shows in the log joint, not
in the weights). The generative model's gradient (eq. 6) uses the final, HMC-improved
particles.

Budget: a cell of K sweeps x L particles runs L particles and K - 1 HMC transitions,
each of ``leapfrog_steps`` gradient evaluations, so it spends
``L * (1 + (K - 1) * leapfrog_steps)`` model-gradient evaluations.

Unlike the authors' code (whose leapfrog never moved the positions), ``leapfrog``
updates both position and momentum, and ``hmc_step`` applies the Metropolis correction;
the run reports its acceptance rate (``Method.diagnostics``: ``accept``), which training
logs (MLflow) and evaluation keeps (the report's methods table).

Legend: L particles (independent chains), B datasets; positions ``(L, B, ...)`` (per-dataset
latents ``(L, B, *event)`` and per-point ones ``(L, B, N, *point)`` alike).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from apg.baselines.continuous import continuous_target
from apg.baselines.method import Method
from apg.blocks import Latents, Model, Proposals, TaskSpec
from apg.objectives import weighted_nll
from apg.smc.resampling import get_resampler, resample
from apg.smc.sampler import APGResult, Step, sweep_stats
from apg.smc.weights import normalized_weights, sanitize

LogDensity = Callable[[Mapping[str, Tensor]], Tensor]


def _grad(log_density: LogDensity, q: Mapping[str, Tensor]) -> tuple[Tensor, Latents]:
    """``log_density(q)`` ``(L, B)`` (detached) and its gradient in every position.

    Chains are independent, so the gradient of the sum over chains is each chain's own.
    """
    with torch.enable_grad():
        leaves = {k: v.detach().requires_grad_(True) for k, v in q.items()}
        value = log_density(leaves)
        grads = torch.autograd.grad(value.sum(), list(leaves.values()))
    return value.detach(), dict(zip(leaves, grads, strict=True))


def _kinetic(p: Mapping[str, Tensor]) -> Tensor:
    """``|p|^2 / 2`` per chain (identity mass matrix), ``(L, B)``."""
    return sum(0.5 * (v**2).flatten(2).sum(-1) for v in p.values())  # type: ignore[return-value]


def leapfrog(
    log_density: LogDensity,
    q: Mapping[str, Tensor],
    p: Mapping[str, Tensor],
    step_size: float,
    num_steps: int,
) -> tuple[Latents, Latents, Tensor]:
    """``num_steps`` leapfrog steps of the Hamiltonian ``-log_density(q) + |p|^2 / 2``.

    Half a momentum step, then alternating full position and momentum steps, and a final
    half momentum step. Returns the new position, momentum and ``log_density`` there.
    """
    _, g = _grad(log_density, q)
    p = {k: p[k] + 0.5 * step_size * g[k] for k in p}
    q = dict(q)
    value = None
    for i in range(num_steps):
        q = {k: q[k] + step_size * p[k] for k in q}  # the position update
        value, g = _grad(log_density, q)
        scale = step_size if i < num_steps - 1 else 0.5 * step_size
        p = {k: p[k] + scale * g[k] for k in p}
    assert value is not None
    return q, p, value


def hmc_step(
    log_density: LogDensity, q: Mapping[str, Tensor], step_size: float, num_steps: int
) -> tuple[Latents, Tensor]:
    """One HMC transition per chain, leaving ``exp(log_density)`` invariant.

    ``q``: positions ``{name: (L, B, ...)}``; every (particle, dataset) pair is its own
    chain with its own accept/reject. Returns the new positions and the acceptance
    probabilities ``(L, B)``; a proposal with a non-finite energy is rejected.
    """
    q = {k: v.detach() for k, v in q.items()}
    with torch.no_grad():
        log_p0 = log_density(q)
    p0 = {k: torch.randn_like(v) for k, v in q.items()}
    q1, p1, log_p1 = leapfrog(log_density, q, p0, step_size, num_steps)
    # Metropolis correction: accept with probability min(1, exp(H(q, p) - H(q', p'))).
    log_accept = (log_p1 - _kinetic(p1)) - (log_p0 - _kinetic(p0))
    log_accept = torch.nan_to_num(log_accept, nan=-math.inf, posinf=-math.inf).clamp(max=0.0)
    accept = torch.log(torch.rand_like(log_accept)) < log_accept
    out = {}
    for k, v in q.items():
        mask = accept.reshape(*accept.shape, *([1] * (v.dim() - 2)))
        out[k] = torch.where(mask, q1[k].detach(), v)
    return out, log_accept.exp()


class HMCRWS(Method):
    """HMC-RWS (see the module docstring); options ``step_size``, ``leapfrog_steps``."""

    name = "hmc-rws"
    architecture = "mlp"
    kernels = False
    not_compiled_because = "its leapfrog steps take likelihood gradients inside the step"
    defaults = {"step_size": 0.05, "leapfrog_steps": 5}

    def check_options(self) -> None:
        step, steps = self.options["step_size"], self.options["leapfrog_steps"]
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not (0 < step < math.inf):
            raise ValueError(f"method_options.step_size must be a positive number, got {step!r}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"method_options.leapfrog_steps must be an integer >= 1, got {steps!r}")

    def build_proposals(self, task: TaskSpec, model: Model, **network: Any) -> Proposals:
        continuous_target(model)  # fail early (ValueError) for models without a view
        return super().build_proposals(task, model, **network)

    def run(
        self,
        model,
        proposals,
        x,
        sweeps,
        particles,
        resample_mode="block",
        resampler="systematic",
        collectors=(),
    ):
        if sweeps < 1 or particles < 1:
            raise ValueError(f"need K >= 1 and L >= 1, got K={sweeps}, L={particles}")
        target = continuous_target(model)
        resample_fn = get_resampler(resampler)
        z, log_q = proposals.initial(x, particles)
        log_p = model.log_joint(x, z)
        log_w = sanitize((log_p - log_q).detach())
        steps = [Step(normalized_weights(log_w), log_q, log_p)]
        stats = [sweep_stats(log_w, log_p)]
        collectors = list(collectors)
        for collect in collectors:
            collect(1, z, log_w)
        accepts: list[Tensor] = []  # per transition: mean Metropolis acceptance probability (B,)
        for k in range(2, sweeps + 1):
            if resample_mode != "none":
                log_w, z = resample(log_w, dict(z), resample_fn)
            u = {name: v.detach() for name, v in target.to_unconstrained(z).items()}
            u, accept = hmc_step(
                lambda v: target.log_density(x, v),
                u,
                float(self.options["step_size"]),
                self.options["leapfrog_steps"],
            )
            accepts.append(accept.mean(0))
            with torch.no_grad():
                z, _ = target.complete(x, u)
            log_p = model.log_joint(x, z)
            stats.append(sweep_stats(log_w, log_p))
            for collect in collectors:
                collect(k, z, log_w)
        if sweeps > 1:
            # eq. 6 on the improved particles; they carry no proposal density (log q = 0).
            steps.append(Step(normalized_weights(log_w), torch.zeros_like(log_w), log_p))
        result = HMCResult(z, log_w, log_p, stats, steps)
        # Acceptance rate: the mean acceptance probability over chains and transitions.
        result.diagnostics = {"accept": torch.stack(accepts).mean(0)} if accepts else {}
        return result

    def diagnostics(self, result: APGResult) -> Mapping[str, Tensor]:
        return getattr(result, "diagnostics", {})

    def model_evaluations(self, sweeps: int, particles: int) -> list[float]:
        # The encoder's log joint; per transition the energy at the start, leapfrog_steps + 1
        # gradients (2 each), the exact redraw of the discrete latents and the new log joint.
        per_move = 2 * (self.options["leapfrog_steps"] + 1) + 3
        return [float(particles * (1 + per_move * (k - 1))) for k in range(1, sweeps + 1)]

    def loss(self, result: APGResult) -> Tensor:
        first, last = result.steps[0], result.steps[-1]
        # eq. 5 for the encoder at its own samples (RWS); eq. 6 at the HMC-improved ones.
        return weighted_nll(first.weights, first.log_q) + weighted_nll(last.weights, last.log_joint)


class HMCResult(APGResult):
    """``APGResult`` with ``diagnostics = {"accept": (B,)}``, the Metropolis acceptance rate
    (mean acceptance probability over the chains and the K - 1 transitions)."""

    diagnostics: Mapping[str, Tensor]
