"""What a recorded run's folder holds, by name, and how it is read: the part of
:mod:`pipeline.recorded` that the report may import (it reads folders; it never records).

Imports the config's checks only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config import checks

RECORDED = "recorded"
MANIFEST = "manifest.json"
# What the report reads from a recorded run's evaluation (metrics.csv is the parquet's copy).
EVAL_FILES = ("meta.json", "metrics.parquet", "training.parquet", "samples.npz")
# A cell kept as its generative model's weights alone (its proposals too large for git).
GENERATIVE_ONLY = "generative.pt"


def recorded_runs(root: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every recorded run under ``root/recorded`` with its manifest, by name."""
    base = root / RECORDED
    return (
        [(p.parent, checks.read_json(p)) for p in sorted(base.glob(f"*/{MANIFEST}"))] if base.is_dir() else []
    )


def compress_samples(source: Path, target: Path) -> None:
    """``source``'s arrays written to ``target`` deflated: pictures of videos are mostly empty
    canvas (Bouncing MNIST's reconstructions shrink ~5x), and they are kept in git."""
    import numpy as np

    with np.load(source) as data:
        arrays = {k: data[k] for k in data.files}
    with open(target, "wb") as f:
        np.savez_compressed(f, **arrays)
