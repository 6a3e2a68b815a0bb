"""Checkpoints: one ``.pt`` file with the training config (JSON) and state dicts.

Files are written atomically and read with ``torch.load(..., weights_only=True)``, so a
checkpoint can hold tensors and plain containers but never runs code when loaded. Every
record of the archive is checked against its CRC-32 before loading: ``torch.load`` does
not, and a flipped byte inside a tensor would load as a changed weight.
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from apg.data.files import atomic_write


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable or not one of ours."""


def save_checkpoint(path: str | os.PathLike, config: dict[str, Any], state: dict[str, Any]) -> Path:
    payload = {"format": "apg-checkpoint-1", "config": json.dumps(config), "state": state}

    def write(tmp: Path) -> None:
        # Through a file object: given a path, torch.save names the archive's root folder
        # after the (random) temporary file, so two equal checkpoints would differ in bytes.
        with open(tmp, "wb") as handle:
            torch.save(payload, handle)

    return atomic_write(path, write)


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> tuple[dict, dict]:
    """Return ``(config, state)``; raises ``CheckpointError`` with a one-line reason."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file not found: {path}")
    _check_records(path)
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, OSError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"checkpoint file {path} is corrupt or not a checkpoint ({first})") from None
    if not isinstance(payload, dict) or payload.get("format") != "apg-checkpoint-1":
        raise CheckpointError(f"checkpoint file {path} is not an APG checkpoint")
    return json.loads(payload["config"]), payload["state"]


def _check_records(path: Path) -> None:
    """Raise ``CheckpointError`` naming the first archive record whose bytes do not match
    the CRC-32 the archive stores for it. Costs about 2 ms for a 1.6 MB ``model.pt``
    (Bouncing MNIST's AVF cell), where ``torch.load`` takes about 4 ms."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise CheckpointError(f"checkpoint file {path} is corrupt or not a checkpoint ({err})") from None
    if bad is not None:
        raise CheckpointError(f"checkpoint file {path} is damaged: record {bad} fails its CRC check")
