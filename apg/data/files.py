"""Dataset files: ``.npz`` archives with ``x`` shaped ``(M, ...)`` (M datasets) and,
when known, the true latents under the names the task uses (e.g. ``c``, ``mu``, ``tau``).

Users can bring their own files: only ``x`` is required. Writes are atomic (a temporary
file in the same directory, then ``os.replace``), so an interrupted write never leaves a
half-written file under the final name.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np


class DatasetError(ValueError):
    """A dataset file is missing, unreadable, or holds data of the wrong shape or values."""


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_path)`` and move the result to ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_dataset(path: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> Path:
    """Write ``arrays`` (must include ``x``) to ``path`` as an uncompressed ``.npz``."""
    if "x" not in arrays:
        raise DatasetError("a dataset needs an array named 'x'")

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **{k: np.asarray(v) for k, v in arrays.items()})

    return atomic_write(path, write)


def load_dataset(
    path: str | os.PathLike, event_shape: tuple[int | None, ...] | None = None
) -> dict[str, np.ndarray]:
    """Read and check a dataset file.

    ``event_shape``: the expected trailing shape of ``x`` after its dataset axis, with
    ``None`` for free sizes (the GMM takes ``(None, 2)``: any number of 2-D points).
    Raises ``DatasetError`` with a one-line reason.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {k: archive[k] for k in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
        raise DatasetError(f"dataset file {path} is corrupt or not an .npz archive ({err})") from None
    if "x" not in arrays:
        raise DatasetError(f"dataset file {path} has no array 'x' (found {sorted(arrays)})")
    x = arrays["x"]
    if not np.issubdtype(x.dtype, np.number):
        raise DatasetError(f"dataset file {path}: 'x' must be numeric, got dtype {x.dtype}")
    if event_shape is not None:
        ok = x.ndim == 1 + len(event_shape) and all(
            want is None or want == got for want, got in zip(event_shape, x.shape[1:], strict=True)
        )
        if not ok:
            want = ", ".join("*" if s is None else str(s) for s in event_shape)
            raise DatasetError(f"dataset file {path}: 'x' must be shaped (M, {want}), got {x.shape}")
    if x.shape[0] == 0:
        raise DatasetError(f"dataset file {path} holds no datasets")
    if not np.isfinite(x).all():
        raise DatasetError(f"dataset file {path}: 'x' contains NaN or infinite values")
    return arrays
