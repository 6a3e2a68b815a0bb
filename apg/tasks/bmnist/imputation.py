"""Held-out imputation for Bouncing MNIST (``IMPUTATION``, the task's ``ImputationSpec``):
occlusions hide blocks of consecutive frames (``{start, frames}``, 1-based) or a rectangle
in every frame (``{rows: [a, b], cols: [a, b]}``, pixels, end exclusive); the imputed
pixels and the digits tracked through the occluded frames are scored.

Legend: M videos, T frames, H canvas side, D digits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from apg.blocks import ImputationSpec
from apg.tasks.bmnist.metrics import position_errors, tracked_positions
from apg.tasks.scoring import mse_per_dataset


def occlusion_mask(shape: tuple[int, ...], occlusion: Mapping[str, Any]) -> torch.Tensor:
    """``(M, T, H, W)`` bool for one occlusion: frames ``start..start+frames-1``
    (1-based) blanked whole, or the pixels ``rows x cols`` hidden in every frame."""
    mask = torch.zeros(shape, dtype=torch.bool)
    if "frames" in occlusion:
        start, count = int(occlusion.get("start", 2)), int(occlusion["frames"])
        if not 1 <= start <= start + count - 1 <= shape[1]:
            raise ValueError(f"occlusion {occlusion} does not fit videos of {shape[1]} frames")
        mask[:, start - 1 : start - 1 + count] = True
    else:
        (r0, r1), (c0, c1) = occlusion["rows"], occlusion["cols"]
        mask[:, :, r0:r1, c0:c1] = True
    return mask


def occlusion_name(occlusion: Mapping[str, Any]) -> str:
    if "frames" in occlusion:
        start, count = int(occlusion.get("start", 2)), int(occlusion["frames"])
        return f"frames {start}-{start + count - 1}" if count > 1 else f"frame {start}"
    (r0, r1), (c0, c1) = occlusion["rows"], occlusion["cols"]
    return f"region {r0}:{r1}x{c0}:{c1}"


def check(
    settings: Mapping[str, Any], model_hparams: Mapping[str, Any], test_set: Mapping[str, Any], where: str
) -> None:
    """At least one occlusion, each inside the held-out videos' frames and canvas."""
    occlusions = settings.get("occlusions") or []
    if not occlusions:
        raise ValueError(f"{where}.occlusions: list at least one (frames blanked or a region)")
    frames = int(test_set.get("sizes", {}).get("num_frames", 10))
    canvas = int(model_hparams.get("canvas_size", 96))
    for j, occ in enumerate(occlusions):
        if "frames" in occ and int(occ.get("start", 2)) + int(occ["frames"]) - 1 > frames:
            raise ValueError(
                f"{where}.occlusions[{j}]: {occ} does not fit the {frames}-frame videos of {test_set['name']}"
            )
        if "rows" in occ and max(occ["rows"][1], occ["cols"][1]) > canvas:
            raise ValueError(f"{where}.occlusions[{j}]: {occ} reaches outside the {canvas} x {canvas} frames")


def masks(settings: Mapping[str, Any], x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One setting per occlusion of ``occlusions``."""
    return [
        (occlusion_name(occ), occlusion_mask(tuple(x.shape), occ)) for occ in settings.get("occlusions", [])
    ]


def scores(
    settings: Mapping[str, Any],
    x: torch.Tensor,
    mask: torch.Tensor,
    arrays: Mapping[str, np.ndarray],
    model,
    result,
) -> list[tuple[str, np.ndarray, int]]:
    """``mse`` on the hidden pixels per iteration; at the last, where the file holds the
    simulator's positions, ``pos_err`` and ``tracked`` of the digits the chain's last
    inference tracked, on the frames the occlusion touches."""
    count, truth = len(x), x[mask]
    owner = mask.nonzero()[:, 0]
    iterations = len(result.history)
    out = [
        ("mse", mse_per_dataset(result.history[i] - truth, owner, count), i + 1) for i in range(iterations)
    ]
    if "z_where" in arrays:
        frames = mask.flatten(2).any(-1).any(0).numpy()  # (T,) the frames the occlusion touches
        found = tracked_positions(model, x, result.z)
        errors = position_errors(
            arrays["z_where"][:count][:, frames],
            found["z_where"][:, frames],
            true_centres=arrays["centres"][:count],
            centres=found["centres"],
        )
        out += [("pos_err", errors["pos_err"], iterations), ("tracked", errors["tracked"], iterations)]
    return out


IMPUTATION = ImputationSpec(
    masks,
    scores,
    check,
    description="Pixel MSE on the hidden pixels, and the position error and tracked fraction "
    "of the digits the chain's last inference places on the occluded frames.",
    figure_description="MSE on the hidden pixels and the position error of the tracked "
    "digits on the occluded frames, at the last iteration, versus the occlusion.",
)
