"""Held-out scores of each dataset's highest-weight particle, run by a trained method.

:func:`apg.training.evaluate` returns the sampler's own numbers (log joint, ESS, evidence,
model evaluations); the scores here need the particles themselves, so each is a run of its
own: the particles after chosen sweeps (``best_particles``: sample pictures), cluster
recovery against the true assignments and centres (``final_particle``,
``particle_scores``) and tracking against the simulator's positions (``tracking_errors``).

Legend: M held-out datasets, N points, I clusters, D dimensions, K sweeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from apg.blocks import Model, Proposals
from apg.metrics import adjusted_rand_index, highest_weight_particle, matched_centre_error, reconstruction_mse
from apg.tasks import get_task
from apg.training import TrainConfig, make_method, network_device

# Keep a particle's reconstruction when one dataset has at most this many numbers: the
# rings' points, and Bouncing MNIST videos up to ~27 frames of 96x96; a larger one is
# redrawn from the model where it is needed, so that kept samples stay small.
RECON_MAX_ELEMENTS = 250_000


@torch.no_grad()
def best_particles(
    cfg: TrainConfig, model: Model, proposals: Proposals, x: torch.Tensor, sweeps: list[int], particles: int
) -> dict[int, dict[str, np.ndarray]]:
    """``{sweep: {latent: (M, ...)}}``: each dataset's highest-weight particle after each sweep.

    RWS methods run one step whatever K is, so they only have sweep 1. When the task can
    reconstruct and a dataset is small (at most ``RECON_MAX_ELEMENTS`` numbers), the
    particle's reconstruction is kept as ``recon`` (``(M, ...)``, like ``x``).
    """
    reconstruct = get_task(cfg.task).reconstruct
    if x[0].numel() > RECON_MAX_ELEMENTS:
        reconstruct = None
    out: dict[int, dict[str, np.ndarray]] = {}

    def collect(k: int, z: dict[str, torch.Tensor], log_w: torch.Tensor) -> None:
        if k in sweeps:
            chosen = highest_weight_particle(z, log_w)
            out[k] = {name: t.cpu().numpy() for name, t in chosen.items()}
            if reconstruct is not None:
                recon = reconstruct(model, x, {name: t[None] for name, t in chosen.items()})[0]
                out[k]["recon"] = recon.cpu().numpy()

    x = x.to(network_device(model, proposals, x), torch.get_default_dtype())
    make_method(cfg).run(
        model, proposals, x, max(sweeps), particles, "block", cfg.resampler, collectors=[collect]
    )
    return out


# --------------------------------------------------------------------------- cluster recovery


@torch.no_grad()
def final_particle(
    cfg: TrainConfig,
    model: Model,
    proposals: Proposals,
    x: torch.Tensor,
    sweeps: int,
    particles: int,
    batch_size: int,
    resample_mode: str,
) -> dict[str, np.ndarray] | None:
    """Each dataset's highest-weight particle after the method's last sweep at budget
    ``(sweeps, particles)``: its assignments ``c (M, N)`` and, when the particles have them,
    its centres ``mu (M, I, D)``; ``None`` when the method's particles have no ``c``
    (nothing to score)."""
    method = make_method(cfg)
    device = network_device(model, proposals, x)
    chunks: dict[str, list[np.ndarray]] = {}
    for start in range(0, len(x), batch_size):
        xb = x[start : start + batch_size].to(device, torch.get_default_dtype())
        result = method.run(model, proposals, xb, sweeps, particles, resample_mode, cfg.resampler)
        if "c" not in result.z:
            return None
        chosen = highest_weight_particle(result.z, result.log_weights)
        for name in ("c", "mu"):
            if name in chosen:
                chunks.setdefault(name, []).append(chosen[name].cpu().numpy())
    return {name: np.concatenate(parts) for name, parts in chunks.items()}


def ari_scores(true_c: np.ndarray, pred_c: np.ndarray | None) -> np.ndarray:
    """Per-dataset ARI ``(M,)`` of ``pred_c (M, N)`` against ``true_c (M, N)``; NaN when
    there are no predicted assignments."""
    if pred_c is None:
        return np.full(len(true_c), np.nan)
    return adjusted_rand_index(torch.from_numpy(true_c), torch.from_numpy(pred_c)).numpy()


def latent_truth(task: str, arrays: Mapping[str, np.ndarray]) -> dict[str, Any] | None:
    """What a held-out set's ``arrays`` hold of the truth for scoring a final particle: the
    arrays (``x`` and the true ``c``, ``mu``), ``c`` as integers and the ceiling's
    per-dataset ARI ``ari_ceiling (M,)`` (None for tasks without a ceiling rule); None
    without true assignments."""
    if "c" not in arrays:
        return None
    true_c = arrays["c"].astype(np.int64)
    rule = get_task(task).assignment_ceiling
    return {"arrays": arrays, "c": true_c, "ari_ceiling": ari_scores(true_c, rule(arrays)) if rule else None}


def particle_scores(
    task: str,
    truth: dict[str, Any],
    particle: dict[str, np.ndarray] | None,
    model_hparams: dict[str, Any],
    sizes: dict[str, Any],
) -> dict[str, np.ndarray]:
    """Final metrics ``(M,)`` of the highest-weight particles (``final_particle``) against the
    truth (``latent_truth``): ``ari``; ``centre_err`` (``apg.metrics.matched_centre_error``)
    when both hold centres ``mu``; ``log_joint_true`` for the tasks with a
    ``TaskSpec.common_log_joint``; ``ari_ceiling`` where the task has one. NaN where the
    particles lack what a metric reads."""
    size = len(truth["c"])
    scores = {"ari": ari_scores(truth["c"], None if particle is None else particle["c"])}
    if "mu" in truth["arrays"]:
        scores["centre_err"] = np.full(size, np.nan)
        if particle is not None and "mu" in particle:
            true_mu, mu = (
                torch.from_numpy(np.asarray(a, dtype=np.float64))
                for a in (truth["arrays"]["mu"], particle["mu"])
            )
            scores["centre_err"] = matched_centre_error(true_mu, mu).numpy()
    common_log_joint = get_task(task).common_log_joint
    if common_log_joint is not None:
        scores["log_joint_true"] = np.full(size, np.nan)
        if particle is not None and "mu" in particle:
            scores["log_joint_true"] = common_log_joint(truth["arrays"], particle, model_hparams, sizes)
    if truth["ari_ceiling"] is not None:
        scores["ari_ceiling"] = truth["ari_ceiling"]
    return scores


# --------------------------------------------------------------------------- tracking


@torch.no_grad()
def tracking_errors(
    cfg: TrainConfig,
    model: Model,
    proposals: Proposals,
    x: torch.Tensor,
    truth: dict[str, np.ndarray],
    sweeps: int,
    particles: int,
    batch_size: int,
    resample_mode: str,
    mse: bool = False,
) -> dict[str, np.ndarray]:
    """Curves ``(K, M)``: the task's position errors (``TaskSpec.tracking``; Bouncing MNIST:
    the position error in pixels at the digits' ink centres, the boxes' error, the motion
    error and the tracked-frame fraction) of each dataset's highest-weight particle after
    each sweep, against the simulator's (``truth``: ``TrackingSpec.truth`` of the set's
    arrays); with ``mse``, the reconstruction MSE weighted over particles after each sweep as
    well (``mse``), from the same particles."""
    task = get_task(cfg.task)
    tracking = task.tracking
    if tracking is None:
        raise ValueError(f"task {cfg.task} tracks no objects (its TaskSpec has no tracking)")
    reconstruct = task.reconstruct
    if mse and reconstruct is None:
        raise ValueError(f"task {cfg.task} reconstructs no data (its TaskSpec has no reconstruct)")
    device = network_device(model, proposals, x)
    method = make_method(cfg)
    per_sweep: dict[int, list[dict[str, np.ndarray]]] = {}
    mses: dict[int, list[np.ndarray]] = {}
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            xb = x[start : start + batch_size].to(device, torch.get_default_dtype())

            def collect(
                k: int, z: dict[str, torch.Tensor], log_w: torch.Tensor, xb: torch.Tensor = xb
            ) -> None:
                # each dataset's highest-weight particle, (1, B, ...)
                chosen = {name: t[None] for name, t in highest_weight_particle(z, log_w).items()}
                per_sweep.setdefault(k, []).append(tracking.positions(model, xb, chosen))
                if mse and reconstruct is not None:
                    recon = reconstruct(model, xb, z)
                    mses.setdefault(k, []).append(reconstruction_mse(xb, recon, log_w).cpu().numpy())

            method.run(
                model, proposals, xb, sweeps, particles, resample_mode, cfg.resampler, collectors=[collect]
            )
    curves: dict[str, list[np.ndarray]] = (
        {"mse": [np.concatenate(mses[k]) for k in sorted(mses)]} if mse else {}
    )
    for k in sorted(per_sweep):
        found = {name: np.concatenate([part[name] for part in per_sweep[k]]) for name in per_sweep[k][0]}
        for name, value in tracking.errors(truth, found).items():
            curves.setdefault(name, []).append(value)
    return {name: np.stack(values) for name, values in curves.items()}
