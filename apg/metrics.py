"""Evaluation metrics: log joint, ESS/L, log-evidence estimate, inclusive KL, MSE.

All functions return per-dataset values ``(B,)`` (or per-sweep lists of them), so
callers can average over datasets and runs themselves and report a spread.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from apg.blocks import Proposals
from apg.smc.sampler import APGResult
from apg.smc.weights import normalized_weights


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
