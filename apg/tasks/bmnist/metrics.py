"""Tracking error: inferred digit positions against the simulator's (``TRACK``, the task's
``TrackingSpec``).

Legend: L particles, B videos, T frames, F a subset (chunk) of frames, D digits,
H canvas side (96), S digit side (28), P = (S + 1)^2 patch pixels, Z = 10 (z_what dim).
Latents: ``z_what (L, B, D, Z)``, ``z_where_t (L, B, D, 2)`` for t = 1..T.
Data ``x``: ``(B, T, H, H)`` in [0, 1].
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from apg.blocks import TrackingSpec
from apg.tasks.bmnist.config import BMNISTConfig, stack_where

# A frame is "tracked" when every digit is within this many pixels of its true position.
TRACK_TOLERANCE_PX = 3.0


def ink_centres(images: Tensor) -> Tensor:
    """Centre of mass ``(..., 2)`` (column, row, in pixels from the box's top-left pixel) of
    the ink of digit images ``(..., S, S)``; an empty image's centre is the box's centre."""
    size = images.shape[-1]
    grid = torch.arange(size, dtype=images.dtype, device=images.device)
    mass = images.sum((-2, -1))
    cols = (images.sum(-2) * grid).sum(-1)
    rows = (images.sum(-1) * grid).sum(-1)
    centre = torch.stack([cols, rows], -1) / mass.clamp_min(1e-12)[..., None]
    return torch.where(mass[..., None] > 0, centre, torch.full_like(centre, 0.5 * (size - 1)))


def position_errors(
    true_where: Tensor | np.ndarray,
    where: Tensor | np.ndarray,
    cfg: BMNISTConfig = BMNISTConfig(),
    true_centres: Tensor | np.ndarray | None = None,
    centres: Tensor | np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """How far inferred digits are from the simulator's, per video.

    ``true_where`` and ``where``: ``(M, T, D, 2)`` box positions in model coordinates.
    Digits are exchangeable, so each video's inferred digits are matched to its true ones
    by the permutation with the smallest mean distance; one permutation per video, not
    per frame, because a tracked digit keeps its identity (its ``z_what``) through the video.

    A box position says where a digit is only together with where the digit sits in its
    box: the learned decoder need not centre its digits as MNIST does (a digit drawn 2 px
    to the right in a box 2 px to the left makes the same frame). With ``true_centres``
    and ``centres`` ``(M, D, 2)``, the ink centres of the true digits and of the decoded
    templates (``ink_centres``), digits are compared where their ink is: box corner plus
    ink centre. That is the position error; without centres it is the boxes' error.

    Returns, per video ``(M,)``: ``pos_err``, mean pixels between matched digits over
    frames and digits (one model unit is ``(H - 28) / 2`` pixels per coordinate);
    ``tracked``, the fraction of frames whose every digit is within
    ``TRACK_TOLERANCE_PX`` of its match; ``pos_err_aligned``, ``pos_err`` after removing
    each matched digit's mean offset over the video (the error of the tracked motion,
    blind to any constant offset); and with centres, ``box_err``, the boxes' error.

    Where the boxes are, whichever digit each follows: ``pos_err_frame`` and
    ``tracked_frame``, the same with each frame's digits matched on their own (a
    localization error, blind to identities); ``swapped``, the fraction of frames whose
    every box is within the tolerance of some digit but not of its own (boxes that traded
    digits, typically where two digits pass close by).
    """
    true_where = torch.as_tensor(np.asarray(true_where), dtype=torch.float64)
    where = torch.as_tensor(np.asarray(where), dtype=torch.float64)
    if true_where.shape != where.shape or true_where.dim() != 4 or true_where.shape[-1] != 2:
        raise ValueError(
            f"positions must both be (videos, frames, digits, 2); got {tuple(true_where.shape)} "
            f"and {tuple(where.shape)}"
        )
    px = 0.5 * (cfg.canvas_size - cfg.digit_size)
    out: dict[str, np.ndarray] = {}
    if (true_centres is None) != (centres is None):
        raise ValueError("give both true_centres and centres, or neither")
    if centres is not None:
        out["box_err"] = position_errors(true_where, where, cfg)["pos_err"]
        shape = (where.shape[0], where.shape[2], 2)
        mid = 0.5 * (cfg.digit_size - 1)
        moved = []
        for name, pos, c in (("true_centres", true_where, true_centres), ("centres", where, centres)):
            c = torch.as_tensor(np.asarray(c), dtype=torch.float64)
            if c.shape != shape:
                raise ValueError(f"{name} must be (videos, digits, 2) = {shape}; got {tuple(c.shape)}")
            moved.append(pos + ((c - mid) / px)[:, None])
        true_where, where = moved
    # dist[m, t, i, j]: pixels between inferred digit i and true digit j
    dist = torch.linalg.vector_norm(where.unsqueeze(3) - true_where.unsqueeze(2), dim=-1) * px
    digits = where.shape[2]
    perms = torch.tensor(list(itertools.permutations(range(digits))), dtype=torch.long)  # (P, D)
    rows = torch.arange(digits)
    matched = dist[:, :, rows[None, :], perms]  # (M, T, P, D)
    best = matched.mean((1, 3)).argmin(-1)  # (M,)
    videos = torch.arange(len(best))
    errors = matched[videos, :, best]  # (M, T, D)
    # signed differences of the matched pairs, (M, T, D, 2), for the aligned error
    diff = (where - true_where[videos[:, None], :, perms[best]].transpose(1, 2)) * px
    aligned = torch.linalg.vector_norm(diff - diff.mean(1, keepdim=True), dim=-1)
    tracked = (errors <= TRACK_TOLERANCE_PX).all(-1)  # (M, T)
    frame_best = matched.mean(3).argmin(2)  # (M, T): each frame's own permutation
    frame_errors = matched.gather(2, frame_best[:, :, None, None].expand(-1, -1, 1, digits))[:, :, 0]
    tracked_frame = (frame_errors <= TRACK_TOLERANCE_PX).all(-1)
    return {
        "pos_err": errors.mean((1, 2)).numpy(),
        "tracked": tracked.double().mean(1).numpy(),
        "pos_err_aligned": aligned.mean((1, 2)).numpy(),
        "pos_err_frame": frame_errors.mean((1, 2)).numpy(),
        "tracked_frame": tracked_frame.double().mean(1).numpy(),
        "swapped": (tracked_frame & ~tracked).double().mean(1).numpy(),
        **out,
    }


def position_truth(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The simulator's digit positions ``z_where (M, T, D, 2)`` and the ink centres of its
    digits ``centres (M, D, 2)`` from a held-out video file's arrays."""
    if "centres" not in arrays:
        raise ValueError("has no digit centres: it was made by an older generate")
    return {"z_where": arrays["z_where"], "centres": arrays["centres"]}


def tracked_positions(model, x: Tensor, z: Mapping[str, Tensor]) -> dict[str, np.ndarray]:
    """The boxes ``z_where (B, T, D, 2)`` and the decoded digits' ink centres
    ``centres (B, D, 2)`` of one particle per video, ``z`` shaped ``(1, B, ...)``; videos
    ``x (B, T, H, H)`` give the number of frames."""
    with torch.no_grad():
        where = stack_where(z, x.shape[1])[0]
        centres = ink_centres(model.templates(z["z_what"])[0])
    return {"z_where": where.cpu().numpy(), "centres": centres.cpu().numpy()}


def tracking_errors(
    truth: Mapping[str, np.ndarray], positions: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """``position_errors`` of ``tracked_positions`` against ``position_truth``, per video."""
    return position_errors(
        truth["z_where"], positions["z_where"], true_centres=truth["centres"], centres=positions["centres"]
    )


TRACK = TrackingSpec(position_truth, tracked_positions, tracking_errors, pictured=("z_where",))
