"""Bouncing MNIST's simulator: each digit follows the model's random walk (its per-frame velocity is a fresh
Normal(0, sigma0^2 I) step) and bounces, i.e. is reflected, at the borders of [-1, 1],
so digits always stay inside the canvas. This matches the model except for the
reflection at the walls (the authors' simulator moved digits at constant speed, which the
random-walk prior does not describe).

Legend: L particles, B videos, T frames, F a subset (chunk) of frames, D digits,
H canvas side (96), S digit side (28), P = (S + 1)^2 patch pixels, Z = 10 (z_what dim).
Latents: ``z_what (L, B, D, Z)``, ``z_where_t (L, B, D, 2)`` for t = 1..T.
Data ``x``: ``(B, T, H, H)`` in [0, 1].
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from apg.tasks.bmnist.likelihood import pixel_offsets, render
from apg.tasks.bmnist.metrics import ink_centres
from apg.tasks.bmnist.model import BouncingMNIST


def reflect(u: Tensor) -> Tensor:
    """Fold the real line into [-1, 1] by reflection at the walls (a bounce)."""
    return 1.0 - torch.abs(torch.remainder(u + 1.0, 4.0) - 2.0)


def simulate_trajectories(
    num_videos: int, num_frames: int, num_digits: int, sigma0: float, generator: torch.Generator
) -> Tensor:
    """Positions ``(M, T, D, 2)`` in [-1, 1]: the model's random walk, reflected at the borders."""
    steps = torch.randn(num_videos, num_frames, num_digits, 2, generator=generator, dtype=torch.float64)
    steps[:, 1:] *= sigma0
    where = torch.empty_like(steps)
    where[:, 0] = reflect(steps[:, 0])
    for t in range(1, num_frames):
        where[:, t] = reflect(where[:, t - 1] + steps[:, t])
    return where


def simulate(
    model: BouncingMNIST,
    num_datasets: int,
    generator: torch.Generator,
    num_frames: int = 10,
    num_digits: int = 3,
    split: str = "train",
    mnist_dir: str | None = None,
) -> dict[str, Tensor]:
    """Simulate ``num_datasets`` videos of ``num_digits`` MNIST digits (from ``split``).

    Returns ``x (M, T, H, H)`` in [0, 1] (default dtype), the true positions
    ``z_where (M, T, D, 2)``, the centres of the digits' ink in their boxes ``centres
    (M, D, 2)`` (``ink_centres``), the digits' MNIST ``labels (M, D)`` and ``indices (M, D)``.
    """
    from apg.data.mnist import load_mnist

    cfg = model.cfg
    mnist = load_mnist(split, mnist_dir)
    images = torch.from_numpy(mnist.images)
    indices = torch.randint(len(images), (num_datasets, num_digits), generator=generator)
    where = simulate_trajectories(num_datasets, num_frames, num_digits, cfg.sigma0, generator)
    dtype = torch.get_default_dtype()
    frames = []
    for lo in range(0, num_datasets, 64):
        digits = images[indices[lo : lo + 64]].to(dtype) / 255.0  # (m, D, S, S)
        offset = pixel_offsets(where[lo : lo + 64].to(dtype), cfg.canvas_size, cfg.digit_size)
        frames.append(render(digits.unsqueeze(1), offset, cfg.canvas_size).clamp_(0.0, 1.0))
    x = torch.cat(frames) if frames else torch.zeros(0, num_frames, cfg.canvas_size, cfg.canvas_size)
    labels = torch.from_numpy(mnist.labels.astype(np.int64))[indices]
    centres = ink_centres(images[indices].to(torch.float64))
    return {
        "x": x,
        "z_where": where.to(dtype),
        "centres": centres.to(dtype),
        "labels": labels,
        "indices": indices,
    }
