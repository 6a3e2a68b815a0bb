"""Helpers every stage shares: the project root, seeding at entry points, file digests.

Checked loading of datasets and trained checkpoints is the library's (:mod:`apg.loading`).
"""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import numpy as np
import torch


def project_root() -> Path:
    """The directory holding params.yaml (stages run there); ``APG_PROJECT_ROOT`` overrides."""
    return Path(os.environ.get("APG_PROJECT_ROOT", os.getcwd())).resolve()


def seed_everything(seed: int) -> None:
    """Seed torch at an entry point (library code never seeds).

    Every draw the library makes comes from torch's default generator (the compiled kernels'
    Philox keys included, ``apg.random.new_key``), so this fixes a run; numpy's and Python's
    generators are seeded too, so that no later use of them makes runs differ (a Ray actor
    reused for the next trial would otherwise carry their state over).
    """
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def file_digest(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


__all__ = ["file_digest", "project_root", "seed_everything"]
