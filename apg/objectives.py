"""Surrogate losses whose gradients are the paper's self-normalized estimators.

Both sum over the steps recorded by ``apg.smc.run_apg`` (the initial proposal and every
block update, as in the algorithm of section 2.2) and average over the B datasets.
Normalized weights are detached, so only ``log q`` (eq. 5) and ``log p`` (eq. 6) carry
gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from apg.smc.sampler import APGResult


def weighted_nll(weights: Tensor, log_density: Tensor) -> Tensor:
    """``-mean_B sum_L w_l log_density_l`` with the weights ``(L, B)`` detached and the
    negligible ones (``flush_negligible``) set to zero."""
    return -(flush_negligible(weights.detach()) * log_density).sum(0).mean()


def flush_negligible(weights: Tensor) -> Tensor:
    """Self-normalized weights with those below ``tiny / eps`` (~1e-31 in float32) set to 0.

    A poor particle's weight is 1e-40 or less; the gradients it scales are then subnormal,
    and x86 arithmetic on subnormal operands takes a microcode assist (~100 cycles), which
    made every network behind a log-density run several times slower (the rings' centre
    kernel: a 40000 x 32 x 32 GEMM at ~3 GFLOP/s). Such a weight is ~1e-31 of the largest
    (>= 1 / L), far below float rounding, so dropping it changes no gradient; done here,
    once for all steps, rather than on every log-density's gradient.
    """
    info = torch.finfo(weights.dtype)
    # At most 1e-30: in float16, tiny / eps is 0.06, a real weight.
    return weights.masked_fill(weights < min(info.tiny / info.eps, 1e-30), 0.0)


def phi_loss(result: APGResult) -> Tensor:
    """eq. 5: the gradient of this is minus the inclusive-KL gradient estimate for every
    proposal, accumulated at the initial step and after every block update."""
    return _summed_over_steps(result, [s.log_q for s in result.steps])


def theta_loss(result: APGResult) -> Tensor:
    """eq. 6: the gradient of this is minus the self-normalized estimate of
    ``grad_theta log p_theta(x)``, accumulated like ``phi_loss``."""
    return _summed_over_steps(result, [s.log_joint for s in result.steps])


def _summed_over_steps(result: APGResult, log_densities: list[Tensor]) -> Tensor:
    """``sum_steps weighted_nll(step.weights, log_density)``, as one product over the steps
    stacked along the particle axis (a run has dozens of steps; one small graph each
    cost more than the arithmetic)."""
    if not log_densities:
        return _zero(result)
    weights = torch.cat([s.weights for s in result.steps])
    return weighted_nll(weights, torch.cat(log_densities))


def apg_loss(result: APGResult) -> Tensor:
    """``phi_loss + theta_loss``: phi and theta are disjoint, so one backward serves both."""
    return phi_loss(result) + theta_loss(result)


def _zero(result: APGResult) -> Tensor:
    return result.log_weights.new_zeros(())


def negative_elbo(result: APGResult) -> Tensor:
    """``-E_q[log p - log q]`` from a one-step run of reparameterized samples (stochastic
    backpropagation, AVF's filtering free energy), averaged over samples and datasets;
    its gradient flows through the samples, not through weights."""
    step = result.steps[0]
    return -(step.log_joint - step.log_q).mean()
