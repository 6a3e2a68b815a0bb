"""Evaluation metrics: log joint, ESS/L, log-evidence estimates, inclusive KL, MSE.

All functions return per-dataset values ``(B,)`` (or per-sweep lists of them), so
callers can average over datasets and runs themselves and report a spread.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from apg.blocks import Model, Proposals
from apg.smc.sampler import APGResult
from apg.smc.weights import log_mean_exp, normalized_weights, sanitize


def sweep_curves(result: APGResult) -> dict[str, list[Tensor]]:
    """Per-sweep curves of one run: ``{metric: [value (B,) for each sweep]}``.

    Keys: ``log_joint`` (weighted, section 5.3), ``ess`` (ESS/L at the end of the sweep,
    eq. 11), ``log_evidence``, and ``ess_<block>`` for every block updated in the sweep
    (sweep 1, the initial proposal, reports its IS ESS under every block's key too, so that
    curves start at the same sweep).
    """
    curves: dict[str, list[Tensor]] = {"log_joint": [], "ess": [], "log_evidence": []}
    blocks = list(result.sweeps[-1].ess_blocks) if len(result.sweeps) > 1 else []
    for block in blocks:
        curves[f"ess_{block}"] = []
    for stats in result.sweeps:
        curves["log_joint"].append(stats.log_joint)
        curves["ess"].append(stats.ess)
        curves["log_evidence"].append(stats.log_evidence)
        for block in blocks:
            curves[f"ess_{block}"].append(stats.ess_blocks.get(block, stats.ess))
    return curves


@torch.no_grad()
def inclusive_kl(
    exact: Proposals,
    proposals: Proposals,
    block: str,
    block_vars: tuple[str, ...],
    x: Tensor,
    z: Mapping[str, Tensor],
    log_weights: Tensor,
    draws: int = 4,
) -> Tensor:
    """Inclusive KL of a learned kernel to the exact conditional (eq. 4), ``(B,)``.

    ``E_{p(z_-b | x)} KL(p(z_b | x, z_-b) || q(z_b | x, z_-b))``: the outer expectation
    uses the weighted particles ``(z, log_weights)`` as posterior samples of ``z_-b``, the
    inner KL is a Monte Carlo average over ``draws`` exact draws of ``z_b`` per particle.
    """
    target = exact.kernel(block, x, z)
    learned = proposals.kernel(block, x, z)
    w = normalized_weights(log_weights)
    total = torch.zeros_like(log_weights[0])
    for _ in range(draws):
        sample = target.sample()
        value = {name: sample[name] for name in block_vars}
        total += (w * (target.log_prob(value) - learned.log_prob(value))).sum(0)
    return total / draws


def reconstruction_mse(x: Tensor, reconstruction: Tensor, log_weights: Tensor) -> Tensor:
    """Weighted mean squared error between data ``(B, ...)`` and particle reconstructions
    ``(L, B, ...)``, averaged over event dims, ``(B,)``."""
    err = ((reconstruction - x.unsqueeze(0)) ** 2).flatten(2).mean(-1)
    return (normalized_weights(log_weights) * err).sum(0)


@torch.no_grad()
def importance_log_evidence(
    model: Model, proposals: Proposals, x: Tensor, num_samples: int, chunk: int = 100
) -> Tensor:
    """Importance-sampled ``log p(x)`` from the encoder, ``(B,)`` (Rezende et al. 2014,
    appendix E, eq. 19): ``log (1/S) sum_s p(x, z_s) / q(z_s | x)`` with ``z_s ~ q(z | x)``.

    ``p(x)`` itself is an unbiased estimate, so ``log p(x)`` is biased low by Jensen's
    gap, which shrinks as ``S`` grows. Samples are drawn ``chunk`` at a time so that large
    budgets fit in memory; the chunks are combined exactly (a log-mean-exp of log-means).
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    parts, sizes = [], []
    for start in range(0, num_samples, chunk):
        size = min(chunk, num_samples - start)
        z, log_q = proposals.initial(x, size)
        log_w = sanitize(model.log_joint(x, z) - log_q)
        parts.append(log_mean_exp(log_w, dim=0))
        sizes.append(size)
    stacked = torch.stack(parts)  # (chunks, B)
    log_frac = torch.log(torch.tensor(sizes, dtype=stacked.dtype, device=stacked.device) / num_samples)
    return torch.logsumexp(stacked + log_frac.unsqueeze(-1), dim=0)
