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

from apg.tasks.bmnist.config import BMNISTConfig
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
    indices, where = _draw(len(images), num_datasets, num_frames, num_digits, cfg.sigma0, generator)
    dtype = torch.get_default_dtype()
    x = render_videos(cfg, images, indices, where, num_frames)
    labels = torch.from_numpy(mnist.labels.astype(np.int64))[indices]
    centres = ink_centres(images[indices].to(torch.float64))
    return {
        "x": x,
        "z_where": where.to(dtype),
        "centres": centres.to(dtype),
        "labels": labels,
        "indices": indices,
    }


def _draw(
    num_images: int,
    num_videos: int,
    num_frames: int,
    num_digits: int,
    sigma0: float,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """Which MNIST images ``(M, D)`` each video shows and their positions ``(M, T, D, 2)``."""
    indices = torch.randint(num_images, (num_videos, num_digits), generator=generator)
    return indices, simulate_trajectories(num_videos, num_frames, num_digits, sigma0, generator)


def render_videos(
    cfg: BMNISTConfig, images: Tensor, indices: Tensor, where: Tensor, num_frames: int
) -> Tensor:
    """Frames ``(M, T, H, H)`` in [0, 1] (default dtype) of MNIST ``images`` (uint8, ``(N, S, S)``)
    picked by ``indices (M, D)`` at positions ``where (M, T, D, 2)``, 64 videos at a time."""
    dtype = torch.get_default_dtype()
    frames = []
    for lo in range(0, len(indices), 64):
        digits = images[indices[lo : lo + 64]].to(dtype) / 255.0  # (m, D, S, S)
        offset = pixel_offsets(where[lo : lo + 64].to(dtype), cfg.canvas_size, cfg.digit_size)
        frames.append(render(digits.unsqueeze(1), offset, cfg.canvas_size).clamp_(0.0, 1.0))
    return torch.cat(frames) if frames else torch.zeros(0, num_frames, cfg.canvas_size, cfg.canvas_size)


def row_seed(seed: int, index: int) -> int:
    """The seed of video ``index`` of a :class:`VideoRows` set: a hash of both, 63 bits (no two
    of a set's rows share a stream, whatever their number)."""
    state = np.random.SeedSequence([seed, index]).generate_state(1, dtype=np.uint64)
    return int(state[0]) & ((1 << 63) - 1)


class VideoRows:
    """A fixed set of ``num_videos`` simulated videos, each made when read: video ``i`` is a
    function of ``(seed, i)`` alone (its own random stream, :func:`row_seed`), so the set is
    the same on every machine and in every order it is read, and holds no memory or disk.

    The paper's 60,000 training videos are 11 GB as float16 arrays; made per batch they cost a
    few milliseconds a step, where writing the file would cost minutes on every machine that
    continues a run. Indexed like :class:`apg.data.StoredRows` (``rows[idx]``: ``(len(idx), T,
    H, H)`` in the default dtype, in the order of ``idx``), which is all ``apg.training.Trainer``
    asks of its training rows.
    """

    def __init__(
        self,
        num_videos: int,
        seed: int,
        num_frames: int = 10,
        num_digits: int = 3,
        split: str = "train",
        cfg: BMNISTConfig | None = None,
        mnist_dir: str | None = None,
    ):
        from apg.data.mnist import load_mnist

        if num_videos < 1:
            raise ValueError(f"num_videos must be at least 1, got {num_videos}")
        self.num_videos, self.seed = num_videos, seed
        self.num_frames, self.num_digits = num_frames, num_digits
        self.cfg = cfg or BMNISTConfig()
        self.images = torch.from_numpy(load_mnist(split, mnist_dir).images)

    def __len__(self) -> int:
        return self.num_videos

    def draw(self, index: int) -> tuple[Tensor, Tensor]:
        """Video ``index``'s MNIST images ``(D,)`` and positions ``(T, D, 2)``."""
        if not 0 <= index < self.num_videos:
            raise IndexError(f"video {index} of a set of {self.num_videos}")
        generator = torch.Generator().manual_seed(row_seed(self.seed, index))
        indices, where = _draw(
            len(self.images), 1, self.num_frames, self.num_digits, self.cfg.sigma0, generator
        )
        return indices[0], where[0]

    def __getitem__(self, idx: Tensor | np.ndarray) -> Tensor:
        drawn = [self.draw(int(i)) for i in np.asarray(idx).reshape(-1)]
        if not drawn:
            size = self.cfg.canvas_size
            return torch.zeros(0, self.num_frames, size, size)
        indices = torch.stack([d[0] for d in drawn])
        where = torch.stack([d[1] for d in drawn])
        return render_videos(self.cfg, self.images, indices, where, self.num_frames)
