"""Evaluation metrics: log joint, ESS/L, log-evidence estimates, inclusive KL, MSE,
cluster recovery (adjusted Rand index, matched centre error).

All functions return per-dataset values ``(B,)`` (or per-sweep lists of them), so
callers can average over datasets and runs themselves and report a spread.

Legend: L particles, B datasets, N points.
"""

from __future__ import annotations

import itertools
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


def highest_weight_particle(z: Mapping[str, Tensor], log_weights: Tensor) -> dict[str, Tensor]:
    """Each dataset's highest-weight particle: ``{name: (B, ...)}`` from ``z``'s ``(L, B, ...)``
    and ``log_weights (L, B)``; the point estimate the tracking and cluster metrics score."""
    best = log_weights.argmax(0)
    rows = torch.arange(log_weights.shape[1], device=log_weights.device)
    return {name: t[best, rows] for name, t in z.items()}


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


def adjusted_rand_index(labels_true: Tensor, labels_pred: Tensor) -> Tensor:
    """Adjusted Rand index (Hubert and Arabie 1985) of two partitions per dataset, ``(B,)``.

    ``labels_true``, ``labels_pred``: non-negative integer cluster labels ``(B, N)``
    (``(N,)`` for one dataset gives a 0-d result). With ``n_ij`` the contingency table,
    ``a_i`` / ``b_j`` its row / column sums and ``C(m) = m (m - 1) / 2`` pairs::

        ARI = (sum_ij C(n_ij) - E) / ((sum_i C(a_i) + sum_j C(b_j)) / 2 - E),
        E = sum_i C(a_i) sum_j C(b_j) / C(N).

    It is 1 for the same partition under any relabeling, 0 in expectation for a random
    one with the same cluster sizes, and can be negative. The denominator vanishes only
    when both partitions are trivial and equal (one cluster each, or all singletons):
    that case is 1, as in scikit-learn.
    """
    if labels_true.shape != labels_pred.shape or labels_true.dim() not in (1, 2):
        raise ValueError(
            f"labels must be shaped alike, (N,) or (B, N); got {tuple(labels_true.shape)} "
            f"and {tuple(labels_pred.shape)}"
        )
    if labels_true.dtype.is_floating_point or labels_pred.dtype.is_floating_point:
        raise ValueError(f"labels must be integers, got {labels_true.dtype} and {labels_pred.dtype}")
    single = labels_true.dim() == 1
    t, p = (labels.reshape(-1, labels.shape[-1]).long() for labels in (labels_true, labels_pred))
    if t.numel() and (t.min() < 0 or p.min() < 0):
        raise ValueError("labels must be non-negative")
    num_datasets, n = t.shape
    rows, cols = int(t.max()) + 1 if t.numel() else 1, int(p.max()) + 1 if p.numel() else 1
    # One flat bincount fills every dataset's contingency table at once: (B, rows, cols).
    flat = (torch.arange(num_datasets, device=t.device).unsqueeze(-1) * rows + t) * cols + p
    table = torch.bincount(flat.reshape(-1), minlength=num_datasets * rows * cols)
    table = table.reshape(num_datasets, rows, cols).to(torch.float64)

    def pairs(counts: Tensor) -> Tensor:
        return counts * (counts - 1) / 2

    index = pairs(table).sum((-1, -2))
    sum_a, sum_b = pairs(table.sum(-1)).sum(-1), pairs(table.sum(-2)).sum(-1)
    expected = sum_a * sum_b / max(n * (n - 1) / 2, 1.0)
    maximum = (sum_a + sum_b) / 2
    denom = maximum - expected
    ari = torch.where(
        denom == 0, torch.ones_like(denom), (index - expected) / torch.where(denom == 0, 1.0, denom)
    )
    return ari[0] if single else ari


def matched_centre_error(true_centres: Tensor, centres: Tensor) -> Tensor:
    """Mean distance between true and inferred cluster centres under the best matching of
    the two sets, per dataset: ``(B, I, D), (B, I, D) -> (B,)``.

    A decoder-free measure of what a sampler found (the labels of a mixture are
    exchangeable, so centre ``i`` may be any true centre). Every one of the ``I!``
    matchings is tried: fine for the paper's ``I <= 4`` (24 matchings), refused above 8.
    """
    if true_centres.shape != centres.shape or true_centres.dim() != 3:
        raise ValueError(
            f"centres must be shaped alike, (B, I, D); got {tuple(true_centres.shape)} and {tuple(centres.shape)}"
        )
    num = true_centres.shape[1]
    if num > 8:
        raise ValueError(f"matched_centre_error tries all I! matchings; I = {num} is too many")
    distance = torch.cdist(true_centres, centres)  # (B, I, I): true i against inferred j
    orders = torch.tensor(list(itertools.permutations(range(num))), device=distance.device)  # (P, I)
    picked = distance[:, torch.arange(num, device=distance.device), orders]  # (B, P, I)
    return picked.mean(-1).amin(-1)
