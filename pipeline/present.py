"""How the report shows numbers and animations, one place so every table formats alike."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def number(v: Any) -> str:
    """A table cell: empty when missing; 1 decimal from 10 up, 3 decimals from 0.1 up, and
    3 significant digits below (a KL of 0.00025 or an MSE of 0.0156 keep their digits);
    magnitudes below 1e-9 (a baseline against itself) print as 0."""
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return ""
    if abs(v) < 1e-9:
        return "0.000"
    if abs(v) < 0.1:
        return f"{v:.3g}"
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def pm(mean: Any, std: Any) -> str:
    """``mean ± std`` (the mean alone when the spread is missing)."""
    text = number(mean)
    return f"{text} ± {number(std)}" if text and number(std) else text


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table: the header, its rule, then one line per row of cells."""
    return "\n".join("| " + " | ".join(r) + " |" for r in [header, ["---"] * len(header), *rows])


def write_gif(path: Path, frames: Sequence[np.ndarray], milliseconds: int) -> None:
    """``frames`` (uint8 images, ``(H, W)`` or ``(H, W, 3)``) as a looping GIF, written atomically."""
    from PIL import Image

    from apg.data import atomic_write

    images = [Image.fromarray(f) for f in frames]
    atomic_write(
        path,
        lambda tmp: images[0].save(
            tmp, format="GIF", save_all=True, append_images=images[1:], duration=milliseconds, loop=0
        ),
    )
