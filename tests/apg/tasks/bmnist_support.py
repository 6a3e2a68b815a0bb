"""Shared set-up of the Bouncing MNIST tests: random latents of L particles, B videos, T frames, D digits."""

from __future__ import annotations

import torch

from apg.tasks.bmnist import (
    where_key,
)


def random_latents(L, B, T, D, scale=0.6):
    z = {"z_what": torch.randn(L, B, D, 10)}
    for t in range(1, T + 1):
        z[where_key(t)] = (torch.rand(L, B, D, 2) * 2 - 1) * scale
    return z
