"""Bouncing MNIST's sizes, hyperparameters and block names (one ``where_t`` block per frame).

Legend: L particles, B videos, T frames, F a subset (chunk) of frames, D digits,
H canvas side (96), S digit side (28), P = (S + 1)^2 patch pixels, Z = 10 (z_what dim).
Latents: ``z_what (L, B, D, Z)``, ``z_where_t (L, B, D, 2)`` for t = 1..T.
Data ``x``: ``(B, T, H, H)`` in [0, 1].
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

CANVAS = 96
DIGIT = 28
# Frames are processed in chunks of this many so that memory stays bounded for long videos.
FRAME_CHUNK = 10


@dataclass(frozen=True)
class BMNISTConfig:
    """Model hyperparameters (paper / Appendix E defaults; sigma0 from the authors' code)."""

    canvas_size: int = CANVAS
    digit_size: int = DIGIT
    z_what_dim: int = 10
    sigma0: float = 0.2
    prob_eps: float = 1e-4


def where_key(t: int) -> str:
    """Name of frame t's position latent (t counts from 1, as in the paper)."""
    return f"z_where_{t}"


def _frame_of(block: str) -> int:
    try:
        kind, t = block.split("_")
        if kind == "where" and int(t) >= 1:
            return int(t)
    except ValueError:
        pass
    raise ValueError(f"unknown block {block!r}; blocks are 'what' and 'where_1' .. 'where_T'")


def stack_where(z: Mapping[str, Tensor], num_frames: int, start: int = 1) -> Tensor:
    """``(L, B, F, D, 2)`` positions of frames ``start .. start + F - 1``."""
    return torch.stack([z[where_key(t)] for t in range(start, start + num_frames)], dim=2)
