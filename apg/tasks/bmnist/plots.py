"""Pictures of Bouncing MNIST: frames with boxes (Figure 3) and GIFs.

Legend: L particles, B videos, T frames, F a subset (chunk) of frames, D digits,
H canvas side (96), S digit side (28), P = (S + 1)^2 patch pixels, Z = 10 (z_what dim).
Latents: ``z_what (L, B, D, Z)``, ``z_where_t (L, B, D, 2)`` for t = 1..T.
Data ``x``: ``(B, T, H, H)`` in [0, 1].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from apg.tasks.bmnist.config import DIGIT, BMNISTConfig, where_key
from apg.tasks.bmnist.model import BouncingMNIST

if TYPE_CHECKING:  # matplotlib is imported where a picture is drawn (the pipeline's extra)
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes

_COLORS = np.array(
    [
        [230, 25, 75],
        [60, 180, 75],
        [0, 130, 200],
        [245, 130, 48],
        [145, 30, 180],
        [70, 240, 240],
        [240, 50, 230],
        [210, 245, 60],
    ],
    dtype=np.uint8,
)


def _boxes(z: Mapping[str, Any], num_frames: int, cfg: BMNISTConfig = BMNISTConfig()) -> np.ndarray:
    """Top-left pixel corners ``(T, D, 2)`` (column, row) of the digits of ``z``: its
    ``z_where_t`` blocks, or a ``z_where (T, D, 2)`` array (the simulator's truth)."""
    if "z_where" in z:
        where = np.asarray(z["z_where"])[:num_frames]
    else:
        where = np.stack([np.asarray(z[where_key(t)]) for t in range(1, num_frames + 1)])
    return (where + 1.0) * 0.5 * (cfg.canvas_size - cfg.digit_size)


def draw(ax: Axes, x: np.ndarray, z: Mapping[str, np.ndarray], max_frames: int = 10) -> None:
    """Figure 3: a strip of the first ``max_frames`` frames with the inferred digit boxes
    and, below it, the model's reconstructions of the same frames with the same boxes.

    ``x (T, H, H)`` numpy; ``z`` numpy dict without particle or batch dims. The
    reconstruction row needs the decoder, which ``z`` does not carry: it is drawn from
    ``z["recon"]`` (``(T, H, H)``, the model's ``reconstruct`` of this sample), when given.
    With ``z["true_where"]`` (``(T, D, 2)``, the simulator's positions), each frame also
    shows every digit's path so far: inferred (solid, the box's colour) and true (dotted white).
    """
    from matplotlib.patches import Rectangle

    x = np.asarray(x)
    frames = min(max_frames, x.shape[0])
    side = x.shape[-1]
    corners = _boxes(z, frames)
    strips = [np.concatenate(list(x[:frames]), axis=1)]
    if "recon" in z:
        gap = np.ones((4, strips[0].shape[1]))
        strips += [gap, np.concatenate(list(np.clip(np.asarray(z["recon"])[:frames], 0, 1)), axis=1)]
    ax.imshow(np.concatenate(strips, axis=0), cmap="gray", vmin=0, vmax=1)
    true_corners = _boxes({"z_where": z["true_where"]}, frames) if "true_where" in z else None
    centre = DIGIT / 2 - 0.5
    for top in (0, side + 4)[: 1 if len(strips) == 1 else 2]:
        for t in range(frames):
            for d, (cx, cy) in enumerate(corners[t]):
                color = _COLORS[d % len(_COLORS)] / 255.0
                corner = (t * side + cx - 0.5, top + cy - 0.5)
                ax.add_patch(Rectangle(corner, DIGIT, DIGIT, fill=False, lw=1, edgecolor=color))
                if true_corners is not None and top == 0:
                    path = corners[: t + 1, d] + centre
                    ax.plot(t * side + path[:, 0], path[:, 1], color=color, lw=0.8)
            if true_corners is not None and top == 0:
                for d in range(true_corners.shape[1]):
                    path = true_corners[: t + 1, d] + centre
                    ax.plot(t * side + path[:, 0], path[:, 1], color="white", lw=0.8, ls=":")
                    ax.plot(t * side + path[-1, 0], path[-1, 1], "+", color="white", ms=4, mew=0.8)
    ax.set_axis_off()
    # What the colours and lines are, beside the strip (on a dark ground: the true paths are white).
    from matplotlib.lines import Line2D

    handles: list[Artist] = [
        Rectangle(
            (0, 0), 1, 1, fill=False, edgecolor=_COLORS[d % len(_COLORS)] / 255.0, label=f"digit {d + 1}"
        )
        for d in range(corners.shape[1])
    ]
    if true_corners is not None:
        handles += [
            Line2D([], [], color="0.85", lw=0.8, label="inferred path"),
            Line2D([], [], color="white", lw=0.8, ls=":", marker="+", ms=4, label="true path, centre"),
        ]
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=6,
        facecolor="0.25",
        labelcolor="white",
    )


@torch.no_grad()
def animate(model: BouncingMNIST, x: Tensor, z: Mapping[str, Tensor]) -> np.ndarray:
    """Frames ``(T, H, 2H + 4, 3)`` uint8: the video | its reconstruction, with boxes.

    ``x (T, H, H)`` and ``z`` without particle or batch dims (torch). With
    ``z["true_where"]`` (``(T, D, 2)``), the video panel also marks each digit's true
    centre (a white cross) and the path of every inferred centre so far (the box's colour).
    """
    z = dict(z)
    truth = z.pop("true_where", None)
    num_frames, side = x.shape[0], x.shape[-1]
    zb = {k: v[None, None] for k, v in z.items()}
    recon = model.reconstruct(zb, num_frames)[0, 0]
    corners = np.round(_boxes({k: v.cpu().numpy() for k, v in z.items()}, num_frames, model.cfg)).astype(int)
    true_corners = None
    if truth is not None:
        true_corners = np.round(_boxes({"z_where": truth.cpu().numpy()}, num_frames, model.cfg)).astype(int)
    gap = np.full((num_frames, side, 4, 3), 255, np.uint8)
    panels = []
    half = DIGIT // 2
    for i, img in enumerate((x, recon)):
        rgb = np.repeat((img.clamp(0, 1).cpu().numpy() * 255).astype(np.uint8)[..., None], 3, -1)
        for t in range(num_frames):
            for d, (cx, cy) in enumerate(corners[t]):
                color = _COLORS[d % len(_COLORS)]
                _box(rgb[t], cx, cy, DIGIT, color)
                if i == 0 and true_corners is not None:
                    for px, py in corners[: t + 1, d] + half:
                        _dot(rgb[t], px, py, color)
            if i == 0 and true_corners is not None:
                for px, py in true_corners[t] + half:
                    _cross(rgb[t], px, py, np.array([255, 255, 255], np.uint8))
        panels.append(rgb)
    return np.concatenate([panels[0], gap, panels[1]], axis=2)


def _dot(img: np.ndarray, x: int, y: int, color: np.ndarray) -> None:
    h, w = img.shape[:2]
    img[max(y - 1, 0) : min(y + 1, h - 1) + 1, max(x - 1, 0) : min(x + 1, w - 1) + 1] = color


def _cross(img: np.ndarray, x: int, y: int, color: np.ndarray, arm: int = 3) -> None:
    h, w = img.shape[:2]
    if 0 <= y < h:
        img[y, max(x - arm, 0) : min(x + arm, w - 1) + 1] = color
    if 0 <= x < w:
        img[max(y - arm, 0) : min(y + arm, h - 1) + 1, x] = color


def _box(img: np.ndarray, x0: int, y0: int, size: int, color: np.ndarray) -> None:
    h, w = img.shape[:2]
    x1, y1 = x0 + size - 1, y0 + size - 1
    xs, ys = slice(max(x0, 0), min(x1, w - 1) + 1), slice(max(y0, 0), min(y1, h - 1) + 1)
    for y in (y0, y1):
        if 0 <= y < h:
            img[y, xs] = color
    for xc in (x0, x1):
        if 0 <= xc < w:
            img[ys, xc] = color
